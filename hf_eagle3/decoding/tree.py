"""EAGLE-2 dynamic draft trees as plain tensors: expansion, reranking, attention masks.

A drafting cycle grows candidates depth by depth. At each depth the *frontier* (the `top_k` best candidates of the
previous depth by cumulative draft log-probability) is expanded by its `top_k` most likely children; all expanded
children are kept as candidates. Reranking then keeps the `total_tokens` best candidates overall. Because a child's
score is its parent's score plus a log-probability (<= 0), the kept set is closed under taking parents, so it is a
tree. Candidates are numbered parents before children (the draft's depth by depth; `ngram` appends a continuation's
own after them), and the tree orders its nodes by depth, then by candidate number.

Node 0 of a `DraftTree` is the root: the last token the target produced, not yet verified by the target itself.
"""

from dataclasses import dataclass

import torch

# Tie-break (in float64) so that a parent always outranks its children, even when a child's log-probability rounds
# to 0 in float32; far below any float32 score difference, so it never reorders distinct scores.
_DEPTH_PENALTY = 1e-9


@dataclass
class DraftTree:
    """Root plus `N` drafted nodes of each of a batch's rows, ordered by depth (so every parent comes before its
    children). Every tensor has the rows as its leading dimension (`[b, ...]`); `row(i)` is row `i`'s tree alone,
    with the same fields and no batch dimension. `max_depth` bounds the depths statically (no node is deeper): what
    loops over the tree's levels run to, so that no loop bound is read from the device."""

    tokens: torch.Tensor  # [b, N + 1] target-vocabulary ids, root first
    parents: torch.Tensor  # [b, N + 1] index of each node's parent; the root is its own parent (0)
    depths: torch.Tensor  # [b, N + 1] distance from the root (root 0)
    ancestors: torch.Tensor  # [b, N + 1, N + 1] bool, ancestors[., i, j]: node j is node i or one of its ancestors
    candidate_ids: torch.Tensor  # [b, N] index of each drafted node among the cycle's candidates
    candidate_rank_keys: torch.Tensor  # [b, C] float64 ranking of all the cycle's candidates (kept: the N highest)
    candidate_depths: torch.Tensor  # [b, C] depth of every candidate
    max_depth: int

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[-1]

    def row(self, index: int) -> "DraftTree":
        """Row `index`'s tree (views, no batch dimension)."""
        return DraftTree(self.tokens[index], self.parents[index], self.depths[index], self.ancestors[index],
                         self.candidate_ids[index], self.candidate_rank_keys[index], self.candidate_depths[index],
                         self.max_depth)

    def select(self, rows: torch.Tensor) -> "DraftTree":
        """The trees of the rows `rows` (`[b']` indices)."""
        return DraftTree(self.tokens[rows], self.parents[rows], self.depths[rows], self.ancestors[rows],
                         self.candidate_ids[rows], self.candidate_rank_keys[rows], self.candidate_depths[rows],
                         self.max_depth)


def root_only(root_tokens: torch.Tensor) -> DraftTree:
    """The trees of `[b]` roots without drafted nodes: verifying them is one plain decoding step."""
    batch, device = root_tokens.shape[0], root_tokens.device
    zeros = torch.zeros(batch, 1, dtype=torch.long, device=device)
    return DraftTree(root_tokens[:, None], zeros, zeros, torch.ones(batch, 1, 1, dtype=torch.bool, device=device),
                     zeros[:, :0], torch.zeros(batch, 0, dtype=torch.float64, device=device), zeros[:, :0], 0)


