"""`hf_eagle3.optimize(model)`: linear weights column-major on CPU, explicitly. Same values, so the same greedy
float32 tokens, with EAGLE-3 and without; the same `save_pretrained` bytes; tied weights left tied and as they are."""

import copy
import hashlib

import pytest
import torch
from helpers import _TINY, tiny_draft
from transformers import LlamaConfig, LlamaForCausalLM

from hf_eagle3 import optimize, standard_layout
from hf_eagle3.decoding.cpu_layout import weight_layout

PROMPTS = [torch.randint(1, 90, (1, 9), generator=torch.Generator().manual_seed(seed)) for seed in range(3)]


def _files(directory) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def tied_target():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**_TINY, tie_word_embeddings=True)).eval()


@pytest.mark.parametrize("with_eagle3", [False, True])
def test_greedy_float32_outputs_are_those_of_the_model_as_loaded(llama_target, fitted_draft, with_eagle3):
    target, draft = optimize(copy.deepcopy(llama_target)), optimize(copy.deepcopy(fitted_draft))
    assert weight_layout(target) == "column-major" and weight_layout(llama_target) == "standard"
    eagle3 = {"assistant_model": draft, "tree_depth": 3, "tree_top_k": 3, "tree_total_tokens": 8} if with_eagle3 else {}
    for prompt in PROMPTS:
        expected = llama_target.generate(prompt, max_new_tokens=24, do_sample=False)
        assert torch.equal(target.generate(prompt, max_new_tokens=24, do_sample=False, **eagle3), expected)


def test_save_pretrained_writes_the_same_bytes(llama_target, tied_target, fitted_draft, tmp_path):
    for name, model in (("untied", llama_target), ("tied", tied_target), ("draft", fitted_draft)):
        model.save_pretrained(tmp_path / name / "as-loaded")
        optimized = optimize(copy.deepcopy(model))
        optimized.save_pretrained(tmp_path / name / "optimized")
        assert _files(tmp_path / name / "optimized") == _files(tmp_path / name / "as-loaded"), name


def test_tied_weights_stay_tied_and_as_they_are(tied_target):
    target = optimize(copy.deepcopy(tied_target))
    assert target.lm_head.weight is target.model.embed_tokens.weight and target.lm_head.weight.is_contiguous()
    assert target.model.layers[0].mlp.up_proj.weight.t().is_contiguous()  # every untied linear is laid out
    assert weight_layout(target) == "column-major"
    for prompt in PROMPTS:
        expected = tied_target.generate(prompt, max_new_tokens=16, do_sample=False)
        assert torch.equal(target.generate(prompt, max_new_tokens=16, do_sample=False), expected)


def test_a_drafts_attached_target_modules_are_left_to_the_target(tied_target):
    draft = tiny_draft(draft_vocab_size=96, share_target_lm_head=True)
    draft.attach_target(tied_target)
    optimize(draft)
    assert tied_target.lm_head.weight.is_contiguous() and draft.fc.weight.t().is_contiguous()


def test_optimize_is_idempotent_in_place_and_undone_by_standard_layout(llama_target):
    target = copy.deepcopy(llama_target)
    parameters = list(target.parameters())
    assert optimize(target) is target and optimize(target) is target
    assert list(target.parameters()) == parameters  # the same parameters, re-laid in place: no extra memory
    assert all(torch.equal(a, b) for a, b in zip(target.parameters(), llama_target.parameters()))
    standard_layout(target)
    assert weight_layout(target) == "standard" and all(weight.is_contiguous() for weight in target.parameters())
