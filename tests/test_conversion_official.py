"""Official SafeAILab/EAGLE EAGLE-3 checkpoints."""

import pytest
import torch
from conversion_fixtures import DEFAULT_TAPS, DRAFT_VOCAB, HIDDEN, TARGET_LAYERS, VOCAB, _rewrite, official_fixture
from hf_eagle3.conversion import ConversionError, TargetInfo, convert


def test_a_llama_draft_with_rope_the_official_code_lacks_reads_as_sglang_on_request(tmp_path):
    """nebius/EAGLE3-gpt-oss-20b as public loaders describe it: a `LlamaForCausalLM` config with `midlayer.*` weights,
    `truncated_vocab_size` beside `draft_vocab_size` and YaRN RoPE, which the official code lacks."""
    official_fixture(tmp_path)
    yarn = {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
            "rope_type": "yarn", "truncate": False}
    _rewrite(tmp_path, lambda config: config.update(rope_theta=150000, rope_scaling=yarn,
                                                    truncated_vocab_size=DRAFT_VOCAB, num_hidden_layers=1))
    with pytest.raises(ConversionError, match="'yarn'.*convert with --from sglang"):
        convert(tmp_path, tmp_path / "out", target=TargetInfo(num_hidden_layers=TARGET_LAYERS))
    checkpoint, detected = convert(
        tmp_path, tmp_path / "out", from_format="sglang", target=TargetInfo(num_hidden_layers=TARGET_LAYERS)
    )
    assert detected == "sglang" and checkpoint.config.target_layer_ids == DEFAULT_TAPS
    assert checkpoint.config.rope_parameters == {"rope_theta": 150000, **yarn}


def test_identity_vocabulary_with_an_all_zero_t2d_loads_as_the_official_code_does(tmp_path):
    """Vicuna-style official drafts predict the whole vocabulary and store d2t = 0 and an all-false t2d."""
    fixture = official_fixture(tmp_path)
    tensors = dict(fixture.tensors)
    tensors.update(
        {"lm_head.weight": torch.randn(VOCAB, HIDDEN).half(), "d2t": torch.zeros(VOCAB, dtype=torch.long),
         "t2d": torch.zeros(VOCAB, dtype=torch.bool)}
    )
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    _rewrite(tmp_path, lambda config: config.update(draft_vocab_size=VOCAB))
    checkpoint, _ = convert(tmp_path, tmp_path / "hub", target=fixture.target)
    assert torch.equal(checkpoint.tensors["d2t"], torch.zeros(VOCAB, dtype=torch.long))
    assert bool(checkpoint.tensors["t2d"].all())
    assert any("d2t / t2d dropped" in note for note in checkpoint.config.converted_from["notes"])


def test_official_checkpoint_needs_the_target_layer_count(tmp_path):
    source = tmp_path / "official"
    source.mkdir()
    official_fixture(source)
    with pytest.raises(ConversionError, match="--target-num-layers"):
        convert(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()
