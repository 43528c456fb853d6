"""vLLM / vllm-project/speculators drafts (`Eagle3Speculator`); import and export.

Weights: `layers.{i}.*` for the decoder layers (layers after the first are plain Llama layers), `fc`, optional
`fc_norm.{0,1,2}` / `input_norm`, `norm`, `lm_head`, `d2t`, `t2d` (vLLM only reduces the vocabulary when `t2d` is
present) and an optional `embed_tokens`. The config nests the decoder layers' Llama or Qwen3 config (q / k norms) in
`transformer_layer_config` (speculators writes only its non-default fields), keeps `draft_vocab_size`,
`target_hidden_size`, the options `norm_before_residual`, `norm_before_fc`, `fc_norm`, `norm_output` and
`eagle_aux_hidden_state_layer_ids` (our `hidden_states` indices) at the top level, and names the target under
`speculators_config.verifier`. The first proposal method's
`speculative_tokens` is vLLM's default number of drafted tokens; it maps to our `tree_depth`. The rest of the draft
tree settings and the target's layer count are kept under `hf_eagle3`, which vLLM ignores.
"""

from pathlib import Path

from .checkpoint import CheckpointFormat, ConversionError, DraftCheckpoint, ReadOptions, SourceFiles, TargetInfo
from .fields import (
    OPTION_FIELDS,
    carried_fields,
    draft_fields,
    dtype_name,
    head_fields,
    layer_count,
    layers_named,
    layers_renamed,
    llama_fields,
    option_fields,
    refuse_last_layer_tap,
    restored_fields,
)
from .files import write_checkpoint_files

LAYER_PREFIX = "layers."


def detect(source: SourceFiles) -> bool:
    return source.config.get("speculators_model_type") == "eagle3"


def read(source: SourceFiles, target: TargetInfo, options: ReadOptions) -> DraftCheckpoint:
    config = source.config
    layer_config = config.get("transformer_layer_config") or {}
    if "norm_before_residual" not in config:
        # speculators' Eagle3SpeculatorConfig always writes it (default false); vLLM's speculators config reader
        # (`update_eagle3`) reads a missing value as true: a config without it is hand-made and ambiguous.
        raise ConversionError(
            "config.json has no norm_before_residual: speculators reads a missing value as false and vLLM as true, "
            "so what the draft computes is ambiguous. Add the key with the value the draft was trained with."
        )
    speculators_config = config.get("speculators_config") or {}
    if "model_type" not in layer_config:
        layer_config = {**layer_config, "model_type": _unnamed_layer_type(source.tensors)}
    fields = draft_fields("speculators", layer_config, config, options) | option_fields(config)
    fields.update(head_fields(fields, {**layer_config, **config}, source.tensors))
    fields["num_hidden_layers"] = layer_count(source.tensors, LAYER_PREFIX, layer_config.get("num_hidden_layers"))
    fields["target_layer_ids"] = config.get("eagle_aux_hidden_state_layer_ids")
    fields["target_name_or_path"] = (speculators_config.get("verifier") or {}).get("name_or_path") or None
    speculative_tokens = _default_proposal_method(speculators_config).get("speculative_tokens")
    if speculative_tokens is not None:
        fields["tree_depth"] = speculative_tokens
    fields.update(restored_fields(config))
    tensors = layers_renamed(source.tensors, LAYER_PREFIX)
    if fields.get("share_target_embedding"):  # an hf-eagle3 export: the embedding it wrote is the target's
        tensors.pop("embed_tokens.weight", None)
    return DraftCheckpoint.build(fields, tensors, target)


def _unnamed_layer_type(tensors: dict) -> str:
    """The `model_type` of a `transformer_layer_config` that names none: speculators reads it as Qwen3 (q / k norms);
    refused where the weights have no q / k norms, which speculators would then leave uninitialised."""
    if f"{LAYER_PREFIX}0.self_attn.q_norm.weight" in tensors:
        return "qwen3"
    raise ConversionError(
        "transformer_layer_config has no model_type: speculators reads it as a Qwen3 layer (per-head q / k norms), but "
        "the weights have no q_norm / k_norm, so speculators would run norms it has no weights for. Add the layer's "
        'model_type (e.g. "model_type": "llama") to transformer_layer_config.'
    )


def write(checkpoint: DraftCheckpoint, folder: Path) -> None:
    config = checkpoint.config
    refuse_last_layer_tap(config, "the draft served by vLLM")
    if config.share_target_lm_head:
        raise ConversionError(
            "The draft uses the target's lm_head (share_target_lm_head=True), which speculators drafts cannot say: "
            "vLLM would build an lm_head of its own and find no weights for it. Export to sglang instead."
        )
    if config.target_name_or_path is None:
        raise ConversionError(
            "speculators (0.9.0) loads a draft together with its verifier's config (speculators_config.verifier), "
            "and this draft records no target: pass the target's Hub id or folder, `hf-eagle3 convert ... --to "
            "speculators --target-name-or-path TARGET`."
        )
    if config.target_hidden_size != config.hidden_size:
        raise ConversionError(
            f"speculators (0.9.0) builds fc with 3 x hidden_size = {3 * config.hidden_size} inputs, and this draft's "
            f"target is {config.target_hidden_size} wide (fc reads {3 * config.target_hidden_size}): speculators "
            "cannot load it. Export to sglang instead, which vLLM and SGLang serve with target_hidden_size."
        )
    tensors = layers_named(checkpoint.tensors, LAYER_PREFIX)
    if config.share_target_embedding:
        if checkpoint.target_embedding is None:
            raise ConversionError(
                "speculators (0.9.0) fills a missing embed_tokens from the target only where it finds NaN, which "
                "transformers 5's loading never leaves, so it would run this draft (which shares the target's "
                "embedding) with an uninitialised one. Give the target's embedding to write with the draft: "
                "`hf-eagle3 convert ... --to speculators --target-embedding TARGET` (its folder or Hub id)."
            )
        tensors["embed_tokens.weight"] = checkpoint.target_embedding
    speculators_config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": {"model_type": "qwen3" if config.qk_norm else "llama", **llama_fields(config)},
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        # Every option written, norm_before_residual above all: vLLM reads a missing value as true.
        **{name: getattr(config, name) for name in OPTION_FIELDS},
        "eagle_aux_hidden_state_layer_ids": config.target_layer_ids,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": config.tree_depth,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {"name_or_path": config.target_name_or_path, "architectures": []},
        },
        "torch_dtype": dtype_name(checkpoint.dtype),
        **carried_fields(config),
    }
    write_checkpoint_files(folder, speculators_config, tensors)


def _default_proposal_method(speculators_config: dict) -> dict:
    """The proposal method named by `default_proposal_method`, else the first one listed."""
    methods = speculators_config.get("proposal_methods") or [{}]
    default = speculators_config.get("default_proposal_method")
    return next((method for method in methods if method.get("proposal_type") == default), methods[0])


FORMAT = CheckpointFormat(
    name="speculators",
    description="vLLM speculators Eagle3Speculator (layers.N.* weights, hidden_states target ids)",
    detect=detect,
    read=read,
    write=write,
)
