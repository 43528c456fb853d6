"""Pure tensor tests of the acceptance rules (no models)."""

import torch
from helpers import greedy_path

from hf_eagle3.decoding.tree import DraftTree, ancestor_matrix
from hf_eagle3.decoding.verify import accept_among_children, accept_sampled, accept_sampling, children


def _tree(tokens, parents, depths):
    parents = torch.tensor(parents)
    depths = torch.tensor(depths)
    return DraftTree(torch.tensor(tokens), parents, depths, ancestor_matrix(parents, int(depths.max())),
                     torch.arange(len(tokens) - 1), -torch.arange(len(tokens) - 1.0), depths[1:], int(depths.max()))


#   0(root 5) -> 1(7) -> 3(9) -> 5(4)
#             -> 2(8) -> 4(9)
TREE = _tree([5, 7, 8, 9, 9, 4], [0, 0, 0, 1, 2, 3], [0, 1, 1, 2, 2, 3])


def test_greedy_accepts_the_longest_matching_path():
    # target's greedy token after each node
    choices = torch.tensor([7, 9, 9, 4, 1, 6])
    path = greedy_path(TREE, choices)
    assert path.tolist() == [0, 1, 3, 5] and choices[path[-1]] == 6


def test_greedy_stops_at_the_first_mismatch_and_takes_the_targets_token():
    choices = torch.tensor([8, 3, 2, 4, 1, 6])
    path = greedy_path(TREE, choices)
    assert path.tolist() == [0, 2] and choices[path[-1]] == 2


def test_greedy_rejects_everything_when_no_child_matches():
    path = greedy_path(TREE, torch.tensor([3, 9, 9, 4, 1, 6]))
    assert path.tolist() == [0]


def test_children_in_drafting_order():
    assert children(TREE, 0).tolist() == [1, 2]
    assert children(TREE, 5).tolist() == []


def _empirical(sample, draws: int, size: int) -> torch.Tensor:
    counts = torch.zeros(size)
    for _ in range(draws):
        counts[sample()] += 1
    return counts / draws


def test_trying_deterministic_candidates_in_order_is_lossless():
    torch.manual_seed(0)
    target = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    candidates = torch.tensor([3, 1, 4])

    def sample():
        index, residual = accept_among_children(target, candidates, torch.rand(3))
        return candidates[index] if index >= 0 else torch.multinomial(residual, 1)

    draws = 40_000  # standard error of each frequency <= 0.0025; bound 4 sigma
    assert (_empirical(sample, draws, 5) - target).abs().max() < 0.01


def test_standard_rule_for_a_sampled_token_is_lossless():
    torch.manual_seed(0)
    target = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    draft = torch.tensor([0.3, 0.1, 0.2, 0.2, 0.2])

    def sample():
        token = int(torch.multinomial(draft, 1))
        accepted, residual = accept_sampled(target, draft, token, float(torch.rand(())))
        return token if accepted else torch.multinomial(residual, 1)

    assert (_empirical(sample, 40_000, 5) - target).abs().max() < 0.01


def test_rejection_of_every_candidate_holding_all_mass_falls_back_to_the_target():
    target = torch.tensor([0.0, 1.0, 0.0])
    index, residual = accept_among_children(target, torch.tensor([1]), torch.tensor([1.0]))
    assert index == -1 and torch.equal(residual, target)


def test_sampled_chains_with_a_continuation_are_lossless_decided_at_once():
    """Root -> 1 -> 3 a chain sampled from the draft (`q_0`, then `q_1`), root -> 2 a context continuation's token
    (a point mass, tried after the sampled child): the first emitted token is distributed as the root's `p_0`, the one
    after node 1 as node 1's `p_1`. Each row of one batch is a draw."""
    torch.manual_seed(0)
    rows = 40_000  # standard error of each frequency <= 0.0025 (0.004 for the second token); bound 4 sigma
    target = torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15], [0.5, 0.1, 0.1, 0.1, 0.2], [0.2] * 5, [0.2] * 5])
    draft = torch.tensor([[0.3, 0.1, 0.2, 0.2, 0.2], [0.1, 0.1, 0.6, 0.1, 0.1]])
    chain = torch.multinomial(draft, rows, replacement=True)  # [2, rows]: node 1's tokens, node 3's
    tokens = torch.stack([torch.zeros(rows, dtype=torch.long), chain[0], torch.full((rows,), 3), chain[1]], dim=1)
    parents, depths = torch.tensor([0, 0, 0, 1]).expand(rows, -1), torch.tensor([0, 1, 1, 2]).expand(rows, -1)
    tree = DraftTree(tokens, parents, depths, ancestor_matrix(parents, 2), parents[:, 1:], depths[:, 1:].double(),
                     depths[:, 1:], 2)
    proposals = torch.stack([draft[0], draft[0], draft[0], draft[1]]).expand(rows, -1, -1)  # node i drawn from row i
    sampled = torch.tensor([False, True, False, True]).expand(rows, -1)
    acceptance = accept_sampling(tree, target.log().expand(rows, -1, -1), proposals=proposals, sampled=sampled)
    first = torch.bincount(acceptance.tokens[:, 0], minlength=5) / rows
    assert (first - target[0]).abs().max() < 0.01
    through_node_1 = (acceptance.lengths >= 2) & (acceptance.path[:, 1] == 1)
    second = torch.bincount(acceptance.tokens[through_node_1, 1], minlength=5) / through_node_1.sum()
    assert through_node_1.sum() > rows / 10 and (second - target[1]).abs().max() < 0.016
