"""Config translations shared by the foreign formats, which all describe the draft's decoder layer as a Llama config.

Layer ids: our `target_layer_ids` are transformers `hidden_states` indices (index i enters decoder layer i). SpecForge,
SGLang and ModelOpt number the *output* of layer i, which is index i + 1; vLLM and speculators use our convention.
"""

from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import LlamaConfig

from hf_eagle3 import Eagle3Config

from .checkpoint import ConversionError, ReadOptions

# Llama config fields of the draft's decoder layer that `Eagle3Config` holds under the same name.
DECODER_LAYER_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "attention_bias",
    "mlp_bias",
)
_LLAMA_INPUT_FIELDS = (*DECODER_LAYER_FIELDS, "vocab_size", "rope_theta", "rope_scaling", "rope_parameters")


def draft_fields(
    format_name: str, layer_config: dict[str, Any], draft_config: dict[str, Any], options: ReadOptions
) -> dict[str, Any]:
    """`Eagle3Config` fields of a `format_name` draft whose decoder layer is described by the Llama config `layer_config`.

    Missing Llama fields get transformers' `LlamaConfig` defaults (e.g. `rms_norm_eps=1e-6`, RoPE base 10000), as
    in every project that writes these configs; the EAGLE-3 fields are top-level keys of `draft_config`. Every
    reading that another engine could make differently is stated in `converted_from["notes"]`.
    """
    notes = []
    llama_input = {name: layer_config[name] for name in _LLAMA_INPUT_FIELDS if name in layer_config}
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(llama_input.get(key), dict):
            llama_input[key] = _rope_for_text(key, llama_input[key], options, notes)
    try:
        llama = LlamaConfig(**llama_input)
    except (StrictDataclassError, ValueError, TypeError, KeyError) as error:
        raise ConversionError(f"The checkpoint's Llama config is invalid: {error!r}") from error
    return {
        **{name: getattr(llama, name) for name in DECODER_LAYER_FIELDS},
        "vocab_size": llama.vocab_size,
        # `type` is the legacy alias of `rope_type` that LlamaConfig keeps next to it.
        "rope_parameters": {key: value for key, value in llama.rope_parameters.items() if key != "type"},
        "draft_vocab_size": draft_config.get("draft_vocab_size"),
        "target_hidden_size": draft_config.get("target_hidden_size"),
        "target_model_type": draft_config.get("target_model_type"),
        "converted_from": {"format": format_name, "notes": notes},
    }


def _rope_for_text(key: str, rope: dict[str, Any], options: ReadOptions, notes: list[str]) -> dict[str, Any]:
    """A draft's RoPE settings as transformers' `LlamaConfig` reads them, the reading chosen stated in `notes`.

    Multimodal RoPE (`mrope_section`, Qwen2.5-VL / Qwen3-VL drafts) gives every text token the same position in its
    three sections, so for text it is the plain RoPE SGLang serves it as. YaRN's `mscale` / `mscale_all_dim` are
    read as `options.yarn_mscale` says.
    """
    rope = dict(rope)
    rope_type = rope.get("rope_type", rope.get("type"))
    if "mrope_section" in rope or rope_type == "mrope":
        for name in ("mrope_section", "mrope_interleaved"):
            rope.pop(name, None)
        if rope_type == "mrope":
            rope_type = rope["rope_type"] = rope["type"] = "default"
        notes.append(
            f"{key} is multimodal RoPE (mrope): read as {rope_type} RoPE, which it equals for text positions (as "
            "SGLang serves it); image and video positions are not supported."
        )
    mscales = sorted(name for name in ("mscale", "mscale_all_dim") if name in rope)
    if rope_type == "yarn" and mscales:
        if options.yarn_mscale == "serving":
            for name in mscales:
                rope.pop(name)
            notes.append(
                f"YaRN {' and '.join(mscales)} dropped (yarn_mscale='serving'): the attention factor is "
                "0.1 ln(factor) + 1, as SGLang and vLLM serve the draft."
            )
        else:
            notes.append(
                f"YaRN {' and '.join(mscales)} read as transformers and SpecForge's training read them "
                "(yarn_mscale='transformers'); SGLang and vLLM ignore them when serving: convert with "
                "--yarn-mscale serving for their reading."
            )
    return rope


