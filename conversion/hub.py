"""hf-eagle3's own layout: what `Eagle3DraftModel.save_pretrained(..., served_layout=False)` writes (config with
`model_type: "eagle3"` and `auto_map`, `model.safetensors` under our weight names, and the modeling code for
`trust_remote_code`); `save_pretrained` writes the `sglang` layout, which the serving engines load, by default."""

from pathlib import Path

from ..configuration_eagle3 import Eagle3Config
from .checkpoint import CheckpointFormat, DraftCheckpoint, ReadOptions, SourceFiles, TargetInfo, meta_model


def detect(source: SourceFiles) -> bool:
    return source.config.get("model_type") == Eagle3Config.model_type


def read(source: SourceFiles, target: TargetInfo, options: ReadOptions) -> DraftCheckpoint:
    # `options` choose between engines' readings of foreign configs; a hub config records its choices already.
    fields = {name: value for name, value in source.config.items() if name in Eagle3Config.__annotations__}
    return DraftCheckpoint.build(fields, source.tensors, target)


def write(checkpoint: DraftCheckpoint, folder: Path) -> None:
    # The weights are assigned, not copied, into a storage-less model, whose save_pretrained writes them as they are.
    model = meta_model(checkpoint.config).to(checkpoint.dtype)
    model.load_state_dict(checkpoint.tensors, strict=False, assign=True)
    model.save_pretrained(folder, served_layout=False)


FORMAT = CheckpointFormat(
    name="hub",
    description="hf-eagle3's own layout (Eagle3DraftModel.save_pretrained(..., served_layout=False))",
    detect=detect,
    read=read,
    write=write,
)
