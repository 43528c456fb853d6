"""What `save_pretrained` writes once hf_eagle3 is imported: the SpecForge / SGLang layout vLLM and SGLang load by
repository id, which `Eagle3DraftModel.from_pretrained` reads back as the same draft; and what happens to a draft that
layout cannot express."""

import json
import logging

import pytest
import torch
from conversion_fixtures import LLAMA3_SCALING
from helpers import HIDDEN, VOCAB, tiny_draft
from hf_eagle3.conversion import ConversionError, read_checkpoint
from safetensors.torch import load_file
from transformers import AutoConfig, GenerationConfig, LlamaConfig

from hf_eagle3 import Eagle3Config, Eagle3DraftModel
from hf_eagle3.publishing.hub import upload_operations

# What the files say about the layout, not about the draft.
LAYOUT_FIELDS = ("_name_or_path", "architectures", "auto_map", "dtype", "transformers_version")
SETTINGS = {  # everything hf-eagle3 records beside the weights, away from its defaults
    "draft_vocab_size": 40,
    "target_name_or_path": "org/target",
    "target_model_type": "llama",
    "target_fingerprint": "llama:0123abcd",
    "rope_parameters": {"rope_theta": 500000.0, **LLAMA3_SCALING, "original_max_position_embeddings": 256},
    "tree_depth": 3, "tree_top_k": 2, "tree_total_tokens": 7, "tree_shape": "auto",
    "acceptance_profile": [{"tree_depth": 3, "tree_top_k": 2, "tree_total_tokens": 7, "tau": 2.1},
                           {"tree_depth": 3, "tree_top_k": 2, "tree_total_tokens": 7, "tau": 2.4,
                            "ngram_candidates": True}],
    "ngram_candidates": False, "ngram_max_match": 4, "ngram_max_tokens": 6,
    "bos_token_id": 2, "eos_token_id": [1, 3], "pad_token_id": 0,
}


def _fields(config: Eagle3Config) -> dict:
    return {name: value for name, value in config.to_dict().items() if name not in LAYOUT_FIELDS}


