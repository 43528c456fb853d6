"""SpecForge / SGLang drafts (`LlamaForCausalLMEagle3`); import and export.

Weights use our names (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`, optional `embed_tokens`), saved as
safetensors. The config is a Llama config plus `draft_vocab_size`, `target_hidden_size` and
`eagle_config.eagle_aux_hidden_state_layer_ids`, numbered as *outputs* of target layers (which SGLang reads), and a
top-level `eagle_aux_hidden_state_layer_ids` in `hidden_states` indices (which vLLM and llama.cpp read): the export
writes both, and a config whose keys disagree is refused. AngelSlim writes the same files
under vLLM's architecture name `Eagle3LlamaForCausalLM`, without layer ids. EAGLE 3.1 drafts set `fc_norm` (weights
`fc_norm.{0,1,2}`) and `norm_output`, read in SpecForge's current meaning (the state fed back is taken after the final
norm; SpecForge 0.2.0 meant "final norm before lm_head"), which the export never writes: its absence is plain EAGLE-3
in both; `norm_before_residual` / `norm_before_fc` are read as vLLM reads them in this format (SGLang ignores them).
Only one decoder layer is accepted: SGLang builds later layers unlike vLLM. SGLang ignores `t2d`, silently skips
unknown weights and always replaces the draft's embedding with the target's, so the export writes
exactly the weights SGLang uses and refuses a draft with an embedding of its own. What SGLang has no key for (the
target's id and layer count, the draft tree settings) is kept under `hf_eagle3`, which SGLang ignores.

This is also the layout `save_pretrained` writes (`served`), which vLLM and SGLang load by repository id: the export
puts our modeling code beside the weights, with an `auto_map` naming `AutoModel` only (see `served_config`).
"""

import shutil
from pathlib import Path
from typing import Any

from .. import configuration_eagle3, modeling_eagle3
from ..configuration_eagle3 import LAYER_IDS_KEY, SERVED_ARCHITECTURE, Eagle3Config, last_layer_tap_refusal
from .checkpoint import CheckpointFormat, ConversionError, DraftCheckpoint, ReadOptions, SourceFiles, TargetInfo
from .fields import (
    carried_fields,
    draft_fields,
    dtype_name,
    head_fields,
    llama_fields,
    option_fields,
    output_of_layer_ids,
    refuse_unfaithful,
    restored_fields,
    target_layer_ids,
)
from .files import write_checkpoint_files
from .modelopt import MODELOPT_EAGLE_CONFIG_KEYS

ARCHITECTURE = SERVED_ARCHITECTURE
# SpecForge / SGLang's name, and vLLM's, which AngelSlim writes.
ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")

# SpecForge / SGLang settings of variants that our draft does not implement.
UNFAITHFUL_SETTINGS = {
    "use_aux_hidden_state": (False, "an EAGLE-1/2 draft fed by the last target layer only"),
}
# Options SGLang does not read (vLLM does, in this format too): exporting a draft that uses them would change it.
SGLANG_IGNORES = ("norm_before_residual", "norm_before_fc", "qk_norm")
REMOTE_CODE = {"AutoModel": "modeling_eagle3.Eagle3DraftModel"}


# SpecForge changed what `norm_output` means after 0.2.0 (there: apply the final norm before lm_head, default true,
# the pre-norm state always fed back); configs read with the later meaning, stated where 0.2.0 reads them otherwise.
_NORM_OUTPUT_READINGS = {
    False: "norm_output=false read as later SpecForge reads it (plain EAGLE-3); SpecForge 0.2.0 reads it as no final "
    "norm before lm_head.",
    True: "norm_output=true read as later SpecForge reads it (EAGLE 3.1: the normalised state fed back); SpecForge "
    "0.2.0 reads it as plain EAGLE-3.",
}


def detect(source: SourceFiles) -> bool:
    eagle_config = source.config.get("eagle_config") or {}
    return (
        any(name in ARCHITECTURES for name in source.config.get("architectures", [ARCHITECTURE]))
        and source.has_weights_under("midlayer.")
        and not any(key in eagle_config for key in MODELOPT_EAGLE_CONFIG_KEYS)
    )


