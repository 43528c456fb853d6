"""Official SafeAILab/EAGLE EAGLE-3 checkpoints (`eagle/model/cnets.py`); import only.

The weights (`pytorch_model.bin`, fp16) already use our names: `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`;
`embed_tokens` is the target's and is not saved. The config is a Llama config (`LlamaForCausalLM`) plus
`draft_vocab_size` and an optional `target_hidden_size`. It has no `rope_theta` (the draft's RoPE base is 10000
whatever the target uses), its `num_hidden_layers` is the draft's and often misstated (there is one layer), and the
tapped target layers are hard-coded to `hidden_states` 2, N//2 and N-3: the converter needs the target's N. When the
draft vocabulary is the whole target vocabulary the official loader drops `d2t` / `t2d` (released drafts of that kind
store an all-zero `t2d`), and so does this reader.
"""

from .checkpoint import CheckpointFormat, ConversionError, DraftCheckpoint, ReadOptions, SourceFiles, TargetInfo
from .fields import draft_fields, head_fields

# The official code builds only these rotary embeddings and raises on any other `rope_scaling` type.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic")


def detect(source: SourceFiles) -> bool:
    return (
        source.config.get("architectures", ["LlamaForCausalLM"]) == ["LlamaForCausalLM"]
        and "eagle_config" not in source.config
        and source.has_weights_under("midlayer.")
    )


def read(source: SourceFiles, target: TargetInfo, options: ReadOptions) -> DraftCheckpoint:
    fields = draft_fields("official", source.config, source.config, options)
    notes = fields["converted_from"]["notes"]
    rope_type = fields["rope_parameters"]["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConversionError(
            f"The config asks for RoPE scaling {rope_type!r}, which the official EAGLE-3 code does not implement "
            f"(only {', '.join(SUPPORTED_ROPE_TYPES)}), so it did not train this draft. If the project that did serves "
            "it with SGLang or vLLM (which read the config as written), convert with --from sglang."
        )
    tensors = dict(source.tensors)
    fields.update(head_fields(fields, source.config, tensors))
    if fields["draft_vocab_size"] in (None, fields["vocab_size"]) and any(
        [tensors.pop(name, None) is not None for name in ("d2t", "t2d")]
    ):
        notes.append("d2t / t2d dropped: the draft vocabulary is the whole target vocabulary (as the official loader).")
    return DraftCheckpoint.build(fields, tensors, target)


FORMAT = CheckpointFormat(
    name="official",
    description="SafeAILab/EAGLE EAGLE-3 (LlamaForCausalLM config, midlayer.* weights, hard-coded target layers)",
    detect=detect,
    read=read,
)
