"""vLLM / speculators checkpoints."""

import json

import pytest
import torch
from conversion_fixtures import saved_target, speculators_fixture
from helpers import tiny_draft
from hf_eagle3.conversion import ConversionError, convert
from safetensors.torch import load_file
from transformers import LlamaForCausalLM, Qwen3Config


def test_speculators_records_target_and_speculative_tokens(tmp_path):
    speculators_fixture(tmp_path)
    checkpoint, _ = convert(tmp_path, tmp_path / "hub")
    assert checkpoint.config.target_name_or_path == "org/target-llama"
    assert checkpoint.config.tree_depth == 3
    assert checkpoint.config.rms_norm_eps == 1e-6  # LlamaConfig's default, as speculators reads it


def test_draft_with_its_own_embedding_round_trips_through_speculators(tmp_path):
    tiny_draft(draft_vocab_size=40, share_target_embedding=False, target_name_or_path="org/target").save_pretrained(
        tmp_path / "hub")
    convert(tmp_path / "hub", tmp_path / "speculators", to_format="speculators")
    assert "embed_tokens.weight" in load_file(tmp_path / "speculators" / "model.safetensors")
    convert(tmp_path / "speculators", tmp_path / "back")
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (
        tmp_path / "hub" / "model.safetensors"
    ).read_bytes()


def _exported(tmp_path, target_embedding=True, **variant) -> dict:
    """The config.json of a tiny draft exported to speculators."""
    draft = tiny_draft(target_name_or_path="org/target", **variant)
    draft.save_pretrained(tmp_path / "hub")
    saved_target(tmp_path / "target", draft.config.vocab_size, draft.config.hidden_size)
    convert(tmp_path / "hub", tmp_path / "speculators", to_format="speculators",
            target_embedding=tmp_path / "target" if target_embedding else None)
    return json.loads((tmp_path / "speculators" / "config.json").read_text())


def test_qwen3_sliding_window_layers_keep_their_window_in_speculators_exports(tmp_path):
    config = _exported(tmp_path, qk_norm=True, num_hidden_layers=2, sliding_window=16,
                       layer_types=["sliding_attention", "full_attention"])
    layer_config = config["transformer_layer_config"]
    assert layer_config["model_type"] == "qwen3" and layer_config["use_sliding_window"] is True
    assert Qwen3Config(**layer_config).sliding_window == 16  # Qwen3Config drops it without use_sliding_window


def test_speculators_export_stores_the_target_embedding_its_loader_needs(tmp_path):
    _exported(tmp_path)
    target = LlamaForCausalLM.from_pretrained(tmp_path / "target")
    weights = load_file(tmp_path / "speculators" / "model.safetensors")
    assert torch.equal(weights["embed_tokens.weight"], target.get_input_embeddings().weight)
    convert(tmp_path / "speculators", tmp_path / "back")  # read back sharing the target's embedding, as saved
    back, saved = tmp_path / "back" / "model.safetensors", tmp_path / "hub" / "model.safetensors"
    assert back.read_bytes() == saved.read_bytes()


def test_speculators_export_of_a_shared_embedding_without_the_target_is_refused(tmp_path):
    refusal = r"speculators \(0.9.0\) fills a missing embed_tokens.*--target-embedding"
    with pytest.raises(ConversionError, match=refusal):
        _exported(tmp_path, target_embedding=False)
    assert not (tmp_path / "speculators").exists()


def test_speculators_layer_config_always_names_its_model_type(tmp_path):
    assert _exported(tmp_path)["transformer_layer_config"]["model_type"] == "llama"


def test_a_layer_config_without_model_type_is_read_as_speculators_reads_it(tmp_path):
    _exported(tmp_path / "qwen3", qk_norm=True)
    _exported(tmp_path / "llama")
    for name in ("qwen3", "llama"):
        path = tmp_path / name / "speculators" / "config.json"
        config = json.loads(path.read_text())
        del config["transformer_layer_config"]["model_type"]
        path.write_text(json.dumps(config))
    checkpoint, _ = convert(tmp_path / "qwen3" / "speculators", tmp_path / "qwen3" / "back")
    assert checkpoint.config.qk_norm  # speculators' default layer config is Qwen3's
    with pytest.raises(ConversionError, match="no model_type: speculators reads it as a Qwen3 layer.*no q_norm"):
        convert(tmp_path / "llama" / "speculators", tmp_path / "llama" / "back")


def test_speculators_export_of_a_draft_narrower_than_its_target_is_refused(tmp_path):
    tiny_draft(target_hidden_size=48, share_target_embedding=False, target_name_or_path="org/target").save_pretrained(
        tmp_path / "hub")
    with pytest.raises(ConversionError, match=r"builds fc with 3 x hidden_size = 96 inputs.*\(fc reads 144\)"):
        convert(tmp_path / "hub", tmp_path / "out", to_format="speculators")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("export_format", ["sglang", "speculators"])
def test_exports_write_the_special_token_ids_and_rope_parameters(tmp_path, export_format):
    rope = {"rope_type": "default", "rope_theta": 500000.0}
    draft = tiny_draft(bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0, rope_parameters=rope,
                       target_name_or_path="org/target")
    draft.save_pretrained(tmp_path / "hub")
    saved_target(tmp_path / "target", draft.config.vocab_size, draft.config.hidden_size)
    convert(tmp_path / "hub", tmp_path / "out", to_format=export_format, target_embedding=tmp_path / "target")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    layer_config = config.get("transformer_layer_config", config)
    assert (layer_config["bos_token_id"], layer_config["eos_token_id"], layer_config["pad_token_id"]) == (1, [2, 3], 0)
    assert layer_config["rope_parameters"] == rope and layer_config["rope_theta"] == 500000.0
    checkpoint, _ = convert(tmp_path / "out", tmp_path / "back")
    assert (checkpoint.config.bos_token_id, checkpoint.config.eos_token_id) == (1, [2, 3])


def test_speculators_export_of_a_draft_that_names_no_target_is_refused(tmp_path):
    """speculators 0.9.0's loader reads the verifier's config; a draft without one cannot load there."""
    tiny_draft().save_pretrained(tmp_path / "hub")
    with pytest.raises(ConversionError, match=r"verifier's config.*--target-name-or-path"):
        convert(tmp_path / "hub", tmp_path / "out", to_format="speculators")
