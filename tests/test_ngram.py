"""Context n-gram continuations: finding them, merging them into the draft's candidates, learning their rates."""

import math

import torch

from hf_eagle3.decoding.ngram import ContextIndex, ContinuationAcceptance, find_continuation, merge_continuation
from hf_eagle3.decoding.tree import build_tree


def test_the_longest_suffix_match_wins_and_its_most_recent_occurrence():
    tokens = [7, 1, 2, 3, 9, 2, 3, 4, 5, 1, 2, 3]
    continuation, match = find_continuation(tokens, max_match=3, max_tokens=4)
    assert match == 3 and continuation == [9, 2, 3, 4]  # "1 2 3" occurs once before
    continuation, match = find_continuation(tokens, max_match=2, max_tokens=4)
    assert match == 2 and continuation == [4, 5, 1, 2]  # "2 3": the latest earlier occurrence
    continuation, match = find_continuation([4, 5, 6], max_match=3, max_tokens=4)
    assert match == 0 and continuation == []
    continuation, _ = find_continuation([1, 2, 1, 2], max_match=2, max_tokens=5)
    assert continuation == [1, 2]  # what follows, up to the end of the text


def test_an_index_extended_cycle_by_cycle_finds_what_a_search_of_the_whole_text_finds():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 5, (200,), generator=generator).tolist()
    index = ContextIndex(3, tokens[:7])
    for end in range(7, 200, 3):
        index.extend(tokens[len(index.tokens) : end])
        assert index.find(6) == _searched(tokens[:end], 3, 6)


def _searched(tokens: list[int], max_match: int, max_tokens: int) -> tuple[list[int], int]:
    """The most recent earlier occurrence of the longest suffix, by scanning the text backwards."""
    for size in range(min(max_match, len(tokens) - 1), 0, -1):
        suffix = tokens[len(tokens) - size :]
        for start in range(len(tokens) - 1 - size, -1, -1):
            if tokens[start : start + size] == suffix:
                return tokens[start + size : start + size + max_tokens], size
    return [], 0


def _draft_candidates():
    # root children 10 (score -0.1), 11 (-1.0); children of 10: 12 (-0.3), 13 (-2.0)
    tokens = torch.tensor([10, 11, 12, 13])
    scores = torch.tensor([-0.1, -1.0, -0.3, -2.0])
    parents = torch.tensor([-1, -1, 0, 0])
    depths = torch.tensor([1, 1, 2, 2])
    return tokens, scores, parents, depths


def test_a_continuation_that_agrees_with_the_draft_extends_its_branch():
    tokens, scores, parents, depths = _draft_candidates()
    log_rates = torch.log(torch.tensor([0.5, 0.9, 0.9, 0.9]))
    merged_tokens, merged_scores, merged_parents, merged_depths, chain = (tensor[0] for tensor in merge_continuation(
        tokens[None], scores[None], parents[None], depths[None], torch.tensor([[10, 13, 20, 21]]), log_rates[None]))
    assert chain.tolist() == [0, 3, 6, 7]  # 10 and 13 are the draft's nodes, 20 and 21 new below 13
    # one slot per continuation token, whatever agrees: the slots of tokens the draft holds are never kept
    assert merged_tokens.tolist() == [10, 11, 12, 13, 10, 13, 20, 21]
    assert merged_parents[6:].tolist() == [3, 6] and merged_depths[6:].tolist() == [3, 4]
    assert merged_scores[4:6].tolist() == [-math.inf, -math.inf]
    # 10 keeps the draft's higher score; 13 is boosted to the continuation's estimate
    assert math.isclose(merged_scores[0], -0.1, abs_tol=1e-6)
    assert math.isclose(merged_scores[3], -0.1 + math.log(0.9), abs_tol=1e-6)
    assert math.isclose(merged_scores[7], -0.1 + 3 * math.log(0.9), abs_tol=1e-5)
    assert torch.equal(scores, _draft_candidates()[1])  # the inputs are left alone


def test_the_budget_keeps_continuation_tokens_where_they_score_higher():
    tokens, scores, parents, depths = _draft_candidates()
    merged = [tensor[0] for tensor in merge_continuation(tokens[None], scores[None], parents[None], depths[None],
                                                         torch.tensor([[30, 31, 32]]),
                                                         torch.log(torch.tensor([[0.8, 0.8, 0.8]])))]
    tree = build_tree(torch.tensor(99), *merged[:4], total_tokens=4)
    assert tree.tokens.tolist() == [99, 10, 30, 12, 31]  # ordered by depth: 11, 13, 32 lose to the continuation
    assert tree.parents.tolist() == [0, 0, 0, 1, 2] and tree.depths.tolist() == [0, 1, 1, 2, 2]


def test_a_continuation_shorter_than_its_slots_leaves_the_rest_unkept():
    tokens, scores, parents, depths = _draft_candidates()
    merged = merge_continuation(tokens[None], scores[None], parents[None], depths[None], torch.tensor([[30, -1, -1]]),
                                torch.tensor([[math.log(0.8), -math.inf, -math.inf]]))
    assert merged[1][0, 4:].tolist()[1:] == [-math.inf, -math.inf]
    tree = build_tree(torch.tensor(99), *(tensor[0] for tensor in merged[:4]), total_tokens=5)
    assert sorted(tree.candidate_ids.tolist()) == [0, 1, 2, 3, 4]  # the draft's four and the continuation's one


def test_acceptance_rates_are_learnt_per_match_length_and_position():
    estimate = ContinuationAcceptance.prior(max_match=2)
    assert estimate.log_rates(1, 3) == [math.log(0.5)] * 3
    estimate = estimate.updated(match=2, kept=4, accepted=2)  # positions 0, 1 accepted, 2 rejected, 3 not reached
    assert estimate.proposed[1][:4] == (3.0, 3.0, 3.0, 2.0) and estimate.accepted[1][:4] == (2.0, 2.0, 1.0, 1.0)
    assert estimate.proposed[0] == ContinuationAcceptance.prior(2).proposed[0]  # other match lengths unchanged
    assert estimate.updated(match=1, kept=0, accepted=0) is estimate
    long = estimate.log_rates(2, 12)
    assert len(long) == 12 and long[8] == long[11]  # far positions share one rate
