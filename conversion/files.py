"""Checkpoint folders on disk: `config.json` plus safetensors or `.bin` weights, single-file or sharded."""

import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .checkpoint import ConversionError, SourceFiles

# Weight files in the order transformers prefers them; an index lists the shards of a sharded checkpoint.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def load_source(folder: Path) -> SourceFiles:
    """Read `folder`'s `config.json` and all its tensors (`.bin` files are loaded with `weights_only=True`)."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ConversionError(f"{folder} has no config.json; point at the folder of a saved draft checkpoint.")
    return SourceFiles(path=folder, config=read_json_object(config_file), tensors=_load_weights(folder))


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConversionError(f"Cannot read {path}: {error}") from error


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file that holds an object (a config, an index), refused naming the file when it holds anything else."""
    content = read_json(path)
    if not isinstance(content, dict):
        raise ConversionError(f"{path} holds a JSON {type(content).__name__}, not an object of named fields: it is "
                              "damaged, or not a checkpoint's file.")
    return content


def write_checkpoint_files(folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Write `config.json` and `model.safetensors` the way `save_pretrained` names them."""
    (folder / "config.json").write_text(config_text(config))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def replace_config(folder: Path, config: dict[str, Any]) -> None:
    """Replace `folder`'s `config.json` with `config` in one rename: a reader sees the old file or the new one."""
    staged = folder / f".config.json.{os.getpid()}.partial"
    staged.write_text(config_text(config))
    os.replace(staged, folder / "config.json")


def config_text(config: dict[str, Any]) -> str:
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def input_embedding(folder: Path, vocab_size: int, hidden_size: int) -> torch.Tensor:
    """The `[vocab_size, hidden_size]` input embedding (`*embed_tokens.weight`) of the model saved in `folder` (a
    target), read alone from its safetensors weights."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        located = [(folder / shard, name) for name, shard in read_json(index).get("weight_map", {}).items()]
    elif (folder / "model.safetensors").is_file():
        with safe_open(folder / "model.safetensors", "pt") as weights:
            located = [(folder / "model.safetensors", name) for name in weights.keys()]  # noqa: SIM118
    else:
        raise ConversionError(f"{folder} has no safetensors weights to read the target's input embedding from.")
    for path, name in located:
        if name.endswith("embed_tokens.weight"):
            with safe_open(path, "pt") as weights:
                if tuple(weights.get_slice(name).get_shape()) == (vocab_size, hidden_size):
                    return weights.get_tensor(name)
    raise ConversionError(
        f"{folder} holds no [{vocab_size}, {hidden_size}] embed_tokens.weight: it is not the draft's target."
    )


def _load_weights(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        path = folder / name
        if path.is_symlink() and not path.exists():
            raise ConversionError(f"{path} is a link to a missing file ({path.readlink()}): restore it.")
        if not path.is_file():
            continue
        if name.endswith(".index.json"):
            weight_map = read_json_object(path).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConversionError(f"{path} has no weight_map: it does not index any shard.")
            shards = sorted(set(weight_map.values()))
            allowed = _shard_folders(folder)
            for shard in shards:
                shard_path = (folder / shard).resolve()
                if not any(allowed_folder in shard_path.parents for allowed_folder in allowed):
                    raise ConversionError(f"{path} lists {shard!r}, which lies outside {folder}: refusing to read it.")
                if not shard_path.is_file():
                    raise ConversionError(f"{path} lists {shard!r}, which is missing from {folder}.")
            return {key: tensor for shard in shards for key, tensor in _load_weight_file(folder / shard).items()}
        return _load_weight_file(path)
    raise ConversionError(f"{folder} holds no weights: expected one of {', '.join(WEIGHT_FILES)}.")


def _shard_folders(folder: Path) -> list[Path]:
    """Where the shards of `folder` may lie once links are followed: in `folder`, and for a snapshot of the Hub cache
    (`models--ORG--NAME/snapshots/REVISION/`, whose files are links to `../../blobs/`) in its own repo's `blobs/`."""
    folder = folder.resolve()
    repo = folder.parent.parent
    if folder.parent.name == "snapshots" and repo.name.startswith("models--") and (repo / "blobs").is_dir():
        return [folder, repo / "blobs"]
    return [folder]


def _load_weight_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        try:
            return load_file(path)
        except (SafetensorError, OSError) as error:
            raise ConversionError(f"{path} is not a readable safetensors file (truncated or damaged?): {error}") \
                from error
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise ConversionError(
            f"{path} is damaged, or holds objects other than tensors, which loading with weights_only=True refuses "
            f"to unpickle: {str(error).splitlines()[0]}"
        ) from error
    except (RuntimeError, EOFError, OSError) as error:
        raise ConversionError(f"{path} is not a readable PyTorch weight file (truncated or damaged?): {error}") \
            from error
    if not isinstance(state, dict):
        raise ConversionError(f"{path} holds a {type(state).__name__}, not a state dict of named tensors.")
    not_tensors = sorted(key for key, value in state.items() if not isinstance(value, torch.Tensor))
    if not_tensors:
        raise ConversionError(f"{path} is not a plain state dict: {not_tensors} are not tensors.")
    return state
