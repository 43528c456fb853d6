"""Sampling with EAGLE-3 is lossless: the joint distribution of the first three generated tokens equals the
target's own sampling distribution (temperature, top-k, top-p), in tree and chain mode.

The exact distribution is computed by enumerating every 3-token continuation of a tiny target (vocabulary 32).
Each configuration draws `SAMPLES` sequences; a chi-square goodness-of-fit test (cells with expected count >= 5,
the rest pooled into one cell) must not reject at p < 1e-3 (10 configurations: a family-wise false alarm rate
under 1%). Plain sampling passes the same test, which checks the exact computation itself. Trees holding context n-gram
continuations (`ngram_candidates`) are sampled after a prompt that repeats itself, so that continuations are found
and accepted (in about one call of five).
"""

import pytest
import torch
from helpers import SAMPLES, SAMPLING_VOCAB, SETTINGS, chi_square_p_value, exact_joint

PROMPT = torch.tensor([[5, 17, 3, 9]])
REPEATING_PROMPT = torch.tensor([[5, 17, 3, 9, 16, 9, 16, 9, 8, 8, 8]])  # PROMPT and the target's greedy answer


def _sample_counts(target, settings: dict, prompt: torch.Tensor = PROMPT, **generate_kwargs) -> torch.Tensor:
    counts = torch.zeros(SAMPLING_VOCAB, SAMPLING_VOCAB, SAMPLING_VOCAB)
    for _ in range(SAMPLES):
        out = target.generate(prompt, do_sample=True, max_new_tokens=3, top_k=settings.get("top_k", 0),
                              top_p=settings.get("top_p", 1.0), temperature=settings["temperature"], **generate_kwargs)
        counts[tuple(out[0, prompt.shape[1]:].tolist())] += 1
    return counts


def test_plain_sampling_matches_the_exact_distribution(sampling_target):
    torch.manual_seed(0)
    settings = SETTINGS["temperature-1.0"]
    counts = _sample_counts(sampling_target, settings)
    assert chi_square_p_value(counts, exact_joint(sampling_target, settings, PROMPT)) > 1e-3


@pytest.mark.parametrize("shape", [dict(tree_top_k=3, tree_depth=3, tree_total_tokens=8),
                                   dict(tree_top_k=1, tree_depth=3)], ids=["tree", "chain"])
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_eagle3_sampling_matches_the_exact_distribution(sampling_target, sampling_draft, name, shape):
    torch.manual_seed(1)
    settings = SETTINGS[name]
    counts = _sample_counts(sampling_target, settings, assistant_model=sampling_draft, **shape)
    accepted = sum(sampling_draft.generation_stats.acceptance_lengths)
    assert chi_square_p_value(counts, exact_joint(sampling_target, settings, PROMPT)) > 1e-3
    assert accepted >= 1  # the last call went through verification


@pytest.mark.parametrize(("name", "shape"), [("temperature-1.0", dict(tree_top_k=3, tree_depth=3, tree_total_tokens=8)),
                                             ("top-k-20", dict(tree_top_k=1, tree_depth=3))], ids=["tree", "chain"])
def test_sampling_with_context_ngram_candidates_matches_the_exact_distribution(sampling_target, sampling_draft, name,
                                                                               shape):
    """Continuation tokens are point masses next to the draft's candidates (a sampled chain's child included)."""
    torch.manual_seed(2)
    target, draft, settings = sampling_target, sampling_draft, SETTINGS[name]
    counts = _sample_counts(target, settings, REPEATING_PROMPT, assistant_model=draft, ngram_candidates=True, **shape)
    assert chi_square_p_value(counts, exact_joint(target, settings, REPEATING_PROMPT)) > 1e-3
    accepted_continuations = 0
    for _ in range(50):  # the continuations were really verified, and some accepted
        target.generate(REPEATING_PROMPT, do_sample=True, max_new_tokens=3, temperature=settings["temperature"],
                        top_k=settings.get("top_k", 0), assistant_model=draft, ngram_candidates=True, **shape)
        accepted_continuations += draft.generation_stats.continuation_tokens
    assert accepted_continuations > 0
