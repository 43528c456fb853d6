"""Acceptance rules for verifying a draft tree against the target, as plain tensor functions.

Greedy: the accepted path is the longest root-to-node path whose every token is the target's argmax after its
parent; the target's argmax after the last accepted node is the bonus token. The output equals plain greedy decoding.

Sampling, both rules lossless (the emitted token is distributed exactly as the target's processed distribution `p`):
- `accept_among_children` (tree, deterministic top-k candidates): the children `x_1..x_m` of a node are tried in
  order; `x_i` is accepted with probability `p'(x_i)`, where `p'` is `p` with the rejected `x_1..x_{i-1}` removed and
  renormalised. If all are rejected, the bonus token is drawn from `p` without any of them. This is speculative
  sampling with each candidate's draft distribution a point mass, which is what top-k drafting really is.
- `accept_sampled` (chain whose tokens were sampled from draft distributions `q`): the standard rule, accept `x` with
  probability `min(1, p(x) / q(x))`, else draw from `normalise(max(p - q, 0))`.
- `accept_in_turn` (children of mixed origin: a sampled chain child next to a context continuation's token): the
  children are tried in order, each by the rule of its own proposal (`q`, or a point mass), each against what is left
  of `p` after the rejections before it. This is multi-draft speculative sampling with independent proposals.

`accept_argmax` (greedy, raw logits) and `accept_walk` (a walk down the tree by a rule: `greedy_pick`,
`sampling_pick`, over the target's processed scores: `processed_scores`) verify a whole tree.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .tree import DraftTree


def greedy_accept(tree: DraftTree, target_choices: torch.Tensor) -> torch.Tensor:
    """Node indices of the accepted path, root first.

    Args:
        tree: the verified tree.
        target_choices: `[N + 1]` the target's greedy token after each node.
    Returns:
        `[m]` node indices (root first). The bonus token is `target_choices[path[-1]]`.
    """
    token_matches = tree.tokens == target_choices[tree.parents]  # [N + 1]
    token_matches[0] = True
    path_matches = ~(tree.ancestors & ~token_matches[None, :]).any(dim=-1)  # every node on the path matches
    deepest = torch.where(path_matches, tree.depths, -1).argmax()
    return tree.ancestors[deepest].nonzero().squeeze(-1)


def children(tree: DraftTree, node: int) -> torch.Tensor:
    """`[m]` indices of the children of `node`, in drafting order (most likely under the draft first)."""
    child_mask = tree.parents == node
    child_mask[node] = False  # the root is its own parent
    return child_mask.nonzero().squeeze(-1)


def accept_among_children(
    target_probs: torch.Tensor, child_tokens: torch.Tensor, uniforms: torch.Tensor
) -> tuple[int, torch.Tensor]:
    """Try deterministic candidates in order against the target distribution, renormalising after each rejection.

    Args:
        target_probs: `[V]` the target's processed next-token distribution.
        child_tokens: `[m]` distinct candidate tokens, in the order they are tried.
        uniforms: `[m]` independent U(0, 1) draws.
    Returns:
        `(index, residual)`: the position in `child_tokens` of the accepted candidate, or -1 when all are rejected,
        and the distribution to draw the bonus token from in that case (`[V]`).
    """
    child_probs = target_probs[child_tokens]
    mass_left = 1.0 - (child_probs.cumsum(0) - child_probs)  # mass of p not yet rejected before each candidate
    accepted = uniforms * mass_left < child_probs
    if accepted.any():
        return int(accepted.int().argmax()), target_probs
    residual = target_probs.clone()
    residual[child_tokens] = 0.0
    return -1, _normalise(residual, fallback=target_probs)


def accept_sampled(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, token: int, uniform: float
) -> tuple[bool, torch.Tensor]:
    """Standard speculative sampling for a token drawn from `draft_probs` (`[V]` each).

    Returns `(accepted, residual)`, residual being the distribution of the replacement token when rejected.
    """
    if uniform * draft_probs[token] < target_probs[token]:
        return True, target_probs
    return False, _normalise((target_probs - draft_probs).clamp_min(0.0), fallback=target_probs)


def accept_in_turn(
    target_probs: torch.Tensor,
    child_tokens: torch.Tensor,
    child_draft_probs: list[torch.Tensor | None],
    uniforms: torch.Tensor,
) -> tuple[int, torch.Tensor]:
    """Try candidates in order, each drawn from its own proposal: `child_draft_probs[i]` (`[V]`), or `None` for a
    deterministic candidate (a point mass). Returns `(index, residual)` as `accept_among_children` does."""
    probs = target_probs
    for index, (token, draft_probs) in enumerate(zip(child_tokens.tolist(), child_draft_probs)):
        if draft_probs is None:
            accepted, probs = accept_among_children(probs, child_tokens[index : index + 1], uniforms[index : index + 1])
            accepted = accepted == 0
        else:
            accepted, probs = accept_sampled(probs, draft_probs, token, float(uniforms[index]))
        if accepted:
            return index, target_probs
    return -1, probs


@dataclass
class Acceptance:
    """What verifying one tree decided: the accepted node indices `path` (`[m]`, root first), the `bonus` token
    (`[1]`, the target's own after the path) and the processed `scores` (`[m, V]`) that chose the `m` emitted tokens
    (the path's drafted tokens, then the bonus)."""

    path: torch.Tensor
    bonus: torch.Tensor
    scores: torch.Tensor


# `scores_after(path)`: the target's processed scores `[V]` after the last node of `path` (node indices, root first)
ScoresAfter = Callable[[list[int]], torch.Tensor]
# `pick(scores, child_nodes)`: the accepted child's node index and `None`, or `None` and the bonus token `[1]`
Pick = Callable[[torch.Tensor, torch.Tensor], tuple[int | None, torch.Tensor | None]]


def accept_argmax(tree: DraftTree, logits: torch.Tensor) -> Acceptance:
    """Greedy verification over the target's raw logits `[N + 1, V]` at the tree's nodes (no logits processors)."""
    # `max(-1).indices` is argmax with the same first-index tie rule, several times faster on bf16 CPU tensors
    target_choices = logits.max(-1).indices  # [N + 1]
    path = greedy_accept(tree, target_choices)
    return Acceptance(path, target_choices[path[-1], None], logits[path].float())


def accept_walk(tree: DraftTree, scores_after: ScoresAfter, pick: Pick) -> Acceptance:
    """Walk down from the root, at each node accepting the child `pick` chooses, until it chooses the bonus token."""
    path, path_scores = [0], []
    while True:
        scores = scores_after(path)
        path_scores.append(scores)
        child, bonus = pick(scores, children(tree, path[-1]))
        if child is None:
            return Acceptance(torch.tensor(path, device=scores.device), bonus, torch.stack(path_scores))
        path.append(child)


def greedy_pick(tree: DraftTree) -> Pick:
    """The child holding the target's argmax, else the argmax as the bonus token."""

    def pick(scores: torch.Tensor, child_nodes: torch.Tensor):
        choice = scores.argmax(-1, keepdim=True)
        matching = child_nodes[tree.tokens[child_nodes] == choice]
        return (int(matching[0]), None) if matching.numel() else (None, choice)

    return pick


def sampling_pick(tree: DraftTree, draft_probs: torch.Tensor | None = None, sampled: torch.Tensor | None = None,
                  draft_to_target: torch.Tensor | None = None) -> Pick:
    """Speculative sampling among a node's children: deterministic candidates (`accept_among_children`), or, for a
    sampled chain (`draft_probs` `[N + 1, V_d]` over the draft vocabulary, `sampled` `[N + 1]`, mapped to target ids
    by `draft_to_target`), each child by the rule of its own proposal (`accept_in_turn`)."""

    def pick(scores: torch.Tensor, child_nodes: torch.Tensor):
        probs = scores.softmax(-1)
        if child_nodes.numel() == 0:
            return None, torch.multinomial(probs, 1)
        if sampled is None:
            index, residual = accept_among_children(
                probs, tree.tokens[child_nodes], torch.rand(child_nodes.numel(), device=probs.device)
            )
        else:
            proposals = [
                torch.zeros_like(probs).index_add_(0, draft_to_target, draft_probs[child].to(probs.dtype))
                if sampled[child] else None
                for child in child_nodes.tolist()
            ]
            index, residual = accept_in_turn(
                probs, tree.tokens[child_nodes], proposals, torch.rand(child_nodes.numel(), device=probs.device)
            )
        if index >= 0:
            return int(child_nodes[index]), None
        return None, torch.multinomial(residual, 1)

    return pick


def processed_scores(logits_processor, sequence: torch.Tensor, tree: DraftTree, logits: torch.Tensor, row: int = 0,
                     batch_size: int = 1) -> ScoresAfter:
    """The target's processed scores at the tree's nodes exactly as plain decoding would compute them, for row `row`
    of a batch of `batch_size` whose sequence so far is `sequence` (`[1, L]`), from the raw `logits` `[N + 1, V]`.
    Processors may hold per-row state (a left-padded row's prompt length, ...), so the row's prefix goes through them
    at its own index, in a batch of copies of it."""

    def scores_after(path: list[int]) -> torch.Tensor:
        path_tokens = tree.tokens[path[1:]][None]
        prefix = torch.cat([sequence, path_tokens], dim=-1).expand(batch_size, -1)
        node_logits = logits[path[-1]][None].float().repeat(batch_size, 1)
        return logits_processor(prefix, node_logits)[row]

    return scores_after


def _normalise(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = weights.sum()
    # Zero mass left only through float rounding (the rejected candidates held all of p): keep p itself.
    return weights / total if total > 0 else fallback
