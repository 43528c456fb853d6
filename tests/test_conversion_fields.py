"""Config readings shared by the foreign formats: layer taps, RoPE, embedding and head, refusals."""

import math

import pytest
import torch
from conversion_fixtures import (
    HIDDEN,
    LLAMA3_SCALING,
    TARGET_LAYERS,
    VOCAB,
    _rewrite,
    modelopt_fixture,
    official_fixture,
    sglang_fixture,
    speculators_fixture,
)
from helpers import tiny_draft
from hf_eagle3.conversion import ConversionError, TargetInfo, convert
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from hf_eagle3 import Eagle3DraftModel, check_compatibility


def test_a_tap_on_the_targets_last_layer_is_never_fed_the_post_norm_state(tmp_path):
    """SGLang / vLLM capture the last layer's output before the final norm; hidden_states[N] is after it."""
    sglang_fixture(tmp_path)
    _rewrite(tmp_path, lambda config: config["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 5, 11]))
    with pytest.raises(ConversionError, match="output of the target's last layer.*final norm"):
        convert(tmp_path, tmp_path / "out", target=TargetInfo(num_hidden_layers=TARGET_LAYERS))
    assert not (tmp_path / "out").exists()

    # Converted without the target's layer count, the draft is refused when it meets a target whose last layer it taps.
    checkpoint, _ = convert(tmp_path, tmp_path / "out")
    target = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=12,
                                          num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="converted from sglang, reads the output of the target's last layer"):
        check_compatibility(checkpoint.config, target)


@pytest.mark.parametrize("reading, attention_factor", [
    ("transformers", (0.1 * 1.0 * math.log(4.0) + 1) / (0.1 * 0.5 * math.log(4.0) + 1)),
    ("serving", 0.1 * math.log(4.0) + 1),
])
def test_yarn_mscale_reading_is_chosen_and_stated(tmp_path, reading, attention_factor):
    sglang_fixture(tmp_path)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "mscale": 1.0,
            "mscale_all_dim": 0.5}
    _rewrite(tmp_path, lambda config: config.update(rope_scaling=yarn))
    checkpoint, _ = convert(tmp_path, tmp_path / "hub", yarn_mscale=reading)
    assert any(f"yarn_mscale='{reading}'" in note for note in checkpoint.config.converted_from["notes"])
    assert ("mscale" in checkpoint.config.rope_parameters) == (reading == "transformers")
    draft = Eagle3DraftModel.from_pretrained(tmp_path / "hub")
    assert draft.rotary_emb.attention_scaling == pytest.approx(attention_factor)


def test_a_draft_that_cannot_share_the_narrower_target_embedding_is_refused(tmp_path):
    fixture = official_fixture(tmp_path)
    torch.save({**fixture.tensors, "fc.weight": torch.zeros(HIDDEN, 3 * 48).half()}, tmp_path / "pytorch_model.bin")
    _rewrite(tmp_path, lambda config: config.update(target_hidden_size=48))
    with pytest.raises(ConversionError, match="target_hidden_size=48 wide and the draft's hidden_size is 32"):
        convert(tmp_path, tmp_path / "out", target=fixture.target)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("write_fixture", [official_fixture, sglang_fixture, modelopt_fixture, speculators_fixture])
def test_tie_word_embeddings_is_read_the_same_way_by_every_reader(tmp_path, write_fixture):
    write_fixture(tmp_path)
    if write_fixture is speculators_fixture:
        _rewrite(tmp_path, lambda config: config["transformer_layer_config"].update(tie_word_embeddings=True))
    else:
        _rewrite(tmp_path, lambda config: config.update(tie_word_embeddings=True))
    checkpoint, _ = convert(tmp_path, tmp_path / "hub", target=TargetInfo(num_hidden_layers=TARGET_LAYERS))
    assert any("tie_word_embeddings=true ignored" in note for note in checkpoint.config.converted_from["notes"])

    weights = tmp_path / ("pytorch_model.bin" if write_fixture is official_fixture else "model.safetensors")
    tensors = torch.load(weights) if weights.suffix == ".bin" else load_file(weights)
    tensors.pop("lm_head.weight")
    torch.save(tensors, weights) if weights.suffix == ".bin" else save_file(tensors, weights)
    with pytest.raises(ConversionError, match="tie_word_embeddings=true and the checkpoint has no lm_head.weight"):
        convert(tmp_path, tmp_path / "out", target=TargetInfo(num_hidden_layers=TARGET_LAYERS))


def test_exports_refuse_a_tap_on_the_targets_last_layer(tmp_path):
    tiny_draft(target_layer_ids=[2, 4, 8]).save_pretrained(tmp_path / "hub")  # an 8-layer target's hidden_states[8]
    for export_format in ("sglang", "speculators"):
        with pytest.raises(ConversionError, match="last layer.*before the target's final norm"):
            convert(tmp_path / "hub", tmp_path / export_format, to_format=export_format)


UNFAITHFUL = {
    "norm_before_residual unstated": (
        speculators_fixture, lambda c: c.pop("norm_before_residual"), None, "vLLM as true"
    ),
    "unknown layer type": (
        speculators_fixture, lambda c: c["transformer_layer_config"].update(model_type="gemma3"), None, "'gemma3' layer"
    ),
    "sliding window without its size": (
        speculators_fixture, lambda c: c["transformer_layer_config"].update(layer_types=["sliding_attention"]), None,
        "sliding_window >= 1",
    ),
    "SGLang's extra layers": (sglang_fixture, lambda c: c.update(num_hidden_layers=2), None, "additional_layers"),
    "layer count disagrees with the weights": (
        speculators_fixture, lambda c: c["transformer_layer_config"].update(num_hidden_layers=2), None,
        "disagree about the draft's depth",
    ),
    "no final norm": (
        modelopt_fixture, lambda c: c["eagle_config"].update(use_last_layernorm=False), None, "use_last_layernorm"
    ),
    "official llama3 rope": (
        official_fixture, lambda c: c.update(rope_theta=5e5, rope_scaling=LLAMA3_SCALING), None, "'llama3'"
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    "write_fixture, mutate_config, extra_tensors, message", UNFAITHFUL.values(), ids=UNFAITHFUL.keys()
)
def test_unfaithful_conversion_is_refused(tmp_path, write_fixture, mutate_config, extra_tensors, message):
    source = tmp_path / "source"
    source.mkdir()
    write_fixture(source)
    _rewrite(source, mutate_config, extra_tensors)
    with pytest.raises(ConversionError, match=message):
        convert(source, tmp_path / "out", target=TargetInfo(num_hidden_layers=TARGET_LAYERS))
    assert not (tmp_path / "out").exists()


def test_a_draft_without_a_head_over_a_reduced_vocabulary_is_refused(tmp_path):
    """Without lm_head.weight only a whole-vocabulary draft can use the target's head."""
    fixture = modelopt_fixture(tmp_path)
    tensors = {name: t for name, t in fixture.tensors.items() if name != "lm_head.weight"}
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ConversionError, match="no lm_head.weight but a reduced draft vocabulary"):
        convert(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
