"""Official SafeAILab/EAGLE EAGLE-3 checkpoints (`eagle/model/cnets.py`); import only.

The weights (`pytorch_model.bin`, fp16) already use our names: `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`;
`embed_tokens` is the target's and is not saved. The config is a Llama config (`LlamaForCausalLM`) plus
`draft_vocab_size` and an optional `target_hidden_size`. It has no `rope_theta` (the draft's RoPE base is 10000
whatever the target uses), its `num_hidden_layers` is the draft's and often misstated (there is one layer), and the
tapped target layers are hard-coded to `hidden_states` 2, N//2 and N-3: the converter needs the target's N.
"""

from .checkpoint import CheckpointFormat, ConversionError, DraftCheckpoint, SourceFiles, TargetInfo
from .fields import draft_fields

# The official code builds only these rotary embeddings and raises on any other `rope_scaling` type.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic")


def detect(source: SourceFiles) -> bool:
    return (
        source.config.get("architectures", ["LlamaForCausalLM"]) == ["LlamaForCausalLM"]
        and "eagle_config" not in source.config
        and source.has_weights_under("midlayer.")
    )


def read(source: SourceFiles, target: TargetInfo) -> DraftCheckpoint:
    fields = draft_fields(source.config, source.config)
    rope_type = fields["rope_parameters"]["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConversionError(
            f"The config asks for RoPE scaling {rope_type!r}, which the official EAGLE-3 code does not implement "
            f"(only {', '.join(SUPPORTED_ROPE_TYPES)}), so it did not train this draft. Pass the --from format of "
            "the project that did."
        )
    return DraftCheckpoint.build(fields, source.tensors, target)


FORMAT = CheckpointFormat(
    name="official",
    description="SafeAILab/EAGLE EAGLE-3 (LlamaForCausalLM config, midlayer.* weights, hard-coded target layers)",
    detect=detect,
    read=read,
)
