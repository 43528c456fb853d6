"""SpecForge / SGLang drafts (`LlamaForCausalLMEagle3`); import and export.

Weights use our names (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`, optional `embed_tokens`), saved as
safetensors. The config is a Llama config plus `draft_vocab_size`, `target_hidden_size` and
`eagle_config.eagle_aux_hidden_state_layer_ids`, numbered as *outputs* of target layers (or a top-level
`eagle_aux_hidden_state_layer_ids` in `hidden_states` indices, which vLLM reads). AngelSlim writes the same files
under vLLM's architecture name `Eagle3LlamaForCausalLM`, without layer ids. SGLang ignores `t2d`,
silently skips unknown weights and always replaces the draft's embedding with the target's, so the export writes
exactly the weights SGLang uses and refuses a draft with an embedding of its own. What SGLang has no key for (the
target's id and layer count, the draft tree settings) is kept under `hf_eagle3`, which SGLang ignores.
"""

from pathlib import Path

from .checkpoint import CheckpointFormat, ConversionError, DraftCheckpoint, ReadOptions, SourceFiles, TargetInfo
from .fields import (
    carried_fields,
    draft_fields,
    dtype_name,
    llama_fields,
    output_of_layer_ids,
    refuse_last_layer_tap,
    refuse_unfaithful,
    restored_fields,
    target_layer_ids,
    untied_head,
)
from .files import write_checkpoint_files
from .modelopt import MODELOPT_EAGLE_CONFIG_KEYS

ARCHITECTURE = "LlamaForCausalLMEagle3"
# SpecForge / SGLang's name, and vLLM's, which AngelSlim writes.
ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")

# SpecForge / SGLang options of later EAGLE variants that our draft does not implement.
UNFAITHFUL_SETTINGS = {
    "use_aux_hidden_state": (False, "an EAGLE-1/2 draft fed by the last target layer only"),
    "fc_norm": (True, "an RMSNorm on each target feature before fc"),
    "norm_output": (True, "the state fed back to the next draft step taken after the final norm"),
    "norm_before_residual": (True, "the residual stream taken after hidden_norm"),
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
    fields = draft_fields("sglang", source.config, source.config, options)
    fields["target_layer_ids"] = target_layer_ids(source.config)
    untied_head(source.config, source.tensors, fields["converted_from"]["notes"])
    fields.update(restored_fields(source.config))
    return DraftCheckpoint.build(fields, source.tensors, target)


def write(checkpoint: DraftCheckpoint, folder: Path) -> None:
    config = checkpoint.config
    refuse_last_layer_tap(config, "the draft served by SGLang")
    if not config.share_target_embedding:
        raise ConversionError(
            "SGLang always replaces a draft's token embedding with the target's, and this draft has one of its own "
            "(share_target_embedding=false), so it would not be served as trained. If that embedding is a copy of "
            "the target's, convert with --share-target-embedding."
        )
    sglang_config = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        **llama_fields(config),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": output_of_layer_ids(config.target_layer_ids),
            "use_aux_hidden_state": True,
        },
        "torch_dtype": dtype_name(checkpoint.dtype),
        **carried_fields(config),
    }
    if config.target_model_type is not None:
        sglang_config["target_model_type"] = config.target_model_type
    write_checkpoint_files(folder, sglang_config, checkpoint.tensors)


FORMAT = CheckpointFormat(
    name="sglang",
    description="SpecForge / SGLang LlamaForCausalLMEagle3 (midlayer.* weights, output-of-layer target ids)",
    detect=detect,
    read=read,
    write=write,
)
