"""On the compiled path (a static cache, forwards compiled) the draft's forwards take a fixed, small set of shapes,
whatever the number of cycles: what CUDA graphs capture. Greedy decoding stays plain decoding's.

`torch.compile` traces with the "eager" backend here (no code generation, seconds on a CPU); the shapes a forward
sees, and the graphs dynamo keeps, do not depend on the backend.
"""

import pytest
import torch
from helpers import VOCAB, tiny_draft
from torch._dynamo.utils import counters
from transformers import CompileConfig

from hf_eagle3.decoding import loop
from hf_eagle3.utils.transformers_api import compile_on_every_device

PROMPTS = [torch.randint(1, VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 9, 17)]
TREE = dict(tree_depth=4, tree_top_k=3, tree_total_tokens=12, ngram_candidates=True)
CHAIN = dict(tree_depth=4, tree_top_k=1)


def _compiled(target, draft, prompt, **kwargs):
    config = compile_on_every_device(CompileConfig(backend="eager", fullgraph=False, dynamic=False))
    return target.generate(prompt, do_sample=False, assistant_model=draft, cache_implementation="static",
                           compile_config=config, **kwargs)


@pytest.fixture
def draft_shapes(monkeypatch):
    """The `(input_ids, attention_mask)` shapes of every call of the draft's compiled forward, in order."""
    shapes, compiled_forward = [], loop.compiled_forward

    def recorded(model, compile_config):
        forward = compiled_forward(model, compile_config)
        if model.config.model_type != "eagle3":
            return forward

        def recording(**kwargs):
            shapes.append((tuple(kwargs["input_ids"].shape), tuple(kwargs["attention_mask"].shape)))
            return forward(**kwargs)

        return recording

    monkeypatch.setattr(loop, "compiled_forward", recorded)
    return shapes


@pytest.mark.parametrize("shape", [TREE, CHAIN], ids=["tree", "chain"])
def test_greedy_decoding_with_the_compiled_draft_equals_plain_decoding(llama_target, fitted_draft, draft_shapes,
                                                                        shape):
    for prompt in PROMPTS:
        expected = llama_target.generate(prompt, do_sample=False, max_new_tokens=30)
        assert torch.equal(_compiled(llama_target, fitted_draft, prompt, max_new_tokens=30, **shape), expected)
        assert fitted_draft.generation_stats.mean_acceptance_length > 1.0
    assert draft_shapes  # the draft's forwards ran compiled


def test_the_compiled_draft_sees_two_shapes_whatever_the_number_of_cycles(llama_target, fitted_draft, draft_shapes):
    seen = []
    for new_tokens in (6, 60):
        _compiled(llama_target, fitted_draft, PROMPTS[1], max_new_tokens=new_tokens, **TREE)
        seen.append((fitted_draft.generation_stats.num_cycles, set(draft_shapes)))
        draft_shapes.clear()
    (few_cycles, short), (many_cycles, long) = seen
    assert many_cycles > 3 * few_cycles and short == long
    width = fitted_draft.config.ngram_max_tokens + 1  # the longest accepted path (a continuation) and bonus token
    assert long == {((1, width), (1, 1, width, 256)), ((1, 3), (1, 1, 3, 256))}  # a feed, a depth step (top-k 3)


def test_a_repeated_compiled_call_compiles_no_new_graph(llama_target, fitted_draft):
    _compiled(llama_target, fitted_draft, PROMPTS[2], max_new_tokens=30, **TREE)
    graphs = counters["stats"]["unique_graphs"]
    _compiled(llama_target, fitted_draft, PROMPTS[2], max_new_tokens=30, **TREE)  # a new cache for target and draft
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_sliding_window_draft_drafts_eagerly_on_the_compiled_path(llama_target, draft_shapes):
    draft = tiny_draft(draft_vocab_size=VOCAB, layer_types=["sliding_attention"], sliding_window=3)
    expected = llama_target.generate(PROMPTS[1], do_sample=False, max_new_tokens=12)
    assert torch.equal(_compiled(llama_target, draft, PROMPTS[1], max_new_tokens=12, **CHAIN), expected)
    assert draft_shapes == []
