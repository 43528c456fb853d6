"""`hf_eagle3.optimize(model)`: linear layers laid out for cheap multi-row forwards on CPU, explicitly, column-major or
packed for oneDNN. The same values, so the same greedy float32 tokens, with EAGLE-3 and without; the same
`save_pretrained` bytes; tied weights left tied; a packed copy never outlives a change of its weight."""

import copy
import hashlib

import pytest
import torch
from helpers import _TINY, tiny_draft
from transformers import LlamaConfig, LlamaForCausalLM

from hf_eagle3 import optimize, standard_layout
from hf_eagle3.decoding.cpu_layout import LAYOUTS, PackedLinear, fastest_layout, onednn_packs, weight_layout

PROMPTS = [torch.randint(1, 90, (1, 9), generator=torch.Generator().manual_seed(seed)) for seed in range(3)]
requires_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")
EACH_LAYOUT = pytest.mark.parametrize("layout", [
    "column-major", pytest.param("onednn", marks=requires_onednn)])


def _files(directory) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def tied_target():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**_TINY, tie_word_embeddings=True)).eval()


@EACH_LAYOUT
@pytest.mark.parametrize("with_eagle3", [False, True])
def test_greedy_float32_outputs_are_those_of_the_model_as_loaded(llama_target, fitted_draft, with_eagle3, layout):
    target, draft = optimize(copy.deepcopy(llama_target), layout), optimize(copy.deepcopy(fitted_draft), layout)
    assert weight_layout(target) == layout and weight_layout(llama_target) == "standard"
    eagle3 = {"assistant_model": draft, "tree_depth": 3, "tree_top_k": 3, "tree_total_tokens": 8} if with_eagle3 else {}
    for prompt in PROMPTS:
        expected = llama_target.generate(prompt, max_new_tokens=24, do_sample=False)
        assert torch.equal(target.generate(prompt, max_new_tokens=24, do_sample=False, **eagle3), expected)


@EACH_LAYOUT
def test_save_pretrained_writes_the_same_bytes(llama_target, tied_target, fitted_draft, tmp_path, layout):
    for name, model in (("untied", llama_target), ("tied", tied_target), ("draft", fitted_draft)):
        model.save_pretrained(tmp_path / name / "as-loaded")
        optimized = optimize(copy.deepcopy(model), layout)
        optimized.save_pretrained(tmp_path / name / "optimized")
        assert _files(tmp_path / name / "optimized") == _files(tmp_path / name / "as-loaded"), name


def test_column_major_leaves_tied_weights_tied_and_as_they_are(tied_target):
    target = optimize(copy.deepcopy(tied_target), "column-major")
    assert target.lm_head.weight is target.model.embed_tokens.weight and target.lm_head.weight.is_contiguous()
    assert target.model.layers[0].mlp.up_proj.weight.t().is_contiguous()  # every untied linear is laid out
    assert weight_layout(target) == "column-major"
    for prompt in PROMPTS:
        expected = tied_target.generate(prompt, max_new_tokens=16, do_sample=False)
        assert torch.equal(target.generate(prompt, max_new_tokens=16, do_sample=False), expected)


@requires_onednn
def test_onednn_packs_tied_weights_too_and_leaves_them_tied(tied_target):
    target = optimize(copy.deepcopy(tied_target), "onednn")
    assert target.lm_head.weight is target.model.embed_tokens.weight and type(target.lm_head) is PackedLinear
    for prompt in PROMPTS:
        expected = tied_target.generate(prompt, max_new_tokens=16, do_sample=False)
        assert torch.equal(target.generate(prompt, max_new_tokens=16, do_sample=False), expected)


@EACH_LAYOUT
def test_a_drafts_attached_target_modules_are_left_to_the_target(tied_target, layout):
    target = copy.deepcopy(tied_target)
    draft = tiny_draft(draft_vocab_size=96, share_target_lm_head=True)
    draft.attach_target(target)
    optimize(draft, layout)
    assert weight_layout(target) == "standard" and weight_layout(draft) == layout


