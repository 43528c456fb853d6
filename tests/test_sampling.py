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
from conftest import fit_draft, tiny_draft, tiny_target
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

VOCAB = 32
SAMPLES = 1200
SETTINGS = {
    "temperature-0.7": dict(temperature=0.7),
    "temperature-1.0": dict(temperature=1.0),
    "top-p-0.9": dict(temperature=1.0, top_p=0.9),
    "top-k-20": dict(temperature=1.0, top_k=20),
}
PROMPT = torch.tensor([[5, 17, 3, 9]])
REPEATING_PROMPT = torch.tensor([[5, 17, 3, 9, 16, 9, 16, 9, 8, 8, 8]])  # PROMPT and the target's greedy answer


@pytest.fixture(scope="module")
def target():
    model = tiny_target(vocab_size=VOCAB, seed=7)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # a peaked distribution: most mass in few cells, as in real LMs
    return model


@pytest.fixture(scope="module")
def draft(target):
    return fit_draft(tiny_draft(vocab_size=VOCAB, draft_vocab_size=VOCAB), target, steps=60)


def _warpers(settings: dict) -> LogitsProcessorList:
    warpers = LogitsProcessorList([TemperatureLogitsWarper(settings["temperature"])])
    if "top_k" in settings:
        warpers.append(TopKLogitsWarper(settings["top_k"]))
    if "top_p" in settings:
        warpers.append(TopPLogitsWarper(settings["top_p"]))
    return warpers


@torch.no_grad()
def _exact_joint(target, settings: dict, prompt: torch.Tensor = PROMPT) -> torch.Tensor:
    """`[V, V, V]` probability of each 3-token continuation of `prompt` under plain sampling."""
    warpers = _warpers(settings)

    def next_probs(sequences: torch.Tensor) -> torch.Tensor:
        logits = target(sequences).logits[:, -1].float()
        return warpers(sequences, logits).softmax(-1)

    first = next_probs(prompt)[0]  # [V]
    tokens = torch.arange(VOCAB)
    one = torch.cat([prompt.expand(VOCAB, -1), tokens[:, None]], dim=1)  # [V, L + 1]
    second = next_probs(one)  # [V, V]
    two = torch.cat([one.repeat_interleave(VOCAB, 0), tokens.repeat(VOCAB)[:, None]], dim=1)  # [V^2, L + 2]
    third = next_probs(two).view(VOCAB, VOCAB, VOCAB)
    return first[:, None, None] * second[:, :, None] * third


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.flatten().double() * counts.sum()
    observed = counts.flatten().double()
    kept = expected >= 5
    expected = torch.cat([expected[kept], expected[~kept].sum()[None]])
    observed = torch.cat([observed[kept], observed[~kept].sum()[None]])
    statistic = ((observed - expected) ** 2 / expected.clamp_min(1e-12)).sum()
    degrees = kept.sum().item()  # (cells - 1) with the pooled cell
    return torch.special.gammaincc(torch.tensor(degrees / 2.0), statistic / 2.0).item()


def _sample_counts(target, settings: dict, prompt: torch.Tensor = PROMPT, **generate_kwargs) -> torch.Tensor:
    counts = torch.zeros(VOCAB, VOCAB, VOCAB)
    for _ in range(SAMPLES):
        out = target.generate(prompt, do_sample=True, max_new_tokens=3, top_k=settings.get("top_k", 0),
                              top_p=settings.get("top_p", 1.0), temperature=settings["temperature"], **generate_kwargs)
        counts[tuple(out[0, prompt.shape[1]:].tolist())] += 1
    return counts


def test_plain_sampling_matches_the_exact_distribution(target):
    torch.manual_seed(0)
    settings = SETTINGS["temperature-1.0"]
    assert _chi_square_p_value(_sample_counts(target, settings), _exact_joint(target, settings)) > 1e-3


@pytest.mark.parametrize("shape", [dict(tree_top_k=3, tree_depth=3, tree_total_tokens=8),
                                   dict(tree_top_k=1, tree_depth=3)], ids=["tree", "chain"])
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_eagle3_sampling_matches_the_exact_distribution(target, draft, name, shape):
    torch.manual_seed(1)
    settings = SETTINGS[name]
    counts = _sample_counts(target, settings, assistant_model=draft, **shape)
    accepted = sum(draft.generation_stats.acceptance_lengths)
    assert _chi_square_p_value(counts, _exact_joint(target, settings)) > 1e-3
    assert accepted >= 1  # the last call went through verification


@pytest.mark.parametrize(("name", "shape"), [("temperature-1.0", dict(tree_top_k=3, tree_depth=3, tree_total_tokens=8)),
                                             ("top-k-20", dict(tree_top_k=1, tree_depth=3))], ids=["tree", "chain"])
def test_sampling_with_context_ngram_candidates_matches_the_exact_distribution(target, draft, name, shape):
    """Continuation tokens are point masses next to the draft's candidates (a sampled chain's child included)."""
    torch.manual_seed(2)
    settings = SETTINGS[name]
    counts = _sample_counts(target, settings, REPEATING_PROMPT, assistant_model=draft, ngram_candidates=True, **shape)
    assert _chi_square_p_value(counts, _exact_joint(target, settings, REPEATING_PROMPT)) > 1e-3
    accepted_continuations = 0
    for _ in range(50):  # the continuations were really verified, and some accepted
        target.generate(REPEATING_PROMPT, do_sample=True, max_new_tokens=3, temperature=settings["temperature"],
                        top_k=settings.get("top_k", 0), assistant_model=draft, ngram_candidates=True, **shape)
        accepted_continuations += draft.generation_stats.continuation_tokens
    assert accepted_continuations > 0
