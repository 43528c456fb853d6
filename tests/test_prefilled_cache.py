"""`generate(assistant_model=draft)` continuing a cache that already holds a prefix (a cache the user filled, or the
one a previous call returned, as a chat reuses it turn after turn) gives exactly what plain `generate` gives with the
same cache."""

import copy

import pytest
import torch
from helpers import VOCAB
from transformers import DynamicCache, StaticCache

from hf_eagle3.utils.transformers_api import CACHE, output_cache

PROMPT = torch.randint(1, VOCAB, (1, 14), generator=torch.Generator().manual_seed(3))
TREE = {"tree_depth": 4, "tree_top_k": 3, "tree_total_tokens": 12}
CHAIN = {"tree_depth": 4, "tree_top_k": 1}
GREEDY = {"do_sample": False, "max_new_tokens": 24}


def _cache(target, kind: str):
    return StaticCache(config=target.config, max_cache_len=160) if kind == "static" else DynamicCache()


def _prefilled(target, kind: str, tokens: torch.Tensor) -> dict:
    """`generate`'s cache argument: a cache of `kind` holding `tokens`."""
    cache = _cache(target, kind)
    with torch.no_grad():
        target(tokens, **{CACHE: cache})
    return {CACHE: cache}


@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize("shape", [TREE, CHAIN], ids=["tree", "chain"])
def test_a_cache_holding_a_prefix_continues_exactly_as_plain_generate(llama_target, fitted_draft, kind, shape):
    for cached in (1, 6, 13):
        expected = llama_target.generate(PROMPT, **_prefilled(llama_target, kind, PROMPT[:, :cached]), **GREEDY)
        out = llama_target.generate(PROMPT, **_prefilled(llama_target, kind, PROMPT[:, :cached]),
                                    assistant_model=fitted_draft, **GREEDY, **shape)
        assert torch.equal(out, expected), cached
        assert fitted_draft.generation_stats.mean_acceptance_length > 1.0  # the draft ran from the uncached part


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_chat_continued_over_three_turns_from_the_returned_cache_equals_plain_generate(llama_target, fitted_draft,
                                                                                        kind):
    sequence, cache, plain_sequence = PROMPT[:, :6], _cache(llama_target, kind), PROMPT[:, :6]
    plain_cache = copy.deepcopy(cache)
    for turn in range(3):
        if turn:  # the user's next message after the answer so far
            message = torch.randint(1, VOCAB, (1, 4), generator=torch.Generator().manual_seed(turn))
            sequence, plain_sequence = torch.cat([sequence, message], 1), torch.cat([plain_sequence, message], 1)
        same_cache = llama_target.generate(sequence, **{CACHE: copy.deepcopy(cache)}, **GREEDY)
        out = llama_target.generate(sequence, **{CACHE: cache}, assistant_model=fitted_draft,
                                    return_dict_in_generate=True, **GREEDY, **TREE)
        plain = llama_target.generate(plain_sequence, **{CACHE: plain_cache}, return_dict_in_generate=True, **GREEDY)
        assert torch.equal(out.sequences, same_cache), turn  # plain generate given the same cache
        assert torch.equal(out.sequences, plain.sequences), turn  # and the whole chat without EAGLE-3
        cache, plain_cache = output_cache(out), output_cache(plain)
        assert int(cache.get_seq_length()) == int(plain_cache.get_seq_length()) == out.sequences.shape[1] - 1
        sequence, plain_sequence = out.sequences, plain.sequences


def test_a_cache_that_holds_the_whole_prompt_or_input_ids_of_the_new_tokens_only_are_refused(llama_target,
                                                                                              fitted_draft):
    with pytest.raises(ValueError, match="at least one new token"):
        llama_target.generate(PROMPT, **_prefilled(llama_target, "dynamic", PROMPT), assistant_model=fitted_draft,
                              **GREEDY)
    new_tokens, mask = PROMPT[:, 6:], torch.ones_like(PROMPT)  # the new tokens, with the whole sequence's mask
    with pytest.raises(ValueError, match="continues a cache from the whole sequence"):
        llama_target.generate(new_tokens, attention_mask=mask, **_prefilled(llama_target, "dynamic", PROMPT[:, :6]),
                              assistant_model=fitted_draft, **GREEDY)


def test_exact_attention_continues_a_prefilled_cache_as_plain_generate(llama_target, fitted_draft):
    expected = llama_target.generate(PROMPT, **_prefilled(llama_target, "dynamic", PROMPT[:, :6]), **GREEDY)
    out = llama_target.generate(PROMPT, **_prefilled(llama_target, "dynamic", PROMPT[:, :6]),
                                assistant_model=fitted_draft, exact_attention=True, **GREEDY, **TREE)
    assert torch.equal(out, expected)
