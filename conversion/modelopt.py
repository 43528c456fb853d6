"""NVIDIA ModelOpt EAGLE-3 exports (`nvidia/*-Eagle3`); import only.

Weights: `layers.{i}.*` (older exports: `midlayer.*`; layers after the first are plain Llama layers), `fc`, `norm`,
`lm_head`, an optional `d2t` listing the draft vocabulary by token frequency (offsets may be negative) and no `t2d`.
The reader sorts that vocabulary into ascending target ids together with the rows of `lm_head`, which is exact. The
config is a Llama config (the target's RoPE settings included) with `eagle_config.eagle_aux_hidden_state_layer_ids`
numbered as outputs of target layers, possibly unsorted; the draft concatenates the taps in layer order whatever the
listing order.
"""

from .checkpoint import CheckpointFormat, DraftCheckpoint, ReadOptions, SourceFiles, TargetInfo
from .fields import draft_fields, head_fields, layer_count, layers_renamed, refuse_unfaithful, target_layer_ids

ARCHITECTURE = "LlamaForCausalLMEagle3"  # SGLang's class name, which ModelOpt exports reuse

# `eagle_config` keys only ModelOpt writes.
MODELOPT_EAGLE_CONFIG_KEYS = ("use_input_layernorm_in_first_layer", "use_last_layernorm", "use_mtp_layernorm")

UNFAITHFUL_SETTINGS = {
    "use_aux_hidden_state": (False, "an EAGLE-1/2 draft fed by the last target layer only"),
    "use_input_layernorm_in_first_layer": (False, "the embedding enters attention without input_layernorm"),
    "use_last_layernorm": (False, "no final norm before lm_head"),
    "use_mtp_layernorm": (True, "extra MTP norms on the embedding and the feature"),
}


def detect(source: SourceFiles) -> bool:
    eagle_config = source.config.get("eagle_config") or {}
    return ARCHITECTURE in source.config.get("architectures", []) and (
        source.has_weights_under("layers.0.") or any(key in eagle_config for key in MODELOPT_EAGLE_CONFIG_KEYS)
    )


def read(source: SourceFiles, target: TargetInfo, options: ReadOptions) -> DraftCheckpoint:
    eagle_config = source.config.get("eagle_config") or {}
    refuse_unfaithful("ModelOpt", eagle_config, UNFAITHFUL_SETTINGS)
    fields = draft_fields("modelopt", source.config, source.config, options)
    fields["target_layer_ids"] = target_layer_ids(source.config, str(source.path / "config.json"))
    fields.update(head_fields(fields, source.config, source.tensors))
    fields["num_hidden_layers"] = layer_count(source.tensors, "layers.", source.config.get("num_hidden_layers"))
    return DraftCheckpoint.build(fields, layers_renamed(source.tensors, "layers."), target)


FORMAT = CheckpointFormat(
    name="modelopt",
    description="NVIDIA ModelOpt export (layers.0.* weights, frequency-ordered d2t, no t2d)",
    detect=detect,
    read=read,
)