def target_layer_ids(config: dict[str, Any]) -> list[int] | None:
    """The tapped target layers of a `LlamaForCausalLMEagle3` config, as sorted `hidden_states` indices.

    SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` (outputs of layers); vLLM prefers a top-level
    `eagle_aux_hidden_state_layer_ids`, which it reads as `hidden_states` indices. Both present and disagreeing:
    the engines would feed the draft different layers, so it is refused.
    """
    nested = hf_layer_ids((config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
    top_level = config.get("eagle_aux_hidden_state_layer_ids")
    top_level = sorted(top_level) if top_level else None
    if nested and top_level and nested != top_level:
        raise ConversionError(
            f"The config lists eagle_aux_hidden_state_layer_ids twice: top-level {config['eagle_aux_hidden_state_layer_ids']} "
            f"(hidden_states indices, as vLLM reads it) and in eagle_config "
            f"{config['eagle_config']['eagle_aux_hidden_state_layer_ids']} (outputs of layers, hidden_states {nested}, "
            "as SGLang reads it). They disagree, so which layers the draft was trained on is unknown: remove the one "
            "that is wrong."
        )
    return top_level or nested


def untied_head(settings: dict[str, Any], tensors: dict[str, torch.Tensor], notes: list[str]) -> None:
    """Check a `tie_word_embeddings` flag the same way for every format: the checkpoint's own `lm_head` is used.

    Drafts (AngelSlim's among them) may carry `tie_word_embeddings: true` from their target's config while saving a
    separate `lm_head.weight` over the draft vocabulary, which is what their trainer computed and what vLLM serves.
    Without `lm_head.weight` the head would be the token embedding, which this draft does not implement.
    """
    if not settings.get("tie_word_embeddings"):
        return
    if "lm_head.weight" not in tensors:
        raise ConversionError(
            "The config sets tie_word_embeddings=true and the checkpoint has no lm_head.weight: its head is the "
            "token embedding, which Eagle3DraftModel does not implement, so it is refused."
        )
    notes.append(
        "tie_word_embeddings=true ignored: the checkpoint has its own lm_head.weight, which its trainer used and "
        "vLLM serves (SGLang would alias lm_head to the token embedding instead)."
    )


def llama_fields(config: Eagle3Config) -> dict[str, Any]:
    """The Llama config of `config`'s decoder layer, RoPE in the `rope_theta` / `rope_scaling` form engines read."""
    rope_scaling = dict(config.rope_parameters)
    rope_theta = rope_scaling.pop("rope_theta")
    return {
        **{name: getattr(config, name) for name in DECODER_LAYER_FIELDS},
        "vocab_size": config.vocab_size,
        "num_hidden_layers": 1,
        "rope_theta": rope_theta,
        "rope_scaling": None if rope_scaling.get("rope_type") == "default" else rope_scaling,
        "tie_word_embeddings": False,
    }


# Where our exports keep, inside a foreign config, the hf-eagle3 fields its engines have no key for (they ignore
# unknown keys); our readers restore them, so a round trip through the format keeps the whole config.
CARRIED_CONFIG_KEY = "hf_eagle3"
CARRIED_FIELDS = (
    "target_num_hidden_layers",
    "target_name_or_path",
    "tree_depth",
    "tree_top_k",
    "tree_total_tokens",
    "tree_shape",
    "acceptance_profile",
    "converted_from",
)


def carried_fields(config: Eagle3Config) -> dict[str, Any]:
    """`{CARRIED_CONFIG_KEY: ...}`: the fields of `config` a foreign config has no key for."""
    return {CARRIED_CONFIG_KEY: {name: getattr(config, name) for name in CARRIED_FIELDS}}


def restored_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The `Eagle3Config` fields an hf-eagle3 export kept under `CARRIED_CONFIG_KEY` of `config` (none otherwise)."""
    carried = config.get(CARRIED_CONFIG_KEY) or {}
    return {name: carried[name] for name in CARRIED_FIELDS if name in carried}


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`, the spelling of `torch_dtype` in config files."""
    return str(dtype).removeprefix("torch.")


def hf_layer_ids(output_of_layer_ids: list[int] | None) -> list[int] | None:
    """Output-of-layer numbers (SpecForge, SGLang, ModelOpt; any order) -> sorted `hidden_states` indices."""
    return None if output_of_layer_ids is None else sorted(i + 1 for i in output_of_layer_ids)


def output_of_layer_ids(hf_ids: list[int]) -> list[int]:
    """`hidden_states` indices -> the output-of-layer numbers SpecForge and SGLang store."""
    return [i - 1 for i in hf_ids]


def refuse_last_layer_tap(config: Eagle3Config, what: str) -> None:
    """Refuse to move a draft that reads the output of the target's last layer between hf-eagle3 and the engines.

    SGLang and vLLM capture that output before the target's final norm; transformers' `hidden_states[N]`, which
    `Eagle3DraftModel` is fed, comes after it.
    """
    num_layers = config.target_num_hidden_layers
    if num_layers is not None and num_layers in config.target_layer_ids:
        raise ConversionError(
            f"The draft's target layers include the output of the target's last layer (hidden_states index "
            f"{num_layers} of an {num_layers}-layer target; {num_layers - 1} in output-of-layer numbering). SGLang "
            f"and vLLM take it before the target's final norm, transformers' hidden_states[{num_layers}] after it, "
            f"and hf-eagle3 does not capture the pre-norm tensor: {what} would read another tensor than it was "
            "trained on, so it is refused."
        )


def refuse_unfaithful(format_name: str, settings: dict[str, Any], unfaithful: dict[str, tuple[Any, str]]) -> None:
    """Raise if `settings` sets any key of `unfaithful` to its value there, a variant our draft cannot represent.

    `unfaithful` maps a config key to `(value, what that value means)`.
    """
    problems = [
        f"{key}={settings[key]!r} ({meaning})"
        for key, (value, meaning) in unfaithful.items()
        if key in settings and settings[key] == value
    ]
    if problems:
        raise ConversionError(
            f"This {format_name} draft uses {'; '.join(problems)}, which Eagle3DraftModel does not implement: "
            "converting it would silently change its predictions, so it is refused."
        )