def expand(log_probs: torch.Tensor, frontier_scores: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best `top_k` children of every frontier node.

    Args:
        log_probs: `[..., F, V_d]` draft log-probabilities of the next token after each frontier node.
        frontier_scores: `[..., F]` cumulative log-probability of each frontier node (0 for the root).
    Returns:
        `(scores, token_ids)`, both `[..., F, top_k]`: cumulative child scores and draft-vocabulary ids, best first.
    """
    child_log_probs, token_ids = log_probs.topk(top_k, dim=-1)
    return frontier_scores[..., None] + child_log_probs, token_ids


def select_frontier(child_scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Flat indices (into `child_scores.flatten(-2)`, `[..., F, k]`) of the `top_k` best children: the next
    frontier, best first."""
    flat = child_scores.flatten(-2)
    return flat.topk(min(top_k, flat.shape[-1]), dim=-1).indices


def ancestor_matrix(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """`[..., n, n]` bool matrix, `[., i, j]` true when `j` is `i` or an ancestor of `i`, from `parents` (`[..., n]`,
    root self) of trees no deeper than `max_depth`."""
    num_nodes = parents.shape[-1]
    walk = torch.arange(num_nodes, device=parents.device).expand_as(parents)
    ancestors = torch.zeros(*parents.shape, num_nodes, dtype=torch.bool, device=parents.device)
    ancestors.scatter_(-1, walk[..., None], True)
    for _ in range(max_depth):
        walk = parents.gather(-1, walk)
        ancestors.scatter_(-1, walk[..., None], True)
    return ancestors


def node_paths(tree: DraftTree, nodes: torch.Tensor | None = None) -> torch.Tensor:
    """`[b, M, W]` the path from the root to each of `nodes` (`[b, M]`; default every node, `M = N + 1`): its node
    indices, root first, the node itself repeated past its depth (`W = min(N + 1, max_depth + 1)`: a fixed shape)."""
    indices = torch.arange(tree.num_nodes, device=tree.tokens.device)
    if nodes is None:
        nodes, ancestors = indices.expand(tree.tokens.shape[0], -1), tree.ancestors
    else:  # only their rows of the ancestor matrix
        ancestors = tree.ancestors.gather(1, nodes[..., None].expand(-1, -1, tree.num_nodes))
    # nodes are ordered by depth, so a path's nodes in index order are in root-to-node order
    ordered = torch.where(ancestors, indices, tree.num_nodes).sort(-1).values[..., : tree.max_depth + 1]
    return torch.where(ordered < tree.num_nodes, ordered, nodes[..., None])


def build_tree(
    root_token: torch.Tensor,
    candidate_tokens: torch.Tensor,
    candidate_scores: torch.Tensor,
    candidate_parents: torch.Tensor,
    candidate_depths: torch.Tensor,
    total_tokens: int,
    max_depth: int | None = None,
) -> DraftTree:
    """Keep the `total_tokens` best candidates of each row and arrange them, under its root, as a `DraftTree`.

    Args:
        root_token: `[b]` target id of each row's root (or `[]` for one tree without a batch dimension, as are then
            the candidates').
        candidate_tokens: `[b, C]` target ids of all candidates of the cycle, numbered parents before children.
        candidate_scores: `[b, C]` cumulative draft log-probabilities.
        candidate_parents: `[b, C]` candidate index of each candidate's parent, -1 for children of the root.
        candidate_depths: `[b, C]` depth of each candidate (1 for children of the root).
        total_tokens: how many candidates to keep.
        max_depth: no candidate is deeper (default: `C`, a bound that needs no reading of the depths).
    """
    if root_token.dim() == 0:
        return build_tree(root_token[None], candidate_tokens[None], candidate_scores[None], candidate_parents[None],
                          candidate_depths[None], total_tokens, max_depth).row(0)
    batch, num_candidates = candidate_tokens.shape
    max_depth = num_candidates if max_depth is None else max_depth
    num_kept = min(total_tokens, num_candidates)
    rank_keys = candidate_scores.double() - _DEPTH_PENALTY * candidate_depths
    kept = rank_keys.topk(num_kept, dim=-1).indices
    kept = kept.gather(-1, (candidate_depths.gather(-1, kept) * num_candidates + kept).argsort(-1))  # by depth, index

    # Node index of every kept candidate (root = node 0, kept[i] = node i + 1); -1 (root's children) maps to 0.
    node_of_candidate = torch.zeros(batch, num_candidates + 1, dtype=torch.long, device=kept.device)
    node_of_candidate.scatter_(-1, kept + 1, torch.arange(1, num_kept + 1, device=kept.device).expand(batch, -1))
    root_column = kept.new_zeros(batch, 1)
    parents = torch.cat([root_column, node_of_candidate.gather(-1, candidate_parents.gather(-1, kept) + 1)], dim=-1)
    depths = torch.cat([root_column, candidate_depths.gather(-1, kept)], dim=-1)
    tokens = torch.cat([root_token[:, None], candidate_tokens.gather(-1, kept)], dim=-1)
    return DraftTree(tokens, parents, depths, ancestor_matrix(parents, max_depth), kept, rank_keys, candidate_depths,
                     max_depth)


def tree_attention_mask(
    ancestors: torch.Tensor,
    prefix_visible: torch.Tensor,
    dtype: torch.dtype,
    depths: torch.Tensor | None = None,
    sliding_window: int | None = None,
    key_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Additive `[B, 1, n, P + n]` mask: every node sees its row's visible prefix and its own ancestors.

    `ancestors` is `[n, n]` for one tree (`B = 1`, with `prefix_visible` `[P]` bool) or `[B, n, n]` for one tree per
    row of a batch (with `prefix_visible` `[B, P]`).

    With a `sliding_window`, a node also sees only keys fewer than `sliding_window` positions behind it, as
    transformers' sliding-window masks do. The keys' positions are `key_positions` (`[B, P + n]`: the prefix's cache
    entries, then the nodes), or else their sequence indices, node `i` sitting at index `P + depths[i]`.
    The float form (0 = attend, dtype minimum = masked) is read the same way by eager, sdpa and flex attention.
    """
    ancestors = ancestors if ancestors.dim() == 3 else ancestors[None]
    prefix_visible = prefix_visible if prefix_visible.dim() == 2 else prefix_visible[None]
    num_nodes, prefix_length = ancestors.shape[-1], prefix_visible.shape[-1]
    visible = torch.cat([prefix_visible[:, None, :].expand(-1, num_nodes, -1), ancestors], dim=-1)  # [B, n, P + n]
    if sliding_window is not None:
        if key_positions is None:
            prefix_indices = torch.arange(prefix_length, device=depths.device)
            key_positions = torch.cat([prefix_indices, prefix_length + depths])[None]
        query_positions = key_positions[:, prefix_length:]  # [B, n]
        visible = visible & (query_positions[:, :, None] - key_positions[:, None, :] < sliding_window)
    # built in `dtype`: a float32 minimum would not hold float64's
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill(~visible, torch.finfo(dtype).min)[:, None]
