"""The target's parts (embedding, final norm, LM head) read from its safetensors, its decoder layers never loaded."""

import json

import pytest
import torch
from helpers import _TINY
from transformers import LlamaConfig, LlamaForCausalLM

from hf_eagle3.resources.loading import load_target_model
from hf_eagle3.resources.target_parts import is_whole, load_target_parts
from hf_eagle3.utils.fingerprint import model_fingerprint, weights_fingerprint


def saved_target(directory, tied: bool, shard_size: str | None = None):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**_TINY, tie_word_embeddings=tied)).save_pretrained(
        directory, **({"max_shard_size": shard_size} if shard_size else {}))
    return str(directory)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("shard_size", [None, "20KB"], ids=["single-file", "sharded"])
def test_parts_equal_the_whole_target_s_tensors_and_fingerprints(tmp_path, tied, shard_size, dtype):
    path = saved_target(tmp_path / "target", tied, shard_size)
    whole, parts = load_target_model(path, dtype), load_target_parts(path, dtype)
    loaded = {name: tensor for name, tensor in parts.state_dict().items() if not tensor.is_meta}
    assert sorted(loaded) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    assert all(torch.equal(tensor, whole.state_dict()[name]) and tensor.dtype == dtype
               for name, tensor in loaded.items())
    assert (parts.lm_head.weight is parts.model.embed_tokens.weight) is tied
    assert all(parameter.is_meta for parameter in parts.model.layers.parameters())
    assert is_whole(whole) and not is_whole(parts)
    # what names a run's precomputed features and what a draft records of its target
    assert model_fingerprint(parts) == model_fingerprint(whole)
    assert weights_fingerprint(parts) == weights_fingerprint(whole)


def test_parts_of_a_sharded_target_are_read_from_the_shards_that_hold_them_alone(tmp_path):
    path = saved_target(tmp_path / "target", tied=False, shard_size="20KB")
    whole = load_target_model(path)
    index = json.loads((tmp_path / "target" / "model.safetensors.index.json").read_text())["weight_map"]
    parts_shards = {index[name] for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")}
    for shard in set(index.values()) - parts_shards:  # a layer's shard that is read fails
        (tmp_path / "target" / shard).write_bytes(b"not a safetensors file")
    parts = load_target_parts(path)
    assert torch.equal(parts.lm_head.weight, whole.lm_head.weight)
    assert torch.equal(parts.model.embed_tokens.weight, whole.model.embed_tokens.weight)


def test_a_target_without_safetensors_is_refused_naming_the_whole_target_option(tmp_path):
    path = saved_target(tmp_path / "target", tied=False)
    state = load_target_model(path).state_dict()
    (tmp_path / "target" / "model.safetensors").unlink()  # the weights as a pickled state dict, an older format
    torch.save(state, tmp_path / "target" / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"holds no safetensors weights.*--target-weights whole"):
        load_target_parts(path)


@pytest.mark.slow
def test_the_embedded_smollm2_s_parts_equal_its_whole_model_s(own_cache):
    whole, parts = load_target_model("smollm2"), load_target_parts("smollm2")
    assert torch.equal(parts.model.embed_tokens.weight, whole.model.embed_tokens.weight)
    assert torch.equal(parts.model.norm.weight, whole.model.norm.weight)
    assert torch.equal(parts.lm_head.weight, whole.lm_head.weight)
    assert model_fingerprint(parts) == model_fingerprint(whole)
