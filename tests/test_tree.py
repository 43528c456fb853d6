"""Pure tensor tests of draft-tree construction (no models)."""

import torch

from hf_eagle3.decoding.tree import ancestor_matrix, build_tree, expand, select_frontier, tree_attention_mask


def test_expand_keeps_the_best_children_with_cumulative_scores():
    log_probs = torch.log(torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.25, 0.25]]))
    scores, ids = expand(log_probs, torch.tensor([0.0, -1.0]), top_k=2)
    assert ids.tolist() == [[1, 2], [0, 1]]
    assert torch.allclose(scores, torch.tensor([[0.6, 0.3], [0.5 * torch.e**-1, 0.25 * torch.e**-1]]).log())


def test_select_frontier_picks_the_globally_best_children():
    child_scores = torch.tensor([[-1.0, -3.0], [-0.5, -2.0]])
    assert select_frontier(child_scores, 2).tolist() == [2, 0]


def test_ancestor_matrix_of_a_small_tree():
    #   0 -> 1 -> 3
    #     -> 2
    ancestors = ancestor_matrix(torch.tensor([0, 0, 0, 1]), max_depth=2)
    assert ancestors.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]


def test_build_tree_reranks_and_keeps_a_closed_topological_tree():
    # depth 1: candidates 0, 1; depth 2: children of 0 (2, 3) and of 1 (4, 5)
    tokens = torch.tensor([10, 11, 20, 21, 22, 23])
    scores = torch.tensor([-0.1, -2.0, -0.3, -0.9, -2.1, -5.0])
    parents = torch.tensor([-1, -1, 0, 0, 1, 1])
    depths = torch.tensor([1, 1, 2, 2, 2, 2])
    tree = build_tree(torch.tensor(5), tokens, scores, parents, depths, total_tokens=4)
    assert tree.tokens.tolist() == [5, 10, 11, 20, 21]
    assert tree.parents.tolist() == [0, 0, 0, 1, 1]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2]
    assert tree.candidate_ids.tolist() == [0, 1, 2, 3]
    assert tree.ancestors[4].nonzero().flatten().tolist() == [0, 1, 4]


def test_a_child_never_outranks_its_parent_even_on_exact_ties():
    # A child with log-probability 0 ties its parent's score; the parent must still be kept first.
    tokens = torch.tensor([10, 11, 20])
    scores = torch.tensor([-1.0, -1.0, -1.0])
    parents = torch.tensor([-1, -1, 1])
    depths = torch.tensor([1, 1, 2])
    for _ in range(10):
        tree = build_tree(torch.tensor(5), tokens, scores, parents, depths, total_tokens=2)
        assert tree.depths.tolist() == [0, 1, 1]


def test_chain_is_the_top_k_one_special_case():
    tokens = torch.tensor([10, 20, 30])
    tree = build_tree(torch.tensor(5), tokens, torch.tensor([-0.1, -0.2, -0.4]), torch.tensor([-1, 0, 1]),
                      torch.tensor([1, 2, 3]), total_tokens=8)
    assert tree.parents.tolist() == [0, 0, 1, 2] and tree.depths.tolist() == [0, 1, 2, 3]
    assert tree.ancestors.int().tril().equal(torch.ones(4, 4, dtype=torch.int).tril())


def test_tree_attention_mask_is_additive_over_prefix_and_ancestors():
    ancestors = ancestor_matrix(torch.tensor([0, 0, 0]), max_depth=1)
    mask = tree_attention_mask(ancestors, torch.tensor([True, False]), torch.float32)
    assert mask.shape == (1, 1, 3, 5)
    visible = mask[0, 0] == 0
    assert visible.tolist() == [
        [True, False, True, False, False],
        [True, False, True, True, False],
        [True, False, True, False, True],
    ]
    assert mask[0, 0, 0, 1] == torch.finfo(torch.float32).min


def test_tree_attention_mask_applies_a_sliding_window_by_sequence_index():
    # prefix of 4 (index 0 hidden: padding), root at index 4, a chain root -> 1 -> 2 at indices 5 and 6; window 3
    parents = torch.tensor([0, 0, 1])
    mask = tree_attention_mask(ancestor_matrix(parents, max_depth=2), torch.tensor([False, True, True, True]),
                               torch.float32, depths=torch.tensor([0, 1, 2]), sliding_window=3)
    visible = (mask[0, 0] == 0).int().tolist()
    assert visible == [
        [0, 0, 1, 1, 1, 0, 0],  # index 4 sees 2, 3 and itself
        [0, 0, 0, 1, 1, 1, 0],  # index 5 sees 3, 4, 5
        [0, 0, 0, 0, 1, 1, 1],  # index 6 sees 4, 5, 6
    ]


def test_tree_attention_mask_of_a_batch_measures_the_window_in_each_rows_positions():
    # two rows, one chain root -> 1 each, window 2; row 1's prefix holds a hidden entry between positions 1 and 2
    ancestors = ancestor_matrix(torch.tensor([0, 0]), max_depth=1).expand(2, -1, -1)
    prefix_visible = torch.tensor([[True, True, True, True], [True, True, False, True]])
    key_positions = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 9, 2, 3, 4]])  # prefix entries, then the two nodes
    mask = tree_attention_mask(ancestors, prefix_visible, torch.float32, sliding_window=2, key_positions=key_positions)
    assert mask.shape == (2, 1, 2, 6)
    visible = (mask[:, 0] == 0).int().tolist()
    assert visible[0] == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]]  # by sequence index, as for one row
    assert visible[1] == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]]  # position 2 is index 3: the hidden entry skipped
