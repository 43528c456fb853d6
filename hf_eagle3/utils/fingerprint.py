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


def weights_fingerprint(model) -> str:
    """What identifies a model whatever dtype and path it was loaded from: its architecture and a hash of its input and
    output embeddings in bfloat16 (float32, bfloat16 and float16 copies of one checkpoint agree), so that a local
    copy of a model matches its Hub original and two models of one shape do not."""
    config = model.config.get_text_config()
    architecture = {name: getattr(config, name, None) for name in (
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads")}
    embeddings = [module.weight for module in (model.get_input_embeddings(), model.get_output_embeddings())
                  if module is not None]
    return digest([architecture, [tensor_digest(weight.detach().flatten()[:65536].to(torch.bfloat16))
                                  for weight in embeddings]])


# What a draft computes: the config fields of its shape (not its tree defaults, acceptance profile, name or versions)
DRAFT_ARCHITECTURE = (
    "vocab_size", "draft_vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "target_hidden_size", "target_layer_ids", "rms_norm_eps", "hidden_act",
    "rope_parameters", "fc_norm", "norm_before_fc", "norm_before_residual", "norm_output", "qk_norm",
    "share_target_embedding", "share_target_lm_head", "layer_types", "sliding_window")
# Weights every draft stores, whatever its variant
DRAFT_IDENTITY_WEIGHTS = ("fc.weight", "midlayer.mlp.down_proj.weight")


def draft_identity(config, tensors: dict) -> dict:
    """What identifies an EAGLE-3 draft whatever its layout, dtype and folder: a digest of its config's architecture
    fields (`config`) and a fingerprint of its stored weights in bfloat16 (`tensors`: a state dict or a checkpoint's
    tensors), so that results measured with one draft are never shown for another."""
    return {
        "fingerprint": digest([tensor_digest(tensors[name].detach().to(torch.bfloat16))
                               for name in DRAFT_IDENTITY_WEIGHTS]),
        "config_digest": digest({name: getattr(config, name, None) for name in DRAFT_ARCHITECTURE}),
    }
