"""SpecForge / SGLang checkpoints."""

import json

import pytest
import torch
from conversion_fixtures import (
    HIDDEN,
    TARGET_LAYERS,
    VOCAB,
    _rewrite,
    angelslim_vl_fixture,
    modelopt_target_head_fixture,
    sglang_fixture,
)
from helpers import tiny_draft
from hf_eagle3.conversion import ConversionError, TargetInfo, convert
from safetensors.torch import load_file

from hf_eagle3 import Eagle3DraftModel
from hf_eagle3.resources.loading import load_draft


def test_readings_where_engines_differ_are_recorded(tmp_path):
    angelslim_vl_fixture(tmp_path)
    checkpoint, _ = convert(tmp_path, tmp_path / "hub", target=TargetInfo(num_hidden_layers=TARGET_LAYERS))
    record = json.loads((tmp_path / "hub" / "config.json").read_text())["converted_from"]
    assert record["format"] == "sglang" and checkpoint.config.converted_from == record
    assert any("mrope" in note for note in record["notes"])
    assert any("tie_word_embeddings=true ignored" in note for note in record["notes"])


def test_top_level_layer_ids_are_read_as_vllm_reads_them(tmp_path):
    sglang_fixture(tmp_path)
    _rewrite(tmp_path, lambda c: (c.pop("eagle_config"), c.update(eagle_aux_hidden_state_layer_ids=[9, 2, 6])))
    checkpoint, _ = convert(tmp_path, tmp_path / "hub")
    assert checkpoint.config.target_layer_ids == [2, 6, 9]  # hidden_states indices, unlike eagle_config's


def test_layer_ids_that_disagree_between_engines_are_refused(tmp_path):
    sglang_fixture(tmp_path)  # eagle_config ids [1, 5, 8] = hidden_states [2, 6, 9]
    _rewrite(tmp_path, lambda config: config.update(eagle_aux_hidden_state_layer_ids=[1, 5, 8]))
    with pytest.raises(ConversionError, match="keys that disagree.*Keep the key that holds the layers"):
        convert(tmp_path, tmp_path / "hub")
    _rewrite(tmp_path, lambda config: config.update(eagle_aux_hidden_state_layer_ids=[2, 6, 9]))
    assert convert(tmp_path, tmp_path / "hub")[0].config.target_layer_ids == [2, 6, 9]


def test_specforge_norm_output_false_is_plain_eagle3(tmp_path):
    """SpecForge's `norm_output: false` (the default) feeds back the pre-norm state, as Eagle3DraftModel does: the
    same draft as the checkpoint that leaves both fields out."""
    plain, stated = tmp_path / "plain", tmp_path / "stated"
    for folder in (plain, stated):
        folder.mkdir()
        fixture = sglang_fixture(folder)
    _rewrite(stated, lambda config: config.update(norm_output=False, fc_norm=False))
    checkpoints = [convert(folder, tmp_path / "hub" / folder.name)[0] for folder in (plain, stated)]

    plain_config, stated_config = ({k: v for k, v in checkpoint.config.to_dict().items() if k != "converted_from"}
                                   for checkpoint in checkpoints)
    assert stated_config == plain_config and stated_config["norm_output"] is stated_config["fc_norm"] is False
    generator = torch.Generator().manual_seed(4)
    input_ids = torch.randint(VOCAB, (2, 7), generator=generator)
    features = torch.randn(2, 7, 3 * fixture.target_hidden, generator=generator)
    outputs = []
    for folder in (plain, stated):
        draft = Eagle3DraftModel.from_pretrained(tmp_path / "hub" / folder.name, dtype=torch.float32).eval()
        with torch.no_grad():
            outputs.append(draft(input_ids, features, use_cache=False))
    assert torch.equal(outputs[1].logits, outputs[0].logits)
    assert torch.equal(outputs[1].hidden_states, outputs[0].hidden_states)  # the state fed back


