"""vLLM / speculators checkpoints."""

from conftest import tiny_draft
from conversion_fixtures import speculators_fixture
from hf_eagle3.conversion import convert
from safetensors.torch import load_file


def test_speculators_records_target_and_speculative_tokens(tmp_path):
    speculators_fixture(tmp_path)
    checkpoint, _ = convert(tmp_path, tmp_path / "hub")
    assert checkpoint.config.target_name_or_path == "org/target-llama"
    assert checkpoint.config.tree_depth == 3
    assert checkpoint.config.rms_norm_eps == 1e-6  # LlamaConfig's default, as speculators reads it


def test_draft_with_its_own_embedding_round_trips_through_speculators(tmp_path):
    tiny_draft(draft_vocab_size=40, share_target_embedding=False).save_pretrained(tmp_path / "hub")
    convert(tmp_path / "hub", tmp_path / "speculators", to_format="speculators")
    assert "embed_tokens.weight" in load_file(tmp_path / "speculators" / "model.safetensors")
    convert(tmp_path / "speculators", tmp_path / "back")
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (
        tmp_path / "hub" / "model.safetensors"
    ).read_bytes()