@EACH_LAYOUT
def test_optimize_is_idempotent_in_place_and_undone_by_standard_layout(llama_target, layout):
    target = copy.deepcopy(llama_target)
    parameters = list(target.parameters())
    assert optimize(target, layout) is target and optimize(target, layout) is target
    assert list(target.parameters()) == parameters  # the same parameters, in place
    assert all(torch.equal(a, b) for a, b in zip(target.parameters(), llama_target.parameters()))
    standard_layout(target)
    assert weight_layout(target) == "standard" and all(weight.is_contiguous() for weight in target.parameters())
    assert all(type(module) is not PackedLinear for module in target.modules())


@requires_onednn
def test_a_packed_layer_follows_its_weight_when_it_changes_after_packing(llama_target):
    target = optimize(copy.deepcopy(llama_target), "onednn")
    prompt = PROMPTS[0]
    with torch.no_grad():
        for layer in target.model.layers:  # edited in place, as load_state_dict does
            layer.mlp.down_proj.weight.mul_(-1.5)
        reference = copy.deepcopy(target)  # a copy packs its own at its first forward
        standard_layout(reference)
        assert torch.allclose(target(prompt).logits, reference(prompt).logits, atol=1e-5)
        target.model.layers[0].self_attn.o_proj.weight = torch.nn.Parameter(torch.zeros(32, 32))  # re-assigned
        reference.model.layers[0].self_attn.o_proj.weight = torch.nn.Parameter(torch.zeros(32, 32))
        assert torch.allclose(target(prompt).logits, reference(prompt).logits, atol=1e-5)


@requires_onednn
def test_a_packed_layer_trains_and_casts_as_the_layer_it_was(llama_target):
    target = optimize(copy.deepcopy(llama_target), "onednn")
    reference = copy.deepcopy(llama_target)
    for model in (target, reference):
        model(PROMPTS[0], labels=PROMPTS[0]).loss.backward()  # autograd: the weight as it is, unpacked
    for packed, plain in zip(target.parameters(), reference.parameters()):
        assert torch.allclose(packed.grad, plain.grad, atol=1e-5)
    target.to(torch.bfloat16)
    with torch.no_grad():
        assert target(PROMPTS[0]).logits.dtype == torch.bfloat16


def test_auto_picks_a_measured_layout_and_fastest_layout_leaves_the_model_as_it_is(llama_target):
    target = copy.deepcopy(llama_target)
    assert fastest_layout(target) in ("standard", *LAYOUTS) and weight_layout(target) == "standard"
    assert weight_layout(optimize(target)) in ("standard", *LAYOUTS)
    with pytest.raises(ValueError, match="Unknown layout 'packed': pick 'auto'"):
        optimize(target, "packed")


def test_the_onednn_layout_refuses_weights_it_cannot_pack_and_names_the_fix(llama_target):
    target = copy.deepcopy(llama_target).to(torch.float64)  # oneDNN packs no float64 anywhere
    with pytest.raises(ValueError, match=r"packs float32 weights.*torch.float64 here. Use layout='auto'"):
        optimize(target, "onednn")
    assert weight_layout(target) == "standard"


@pytest.mark.skipif(not onednn_packs(torch.bfloat16), reason="oneDNN packs bfloat16 only on CPUs with bf16 units")
def test_on_a_cpu_with_bf16_units_onednn_packs_bfloat16_weights_and_computes_what_they_compute(llama_target):
    reference = copy.deepcopy(llama_target).to(torch.bfloat16)
    target = optimize(copy.deepcopy(reference), "onednn")
    assert weight_layout(target) == "onednn"
    with torch.no_grad():
        for prompt in PROMPTS:  # bf16 GEMMs may round apart: the same logits up to bf16 rounding
            expected, logits = reference(prompt).logits.float(), target(prompt).logits.float()
            assert torch.allclose(logits, expected, atol=0.05, rtol=0.02)