def read(source: SourceFiles, target: TargetInfo, options: ReadOptions) -> DraftCheckpoint:
    eagle_config = source.config.get("eagle_config") or {}
    refuse_unfaithful("SpecForge/SGLang", {**source.config, **eagle_config}, UNFAITHFUL_SETTINGS)
    if source.config.get("num_hidden_layers", 1) > 1:
        raise ConversionError(
            f"The config sets num_hidden_layers={source.config['num_hidden_layers']}: SGLang's later draft layers "
            "(additional_layers.*) restart the residual stream from each layer's output and normalise it with "
            "hidden_norm, unlike vLLM's and speculators' plain Llama layers, which is what Eagle3DraftModel "
            "implements; the draft is refused rather than converted into another function."
        )
    fields = draft_fields("sglang", source.config, source.config, options) | option_fields(source.config)
    fields["target_layer_ids"] = target_layer_ids(source.config, str(source.path / "config.json"))
    if "norm_output" in source.config:
        fields["converted_from"]["notes"].append(_NORM_OUTPUT_READINGS[bool(source.config["norm_output"])])
    for name in ("norm_before_residual", "norm_before_fc"):
        if fields.get(name):
            fields["converted_from"]["notes"].append(f"{name}=true read as vLLM serves it; SGLang ignores it.")
    fields.update(head_fields(fields, source.config, source.tensors))
    fields.update(restored_fields(source.config))
    return DraftCheckpoint.build(fields, source.tensors, target)


def refusal(config: Eagle3Config) -> str | None:
    """Why the draft `config` describes cannot be served in this format (SGLang, SpecForge), or `None` if it can."""
    if config.target_layer_ids is None:
        return (
            "The draft records no target layers (target_layer_ids), which SGLang reads from its config: set "
            "draft.config.target_num_hidden_layers to its target's layer count (or run it once in its target's "
            "generate, which records them)."
        )
    tapping_last_layer = last_layer_tap_refusal(config.target_layer_ids, config.target_num_hidden_layers,
                                                "the draft served by SGLang")
    if tapping_last_layer is not None:
        return tapping_last_layer
    settings = [f"{name}=True" for name in SGLANG_IGNORES if getattr(config, name)]
    if config.num_hidden_layers > 1:
        settings.append(f"num_hidden_layers={config.num_hidden_layers}")
    if config.layer_types is not None and "sliding_attention" in config.layer_types:
        settings.append(f"layer_types={config.layer_types}")
    if settings:
        return (
            f"The draft uses {', '.join(settings)}, which SGLang does not implement (or, for several layers, "
            "implements differently): it would serve another function. Export to speculators (vLLM) instead."
        )
    if config.norm_output:
        return (
            "The draft feeds back the normalised state (norm_output=True, EAGLE 3.1). SpecForge 0.2.0 reads "
            "norm_output: true as plain EAGLE-3 (final norm before lm_head, the pre-norm state fed back), later "
            "SpecForge as this draft: no config says it to both. Export to speculators instead, whose norm_output "
            "vLLM serves as trained."
        )
    if not config.share_target_embedding:
        return (
            "SGLang always replaces a draft's token embedding with the target's, and this draft has one of its own "
            "(share_target_embedding=false), so it would not be served as trained. If that embedding is a copy of "
            "the target's, convert with --share-target-embedding."
        )
    return None


def served_config(checkpoint: DraftCheckpoint) -> dict[str, Any]:
    """The `config.json` contents of `checkpoint` in this format, which `refusal` must have found it can express."""
    config = checkpoint.config
    sglang_config = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        **llama_fields(config),
        # SGLang takes a missing draft vocabulary to mean the target's lm_head (`load_lm_head_from_target`).
        "draft_vocab_size": None if config.share_target_lm_head else config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "fc_norm": config.fc_norm,
        # No norm_output key: SpecForge 0.2.0 reads its absence as "final norm before lm_head", later SpecForge as
        # "the pre-norm state fed back"; together, plain EAGLE-3 in every version.
        # The target layers in both numberings the engines read (`served_target_layer_ids` reads them back).
        LAYER_IDS_KEY: list(config.target_layer_ids),
        "eagle_config": {LAYER_IDS_KEY: output_of_layer_ids(config.target_layer_ids), "use_aux_hidden_state": True},
        "torch_dtype": dtype_name(checkpoint.dtype),
        **carried_fields(config),
        # `AutoModel.from_pretrained(repo, trust_remote_code=True)` builds the draft from the copy of our modeling
        # code; no `AutoConfig` entry, so the engines read the config as a LlamaConfig even with trust_remote_code.
        "auto_map": dict(REMOTE_CODE),
    }
    if config.target_model_type is not None:
        sglang_config["target_model_type"] = config.target_model_type
    return sglang_config


def write(checkpoint: DraftCheckpoint, folder: Path) -> None:
    reason = refusal(checkpoint.config)
    if reason is not None:
        raise ConversionError(reason)
    write_checkpoint_files(folder, served_config(checkpoint), checkpoint.tensors)
    for module in (configuration_eagle3, modeling_eagle3):  # the remote code `auto_map` names
        shutil.copyfile(module.__file__, folder / Path(module.__file__).name)


FORMAT = CheckpointFormat(
    name="sglang",
    description="SpecForge / SGLang LlamaForCausalLMEagle3 (midlayer.* weights, output-of-layer target ids)",
    detect=detect,
    read=read,
    write=write,
)
