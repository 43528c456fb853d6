"""Config translations shared by the foreign formats, which all describe the draft's decoder layer as a Llama config.

Layer ids: our `target_layer_ids` are transformers `hidden_states` indices (index i enters decoder layer i). SpecForge,
SGLang and ModelOpt number the *output* of layer i, which is index i + 1; vLLM and speculators use our convention.
"""

from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import LlamaConfig

from hf_eagle3 import Eagle3Config

from .checkpoint import ConversionError

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


def draft_fields(layer_config: dict[str, Any], draft_config: dict[str, Any]) -> dict[str, Any]:
    """`Eagle3Config` fields of a draft whose decoder layer is described by the Llama config `layer_config`.

    Missing Llama fields get transformers' `LlamaConfig` defaults (e.g. `rms_norm_eps=1e-6`, RoPE base 10000), as
    in every project that writes these configs; the EAGLE-3 fields are top-level keys of `draft_config`.
    """
    try:
        llama = LlamaConfig(**{name: layer_config[name] for name in _LLAMA_INPUT_FIELDS if name in layer_config})
    except (StrictDataclassError, ValueError, TypeError) as error:
        raise ConversionError(f"The checkpoint's Llama config is invalid: {error}") from error
    return {
        **{name: getattr(llama, name) for name in DECODER_LAYER_FIELDS},
        "vocab_size": llama.vocab_size,
        # `type` is the legacy alias of `rope_type` that LlamaConfig keeps next to it.
        "rope_parameters": {key: value for key, value in llama.rope_parameters.items() if key != "type"},
        "draft_vocab_size": draft_config.get("draft_vocab_size"),
        "target_hidden_size": draft_config.get("target_hidden_size"),
        "target_model_type": draft_config.get("target_model_type"),
    }


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


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`, the spelling of `torch_dtype` in config files."""
    return str(dtype).removeprefix("torch.")


def hf_layer_ids(output_of_layer_ids: list[int] | None) -> list[int] | None:
    """Output-of-layer numbers (SpecForge, SGLang, ModelOpt; any order) -> sorted `hidden_states` indices."""
    return None if output_of_layer_ids is None else sorted(i + 1 for i in output_of_layer_ids)


def output_of_layer_ids(hf_ids: list[int]) -> list[int]:
    """`hidden_states` indices -> the output-of-layer numbers SpecForge and SGLang store."""
    return [i - 1 for i in hf_ids]


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
