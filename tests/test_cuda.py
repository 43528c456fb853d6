"""EAGLE-3 on one GPU (`pytest -m cuda`, which `make device-check` runs): greedy decoding equals plain decoding there,
for one sequence and a left-padded batch; a draft without an acceptance profile decodes with the official tree; the
draft's vocabulary and the target's embedding stay on the GPU; a draft left on another device is named. Skipped where
torch sees no GPU."""

import pytest
import torch
from helpers import VOCAB, tiny_draft, tiny_target

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

GPU = torch.device("cuda")
TREE = dict(tree_depth=4, tree_top_k=3, tree_total_tokens=12)
SHAPES = {"tree": TREE, "chain": dict(tree_depth=4, tree_top_k=1), "exact-tree": TREE | dict(exact_attention=True)}


def _prompt(length: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (1, length), generator=torch.Generator().manual_seed(length)).to(GPU)


def _models():
    return tiny_target("llama").to(GPU), tiny_draft().to(GPU)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_greedy_on_a_gpu_equals_plain_decoding(shape):
    target, draft = _models()
    for length in (3, 9, 17):
        prompt = _prompt(length)
        expected = target.generate(prompt, do_sample=False, max_new_tokens=24)
        assert torch.equal(target.generate(prompt, do_sample=False, assistant_model=draft, max_new_tokens=24,
                                           **shape), expected)


def test_a_left_padded_batch_on_a_gpu_equals_plain_batched_decoding():
    target, draft = _models()
    lengths = (5, 9, 3, 12)
    input_ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        input_ids[row, -length:] = _prompt(length)[0].cpu()
        attention_mask[row, -length:] = 1
    batch = dict(input_ids=input_ids.to(GPU), attention_mask=attention_mask.to(GPU), pad_token_id=0, do_sample=False,
                 max_new_tokens=20)
    assert torch.equal(target.generate(**batch, assistant_model=draft, **TREE), target.generate(**batch))


def test_a_draft_without_a_profile_decodes_with_the_official_tree_on_a_gpu():
    target, draft = _models()
    target.generate(_prompt(9), do_sample=False, assistant_model=draft, max_new_tokens=8)
    settings = draft.generation_stats.settings
    assert (settings.depth, settings.top_k, settings.total_tokens) == (7, 10, 60)


def test_sampling_on_a_gpu_emits_every_requested_token():
    target, draft = _models()
    prompt = _prompt(9)
    out = target.generate(prompt, do_sample=True, top_k=20, assistant_model=draft, max_new_tokens=16,
                          min_new_tokens=16, **TREE)
    assert out.shape == (1, prompt.shape[1] + 16) and out.device.type == "cuda"


def test_a_drafts_vocabulary_and_attached_embedding_stay_on_its_gpu():
    target, draft = _models()
    draft.set_draft_vocabulary(torch.randperm(VOCAB)[:64])  # ids from the host, the draft on the GPU
    assert draft.d2t.device.type == "cuda" and draft.draft_to_target.device.type == "cuda"
    draft.attach_target(target)
    assert draft.embed_tokens.weight is target.get_input_embeddings().weight


def test_a_draft_left_on_the_host_is_named_with_the_fix():
    target, draft = tiny_target("llama").to(GPU), tiny_draft()
    with pytest.raises(ValueError, match=r"The draft is on cpu and the target on cuda"):
        target.generate(_prompt(3), do_sample=False, assistant_model=draft, max_new_tokens=4)
