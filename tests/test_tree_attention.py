"""Exact tree attention: every node attends over exactly the keys plain decoding would give it (pure tensors)."""

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_eagle3.decoding.exact_attention import KEYWORD, TreeKeyLayout, install
from hf_eagle3.decoding.tree import build_tree, tree_attention_mask

HEADS, KV_HEADS, HEAD_DIM, PREFIX = 6, 2, 16, 37


class _Attention:  # what transformers' sdpa function reads from the attention module
    num_key_value_groups = HEADS // KV_HEADS
    is_causal = True


def _tree():
    """Root, three children of the root (1-3), two children of node 1 (4, 5) and one of node 4 (6)."""
    return build_tree(
        torch.tensor(7),
        candidate_tokens=torch.arange(10, 16),
        candidate_scores=torch.tensor([-0.1, -0.5, -0.9, -0.2, -0.3, -0.4]),
        candidate_parents=torch.tensor([-1, -1, -1, 0, 0, 3]),
        candidate_depths=torch.tensor([1, 1, 1, 2, 2, 3]),
        total_tokens=6,
    )


def test_layout_groups_nodes_by_depth_with_their_paths():
    layout = TreeKeyLayout.of(_tree(), PREFIX)
    assert layout.prefix_length == PREFIX and layout.depth_starts == [0, 1, 4, 6, 7]
    paths = [[[0]], [[0, 1], [0, 2], [0, 3]], [[0, 1, 4], [0, 1, 5]], [[0, 1, 4, 6]]]
    assert [entries.tolist() for entries in layout.path_entries] == [
        [PREFIX + node for path in depth_paths for node in path] for depth_paths in paths
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_node_gets_plain_decodings_attention_bit_for_bit(dtype):
    torch.manual_seed(0)
    tree = _tree()
    nodes = tree.num_nodes
    query = torch.randn(1, HEADS, nodes, HEAD_DIM, dtype=dtype)
    key, value = (torch.randn(1, KV_HEADS, PREFIX + nodes, HEAD_DIM, dtype=dtype) for _ in range(2))
    install()  # as the first exact_attention=True call does
    attention = ALL_ATTENTION_FUNCTIONS["sdpa"]  # what an sdpa target's layers call
    output, _ = attention(_Attention(), query, key, value, None, dropout=0.0, scaling=HEAD_DIM**-0.5,
                          **{KEYWORD: TreeKeyLayout.of(tree, PREFIX)})
    assert output.shape == (1, nodes, HEADS, HEAD_DIM)
    for node in range(nodes):
        # Plain decoding at this node: one query over the prefix and the node's path, in that order, no mask.
        keys = torch.cat([torch.arange(PREFIX), PREFIX + tree.ancestors[node].nonzero()[:, 0]])
        expected = F.scaled_dot_product_attention(
            query[:, :, node : node + 1], key[:, :, keys], value[:, :, keys], scale=HEAD_DIM**-0.5, enable_gqa=True
        )
        assert torch.equal(output[0, node], expected[0, :, 0])
    if dtype == torch.float32:  # and it is the masked tree attention, up to rounding
        mask = tree_attention_mask(tree.ancestors, torch.ones(PREFIX, dtype=torch.bool), dtype)
        masked = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=HEAD_DIM**-0.5, enable_gqa=True
        ).transpose(1, 2)
        torch.testing.assert_close(output, masked)


def test_a_forward_that_passes_no_tree_keys_gets_plain_sdpa():
    torch.manual_seed(0)
    query, key, value = (torch.randn(1, HEADS, 5, HEAD_DIM) for _ in range(3))
    plain, _ = sdpa_attention_forward(_Attention(), query, key, value, None, scaling=0.25)
    registered, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](_Attention(), query, key, value, None, scaling=0.25)
    assert torch.equal(registered, plain)
