"""Fingerprints of what produced a cached result (a calibration, prepared data, precomputed features), so that a
cache is reused only for exactly what made it, and refused or rebuilt for anything else."""

import hashlib
import json
from pathlib import Path

import torch


def digest(value) -> str:
    """A short stable hash of a JSON-serialisable value."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:24]


def tensor_digest(tensor: torch.Tensor, elements: int = 65536) -> str:
    """A hash of a tensor's first `elements` values (enough to tell two trained weight matrices apart)."""
    sample = tensor.detach().flatten()[:elements].float().cpu().contiguous()
    return hashlib.sha256(sample.numpy().tobytes()).hexdigest()[:16]


def file_digest(path: str | Path) -> str:
    """A hash of a file's contents."""
    hasher = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            hasher.update(block)
    return hasher.hexdigest()[:24]


def model_fingerprint(model) -> dict:
    """What identifies a transformers model's function: its name, its text config, and a sample of its weights
    (the input embedding and the first and last parameters)."""
    parameters = [parameter for _, parameter in model.named_parameters()]
    return {
        "name_or_path": str(model.config.name_or_path),
        "config": digest(model.config.get_text_config().to_dict()),
        "weights": [tensor_digest(model.get_input_embeddings().weight), tensor_digest(parameters[0]),
                    tensor_digest(parameters[-1])],
    }


def tokenizer_fingerprint(tokenizer) -> dict:
    """What identifies a tokenizer's output: its vocabulary, special tokens and chat template."""
    return {
        "name_or_path": str(tokenizer.name_or_path),
        "vocab": digest(sorted(tokenizer.get_vocab().items())),
        "special_tokens": digest(tokenizer.special_tokens_map),
        "chat_template": digest(tokenizer.chat_template),
    }
