"""Config translations shared by the foreign formats, which all describe the draft's decoder layer as a transformers
config (Llama's, or Qwen3's / Llama 4's for drafts of those targets).

Layer ids: our `target_layer_ids` are transformers `hidden_states` indices (index i enters decoder layer i). SpecForge,
SGLang and ModelOpt number the *output* of layer i, which is index i + 1; vLLM and speculators use our convention.
"""

from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import Llama4TextConfig, LlamaConfig, PreTrainedConfig, Qwen3Config

from ..configuration_eagle3 import SERVED_SETTINGS_KEY, Eagle3Config, last_layer_tap_refusal, served_target_layer_ids
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
    "attention_dropout",
    "initializer_range",
)
# The target's special-token ids, which the libraries write into a draft's config.
SPECIAL_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
_LAYER_INPUT_FIELDS = (
    *DECODER_LAYER_FIELDS,
    "vocab_size",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "intermediate_size_mlp",
    "num_hidden_layers",
    "use_sliding_window",
    "sliding_window",
    "layer_types",
)
# The decoder-layer config classes of public drafts, by `model_type`: their defaults fill in what a config leaves out
# (speculators writes only non-default fields; Qwen3's default head_dim is 128, not hidden_size // heads).
LAYER_CONFIG_CLASSES: dict[str, type[PreTrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen3": Qwen3Config,  # adds per-head q / k norms
    "llama4_text": Llama4TextConfig,  # the draft layer is a dense Llama layer of width intermediate_size_mlp
}


def draft_fields(
    format_name: str, layer_config: dict[str, Any], draft_config: dict[str, Any], options: ReadOptions
) -> dict[str, Any]:
    """`Eagle3Config` fields of a `format_name` draft whose decoder layer is described by the config `layer_config`.

    Missing fields get the defaults of the layer's transformers config class (e.g. `LlamaConfig`'s
    `rms_norm_eps=1e-6`, RoPE base 10000), as in every project that writes these configs; the EAGLE-3 fields are
    top-level keys of `draft_config`. Every reading that another engine could make differently is stated in
    `converted_from["notes"]`.
    """
    notes = []
    model_type = layer_config.get("model_type", "llama")
    if model_type not in LAYER_CONFIG_CLASSES:
        raise ConversionError(
            f"The draft's decoder layer is a {model_type!r} layer; Eagle3DraftModel implements the layers of "
            f"{', '.join(LAYER_CONFIG_CLASSES)} drafts, so this one cannot be converted faithfully."
        )
    layer_input = {name: layer_config[name] for name in _LAYER_INPUT_FIELDS if name in layer_config}
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(layer_input.get(key), dict):
            layer_input[key] = _rope_for_text(key, layer_input[key], options, notes)
    try:
        layer = LAYER_CONFIG_CLASSES[model_type](**layer_input)
    except (StrictDataclassError, ValueError, TypeError, KeyError) as error:
        raise ConversionError(f"The checkpoint's {model_type} layer config is invalid: {error!r}") from error
    layer_types = getattr(layer, "layer_types", None) or layer_input.get("layer_types")
    sliding = "sliding_attention" in (layer_types or [])
    return {
        **{name: getattr(layer, name, False) for name in DECODER_LAYER_FIELDS},
        "intermediate_size": layer.intermediate_size_mlp if model_type == "llama4_text" else layer.intermediate_size,
        "qk_norm": model_type == "qwen3",
        "layer_types": list(layer_types) if sliding else None,
        "sliding_window": getattr(layer, "sliding_window", None) if sliding else None,
        "vocab_size": layer.vocab_size,
        # `type` is the legacy alias of `rope_type` that LlamaConfig keeps next to it.
        "rope_parameters": {key: value for key, value in layer.rope_parameters.items() if key != "type"},
        "draft_vocab_size": draft_config.get("draft_vocab_size"),
        "target_hidden_size": draft_config.get("target_hidden_size"),
        "target_model_type": draft_config.get("target_model_type"),
        **{name: layer_config[name] for name in SPECIAL_TOKEN_FIELDS if layer_config.get(name) is not None},
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


# EAGLE 3.1 and other options that SpecForge, speculators and vLLM configs name as `Eagle3Config` does, with the same
# meaning (SpecForge's current `norm_output` included: the state fed back is taken after the final norm).
OPTION_FIELDS = ("fc_norm", "norm_before_residual", "norm_output", "norm_before_fc")


def option_fields(config: dict[str, Any]) -> dict[str, bool]:
    """The `OPTION_FIELDS` a foreign config sets, as `Eagle3Config` fields."""
    return {name: bool(config[name]) for name in OPTION_FIELDS if config.get(name) is not None}


def target_layer_ids(config: dict[str, Any], source: str = "config.json") -> list[int] | None:
    """The tapped target layers of a `LlamaForCausalLMEagle3` config (`source`), as sorted `hidden_states` indices:
    `served_target_layer_ids`, the one reader of every path, which refuses keys that disagree."""
    try:
        return served_target_layer_ids(config, source)
    except ValueError as error:
        raise ConversionError(str(error)) from error


def head_fields(fields: dict[str, Any], settings: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Read the draft's head the same way for every format; return the `Eagle3Config` fields it sets.

    Drafts (AngelSlim's among them) may carry `tie_word_embeddings: true` from their target's config while saving a
    separate `lm_head.weight` over the draft vocabulary, which is what their trainer computed and what vLLM serves:
    the checkpoint's own head is used. Without `lm_head.weight`, a draft over the whole vocabulary uses the target's
    lm_head (ModelOpt's gpt-oss-120b drafts, SGLang's `load_lm_head_from_target`); the token embedding as a head
    (`tie_word_embeddings` without `lm_head.weight`) is not implemented.
    """
    tied = bool(settings.get("tie_word_embeddings"))
    notes = fields["converted_from"]["notes"]
    if "lm_head.weight" not in tensors:
        identity = "d2t" not in tensors or not bool(tensors["d2t"].any())
        if not tied and fields["draft_vocab_size"] in (None, fields["vocab_size"]) and identity:
            notes.append("no lm_head.weight: the draft uses the target's lm_head (share_target_lm_head).")
            return {"share_target_lm_head": True}
        raise ConversionError(
            ("The config sets tie_word_embeddings=true and the checkpoint" if tied else "The checkpoint")
            + " has no lm_head.weight"
            + ("" if tied else " but a reduced draft vocabulary")
            + ": the draft's head would be the token embedding or a part of the target's lm_head, which "
            "Eagle3DraftModel does not implement, so it is refused."
        )
    if not tied:
        return {}
    notes.append(
        "tie_word_embeddings=true ignored: the checkpoint has its own lm_head.weight, which its trainer used and "
        "vLLM serves (SGLang would alias lm_head to the token embedding instead)."
    )
    return {}


def llama_fields(config: Eagle3Config) -> dict[str, Any]:
    """The Llama config of `config`'s decoder layer as the libraries write it: RoPE both in the `rope_theta` /
    `rope_scaling` form engines on transformers 4 read and in transformers 5's `rope_parameters`, the target's
    special-token ids, and a sliding window that Qwen3's config keeps (it drops `sliding_window` unless
    `use_sliding_window`)."""
    rope_scaling = dict(config.rope_parameters)
    rope_theta = rope_scaling.pop("rope_theta")
    sliding = {"layer_types": config.layer_types, "sliding_window": config.sliding_window, "use_sliding_window": True}
    return {
        **{name: getattr(config, name) for name in DECODER_LAYER_FIELDS},
        "vocab_size": config.vocab_size,
        "num_hidden_layers": config.num_hidden_layers,
        "rope_theta": rope_theta,
        "rope_scaling": None if rope_scaling.get("rope_type") == "default" else rope_scaling,
        "rope_parameters": dict(config.rope_parameters),
        **{name: getattr(config, name) for name in SPECIAL_TOKEN_FIELDS if getattr(config, name) is not None},
        **(sliding if config.layer_types else {}),
        "tie_word_embeddings": False,
    }



# Where our exports keep, inside a foreign config, the hf-eagle3 fields its engines have no key for (they ignore
# unknown keys); our readers restore them, so a round trip through the format keeps the whole config.
CARRIED_CONFIG_KEY = SERVED_SETTINGS_KEY
CARRIED_FIELDS = (
    "share_target_embedding",
    "share_target_lm_head",
    "target_num_hidden_layers",
    "target_name_or_path",
    "target_fingerprint",
    "tree_depth",
    "tree_top_k",
    "tree_total_tokens",
    "tree_shape",
    "ngram_candidates",
    "ngram_max_match",
    "ngram_max_tokens",
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


def output_of_layer_ids(hf_ids: list[int]) -> list[int]:
    """`hidden_states` indices -> the output-of-layer numbers SpecForge and SGLang store."""
    return [i - 1 for i in hf_ids]


def layer_count(tensors: dict[str, torch.Tensor], prefix: str, stated: int | None) -> int:
    """How many decoder layers the weights under `prefix{i}.` hold (one if none: older exports store it as
    `midlayer.`), checked against the layer count the config states."""
    indices = {int(name[len(prefix):].split(".")[0]) for name in tensors if name.startswith(prefix)}
    count = len(indices) or 1
    if (indices and indices != set(range(count))) or stated not in (None, count):
        raise ConversionError(
            f"The checkpoint holds decoder layers {sorted(indices)} ({prefix}*) but its config states "
            f"num_hidden_layers={stated}: the weights and the config disagree about the draft's depth."
        )
    return count


def layers_renamed(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """`tensors` with decoder layer `prefix0.` renamed `midlayer.` and `prefix{i}.` (i > 0) `extra_layers.{i-1}.`."""
    renamed = {}
    for name, tensor in tensors.items():
        if name.startswith(prefix):
            index, rest = name[len(prefix):].split(".", 1)
            name = f"midlayer.{rest}" if index == "0" else f"extra_layers.{int(index) - 1}.{rest}"
        renamed[name] = tensor
    return renamed


def layers_named(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The inverse of `layers_renamed`."""
    named = {}
    for name, tensor in tensors.items():
        if name.startswith("midlayer."):
            name = prefix + "0." + name.removeprefix("midlayer.")
        elif name.startswith("extra_layers."):
            index, rest = name.removeprefix("extra_layers.").split(".", 1)
            name = f"{prefix}{int(index) + 1}.{rest}"
        named[name] = tensor
    return named


def refuse_last_layer_tap(config: Eagle3Config, what: str) -> None:
    """Raise `last_layer_tap_refusal`'s reason for the draft `config` describes, if any."""
    reason = last_layer_tap_refusal(config.target_layer_ids, config.target_num_hidden_layers, what)
    if reason is not None:
        raise ConversionError(reason)


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