@pytest.mark.parametrize("variant, setting", [
    ({"norm_before_residual": True}, "norm_before_residual=True"),
    ({"norm_before_fc": True}, "norm_before_fc=True"),
    ({"qk_norm": True}, "qk_norm=True"),
    ({"num_hidden_layers": 2}, "num_hidden_layers=2"),
    ({"layer_types": ["sliding_attention"], "sliding_window": 64}, "layer_types="),
])
def test_sglang_export_refuses_what_sglang_does_not_compute(tmp_path, variant, setting):
    tiny_draft(**variant).save_pretrained(tmp_path / "hub")
    with pytest.raises(ConversionError, match=f"{setting}.*Export to speculators"):
        convert(tmp_path / "hub", tmp_path / "out", to_format="sglang")
    assert not (tmp_path / "out").exists()


def test_sglang_export_refuses_an_embedding_sglang_would_replace(tmp_path):
    source = tmp_path / "specforge"
    source.mkdir()
    sglang_fixture(source, target_hidden=HIDDEN)
    with pytest.raises(ConversionError, match="--share-target-embedding"):
        convert(source, tmp_path / "out", to_format="sglang")
    assert not (tmp_path / "out").exists()

    convert(source, tmp_path / "out", to_format="sglang", share_target_embedding=True)
    assert "embed_tokens.weight" not in load_file(tmp_path / "out" / "model.safetensors")


def test_a_draft_using_the_targets_head_round_trips_through_sglang_and_not_speculators(tmp_path):
    (tmp_path / "src").mkdir()
    modelopt_target_head_fixture(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "hub")
    convert(tmp_path / "hub", tmp_path / "sglang", to_format="sglang")
    assert json.loads((tmp_path / "sglang" / "config.json").read_text())["draft_vocab_size"] is None
    convert(tmp_path / "sglang", tmp_path / "back")
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (
        tmp_path / "hub" / "model.safetensors"
    ).read_bytes()
    with pytest.raises(ConversionError, match="share_target_lm_head=True.*Export to sglang"):
        convert(tmp_path / "hub", tmp_path / "speculators", to_format="speculators")


def test_sglang_export_of_plain_eagle3_omits_norm_output_which_specforge_versions_read_differently(tmp_path):
    """SpecForge 0.2.0 reads a missing norm_output as "final norm before lm_head", later SpecForge as "pre-norm state
    fed back": both plain EAGLE-3, which no written value says to both."""
    tiny_draft(fc_norm=True).save_pretrained(tmp_path / "hub")
    convert(tmp_path / "hub", tmp_path / "sglang", to_format="sglang")
    config = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert "norm_output" not in config and config["fc_norm"] is True


def test_sglang_export_of_normed_feedback_is_refused_naming_specforge_0_2_0(tmp_path):
    tiny_draft(norm_output=True).save_pretrained(tmp_path / "hub")
    with pytest.raises(ConversionError, match="norm_output=True.*SpecForge 0.2.0 reads.*Export to speculators"):
        convert(tmp_path / "hub", tmp_path / "sglang", to_format="sglang")


@pytest.mark.parametrize("norm_output", [False, True])
def test_a_written_norm_output_is_read_in_specforges_later_meaning_and_the_other_reading_stated(tmp_path, norm_output):
    sglang_fixture(tmp_path)
    _rewrite(tmp_path, lambda config: config.update(norm_output=norm_output))
    checkpoint, _ = convert(tmp_path, tmp_path / "hub")
    assert checkpoint.config.norm_output is norm_output
    assert any(f"norm_output={str(norm_output).lower()} read as later SpecForge" in note and "SpecForge 0.2.0" in note
               for note in checkpoint.config.converted_from["notes"])


def test_the_commands_take_a_draft_in_sglang_format(tmp_path):
    """`hf-eagle3 bench --draft` and `tune-tree --draft` load drafts through `load_draft`."""
    draft = tiny_draft()
    draft.save_pretrained(tmp_path / "hub")
    convert(tmp_path / "hub", tmp_path / "sglang", to_format="sglang")
    loaded = load_draft(str(tmp_path / "sglang"))
    assert _draft_fields(loaded.config) == _draft_fields(draft.config)
    assert all(torch.equal(tensor, draft.state_dict()[name]) for name, tensor in loaded.state_dict().items()
               if name != "embed_tokens.weight")


def _draft_fields(config) -> dict:
    return {key: value for key, value in config.to_diff_dict().items() if key not in ("architectures", "auto_map")}
