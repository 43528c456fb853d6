"""Sampling with EAGLE-3 is lossless: the joint distribution of the first three generated tokens equals the
target's own sampling distribution (temperature, top-k, top-p), in tree and chain mode.

The exact distribution is computed by enumerating every 3-token continuation of a tiny target (vocabulary 32).
Each configuration draws `SAMPLES` sequences; a chi-square goodness-of-fit test (cells with expected count >= 5,
the rest pooled into one cell) must not reject at p < 1e-3 (10 configurations: a family-wise false alarm rate
under 1%). Plain sampling passes the same test, which checks the exact computation itself. One configuration draws
its sequences one call at a time, as users call; the others draw `ROWS` at a time, the rows of a batch of one prompt
repeated (a row's draws are its own: rows share no randomness and no decision), ten times faster. Trees holding
context n-gram continuations (`ngram_candidates`) are sampled after a prompt that repeats itself, so that
continuations are found and accepted (in about one call of five).
"""

import pytest
import torch
from helpers import SAMPLES, SAMPLING_VOCAB, SETTINGS, chi_square_p_value, exact_joint

PROMPT = torch.tensor([[5, 17, 3, 9]])
REPEATING_PROMPT = torch.tensor([[5, 17, 3, 9, 16, 9, 16, 9, 8, 8, 8]])  # PROMPT and the target's greedy answer


ROWS = 40  # sequences drawn per call, as a batch of one prompt repeated


def _sample_counts(target, settings: dict, prompt: torch.Tensor = PROMPT, rows: int = ROWS,
                   **generate_kwargs) -> torch.Tensor:
    """Counts of the first three sampled tokens over `SAMPLES` sequences, drawn `rows` at a time."""
    counts = torch.zeros(SAMPLING_VOCAB, SAMPLING_VOCAB, SAMPLING_VOCAB)
    batch = prompt.expand(rows, -1)
    for _ in range(SAMPLES // rows):
        out = target.generate(batch, attention_mask=torch.ones_like(batch), do_sample=True, max_new_tokens=3,
                              top_k=settings.get("top_k", 0), top_p=settings.get("top_p", 1.0),
                              temperature=settings["temperature"], **generate_kwargs)
        for sequence in out[:, prompt.shape[1]:].tolist():
            counts[tuple(sequence)] += 1
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
    one_at_a_time = name == "temperature-1.0" and shape["tree_top_k"] > 1  # the batch-1 call, as users make it
    counts = _sample_counts(sampling_target, settings, rows=1 if one_at_a_time else ROWS,
                            assistant_model=sampling_draft, **shape)
    accepted = sum(sampling_draft.generation_stats.acceptance_lengths)
    assert chi_square_p_value(counts, exact_joint(sampling_target, settings, PROMPT)) > 1e-3
    assert accepted >= 1  # the last call went through verification


def test_sampling_with_a_repetition_penalty_matches_the_exact_distribution(sampling_target, sampling_draft):
    """The penalty reads the sequence: each node's scores are computed after its own path."""
    torch.manual_seed(3)
    settings = SETTINGS["temperature-1.0"] | dict(repetition_penalty=1.5)
    counts = _sample_counts(sampling_target, settings, assistant_model=sampling_draft, repetition_penalty=1.5,
                            tree_top_k=3, tree_depth=3, tree_total_tokens=8)
    assert chi_square_p_value(counts, exact_joint(sampling_target, settings, PROMPT)) > 1e-3
    assert sum(sampling_draft.generation_stats.acceptance_lengths) >= 1


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