def _outputs(draft: Eagle3DraftModel) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and fed-back state of a draft step and of the step after it."""
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(VOCAB, (2, 6), generator=generator)
    features = torch.randn(2, 6, 3 * draft.config.target_hidden_size, generator=generator)
    if draft.config.share_target_embedding:
        draft.attach_target_embedding(torch.nn.Embedding.from_pretrained(
            torch.randn(VOCAB, HIDDEN, generator=generator)))
    with torch.no_grad():
        first = draft(input_ids, features.to(draft.dtype))
        second = draft(input_ids[:, -1:], first.hidden_states[:, -1:], cache=first.cache)
    return torch.cat([first.logits[:, -1], second.logits[:, -1]]), second.hidden_states


def test_save_pretrained_writes_the_layout_vllm_and_sglang_load_by_id(tmp_path):
    draft = tiny_draft(**SETTINGS)
    draft.generation_config = GenerationConfig(tree_depth=2)
    draft.save_pretrained(tmp_path)

    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["draft_vocab_size"] == 40 and config["vocab_size"] == VOCAB and config["num_hidden_layers"] == 1
    # The target layers in both numberings the engines read: hidden_states indices at the top level (vLLM, llama.cpp),
    # output-of-layer numbers in eagle_config (SGLang): hidden_states [2, 4, 5] of the 8-layer target
    assert config["eagle_aux_hidden_state_layer_ids"] == draft.config.target_layer_ids == [2, 4, 5]
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    assert "norm_output" not in config and config["tie_word_embeddings"] is False
    assert config["hf_eagle3"]["acceptance_profile"] == SETTINGS["acceptance_profile"]
    assert config["hf_eagle3"]["target_name_or_path"] == "org/target" and config["hf_eagle3"]["tree_shape"] == "auto"
    assert config["auto_map"] == {"AutoModel": "modeling_eagle3.Eagle3DraftModel"}  # no AutoConfig: see test_hub
    weights = load_file(tmp_path / "model.safetensors")
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= set(weights)
    assert "embed_tokens.weight" not in weights and not any(name.startswith("layers.") for name in weights)
    assert {path.name for path in tmp_path.iterdir()} == {
        "config.json", "model.safetensors", "configuration_eagle3.py", "modeling_eagle3.py", "generation_config.json"}
    assert type(AutoConfig.from_pretrained(tmp_path, trust_remote_code=True)) is LlamaConfig  # as the engines read it


@pytest.mark.parametrize("variant, dtype", [
    ({}, torch.float32),
    ({}, torch.bfloat16),
    ({"fc_norm": True}, torch.float32),  # EAGLE 3.1's per-state norm, which SGLang serves
])
def test_from_pretrained_reads_back_the_same_draft(tmp_path, variant, dtype):
    draft = tiny_draft(**SETTINGS, **variant).to(dtype)
    draft.generation_config = GenerationConfig(tree_depth=2, tree_top_k=1)
    draft.save_pretrained(tmp_path)

    loaded = Eagle3DraftModel.from_pretrained(tmp_path)
    assert loaded.dtype == dtype
    assert _fields(loaded.config) == _fields(draft.config)
    assert _fields(Eagle3Config.from_pretrained(tmp_path)) == _fields(draft.config)
    assert _fields(read_checkpoint(tmp_path)[0].config) == _fields(draft.config)  # as `convert` reads it
    assert loaded.generation_config.to_diff_dict() == draft.generation_config.to_diff_dict()
    original = {name: tensor for name, tensor in draft.state_dict().items() if name != "embed_tokens.weight"}
    assert all(torch.equal(loaded.state_dict()[name], tensor) for name, tensor in original.items())
    for expected, got in zip(_outputs(draft), _outputs(loaded), strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("variant, reason", [
    ({"norm_before_residual": True}, "norm_before_residual=True, which SGLang does not implement"),
    ({"norm_output": True}, "norm_output=True, EAGLE 3.1"),
    ({"fc_norm": True, "norm_before_residual": True, "norm_output": True}, "norm_before_residual=True"),
    ({"qk_norm": True}, "qk_norm=True"),
    ({"target_layer_ids": [2, 4, 8]}, "output of the target's last layer"),
    ({"target_hidden_size": 48, "share_target_embedding": False}, "SGLang always replaces a draft's token embedding"),
])
def test_a_draft_the_served_layout_cannot_express_is_saved_in_hf_eagle3s_layout_with_a_warning(
    tmp_path, caplog, variant, reason
):
    draft = tiny_draft(**SETTINGS, **variant)
    with caplog.at_level(logging.WARNING):
        draft.save_pretrained(tmp_path)
    assert any("saved in hf-eagle3's own layout (model_type eagle3), which vLLM and SGLang cannot load by id" in
               record.getMessage() and reason in record.getMessage() for record in caplog.records)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "eagle3"
    loaded = Eagle3DraftModel.from_pretrained(tmp_path)
    assert _fields(loaded.config) == _fields(draft.config)
    for expected, got in zip(_outputs(draft), _outputs(loaded), strict=True):
        assert torch.equal(got, expected)


def test_a_draft_saved_over_an_earlier_one_is_in_the_served_layout_and_loads_as_the_new_draft(tmp_path):
    tiny_draft(seed=1).save_pretrained(tmp_path, served_layout=False)
    draft = tiny_draft(seed=2, **SETTINGS)
    draft.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"
    assert not list(tmp_path.glob(".config.json.*"))  # the config was replaced in one rename
    loaded = Eagle3DraftModel.from_pretrained(tmp_path)
    assert _fields(loaded.config) == _fields(draft.config)
    assert torch.equal(loaded.fc.weight, draft.fc.weight)


def test_save_pretrained_with_push_to_hub_points_to_push_to_hub(tmp_path):
    with pytest.raises(ValueError, match=r"call draft.push_to_hub\(repo_id\) instead"):
        tiny_draft().save_pretrained(tmp_path, push_to_hub=True)


def test_a_draft_that_records_no_target_layers_is_saved_in_hf_eagle3s_layout_naming_the_fix(tmp_path, caplog):
    draft = tiny_draft()  # as loaded from an official checkpoint without the target's layer count: the layers are
    draft.config.target_layer_ids = draft.config.target_num_hidden_layers = None  # taken from the target at generate
    with caplog.at_level(logging.WARNING):
        draft.save_pretrained(tmp_path)
    assert any("records no target layers" in record.getMessage() and "target_num_hidden_layers" in
               record.getMessage() for record in caplog.records)
    assert Eagle3DraftModel.from_pretrained(tmp_path).config.target_layer_ids is None
    draft.config.target_num_hidden_layers, draft.config.target_layer_ids = 8, [2, 4, 5]
    draft.save_pretrained(tmp_path)
    assert Eagle3DraftModel.from_pretrained(tmp_path).config.target_layer_ids == [2, 4, 5]


def _edited_config(folder, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


def test_a_draft_saved_before_the_top_level_key_loads_with_eagle_configs_layers(tmp_path):
    tiny_draft(**SETTINGS).save_pretrained(tmp_path)
    _edited_config(tmp_path, lambda config: config.pop("eagle_aux_hidden_state_layer_ids"))
    assert Eagle3DraftModel.from_pretrained(tmp_path).config.target_layer_ids == [2, 4, 5]
    assert read_checkpoint(tmp_path)[0].config.target_layer_ids == [2, 4, 5]
    upload = {op.path_in_repo: op.path_or_fileobj for op in upload_operations(tmp_path, "org/draft")}
    assert json.loads(upload["config.json"])["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # pushed with the key


def _set(key: str, value):
    def edit(config):
        if key.startswith("hf_eagle3."):
            config["hf_eagle3"][key.removeprefix("hf_eagle3.")] = value
        elif key.startswith("eagle_config."):
            config["eagle_config"][key.removeprefix("eagle_config.")] = value
        elif value is None:
            config.pop(key)
        else:
            config[key] = value
    return edit


@pytest.mark.parametrize("edits, message", [
    # hf-eagle3's own key, which from_pretrained read and convert ignored
    ([_set("hf_eagle3.target_layer_ids", [0, 2, 3])],
     r"keys that disagree: eagle_aux_hidden_state_layer_ids = \[2, 4, 5\] \(hidden_states \[2, 4, 5\]\); "
     r"eagle_config.eagle_aux_hidden_state_layer_ids = \[1, 3, 4\] \(hidden_states \[2, 4, 5\]\); "
     r"hf_eagle3.target_layer_ids = \[0, 2, 3\] \(hidden_states \[0, 2, 3\]\)"),
    # the top-level key vLLM and llama.cpp read, disagreeing with SGLang's
    ([_set("eagle_aux_hidden_state_layer_ids", [1, 3, 4])],
     r"keys that disagree: .*Keep the key that holds the layers"),
    # the same layers in both keys, tapping the last layer's output, which SGLang and vLLM take before the final norm
    ([_set("eagle_aux_hidden_state_layer_ids", [2, 4, 8]), _set("eagle_config.eagle_aux_hidden_state_layer_ids",
                                                                  [1, 3, 7])], "output of the target's last layer"),
    ([_set("eagle_aux_hidden_state_layer_ids", None), _set("eagle_config.eagle_aux_hidden_state_layer_ids",
                                                             [1, 3, 7])], "output of the target's last layer"),
    ([_set("eagle_aux_hidden_state_layer_ids", "2,4,5")], "must be a list of integer layer ids, got '2,4,5'"),
])
def test_every_path_refuses_a_folder_whose_target_layers_are_wrong_or_in_disagreeing_keys(tmp_path, edits, message):
    tiny_draft(**SETTINGS).save_pretrained(tmp_path)
    for edit in edits:
        _edited_config(tmp_path, edit)
    for read in (Eagle3DraftModel.from_pretrained, Eagle3Config.from_pretrained):
        with pytest.raises(ValueError, match=message):
            read(tmp_path)
    for read in (read_checkpoint, lambda folder: upload_operations(folder, "org/draft")):  # convert, push
        with pytest.raises(ConversionError, match=message):
            read(tmp_path)
