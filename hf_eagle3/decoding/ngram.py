"""Context n-gram candidates inside the EAGLE-3 tree, as plain functions.

Prompt lookup (arXiv:2304.04487; transformers' `prompt_lookup_num_tokens`) proposes, after the latest `n` tokens, the
tokens that followed their most recent earlier occurrence in the prompt or the text generated so far. Such a
continuation is often right where the draft is weakest (copied names, code, repeated phrases), so each cycle it is
merged into the draft tree as one more branch:

- the continuation is walked down from the root: while its tokens agree with the draft's own candidates, they *are*
  those candidates (the branch is extended, nothing is duplicated); from the first disagreement on its remaining
  tokens hang below the last agreeing node as new candidates;
- every continuation token gets a score on the draft's scale (a cumulative log-probability of being accepted): its
  parent's score plus the log of the rate at which continuation tokens at its position have been accepted so far in
  this call (`ContinuationAcceptance`, learnt as decoding goes, per match length); a candidate the continuation
  agrees with keeps the larger of its two scores;
- the tree's token budget then keeps the best candidates overall (`tree.build_tree`), so continuation tokens displace
  draft tokens only where they are expected to be accepted more often.

Continuation tokens are deterministic (point-mass) candidates, as the draft's top-k children are, so greedy
verification and both sampling rules in `verify` stay lossless.
"""

import math
from dataclasses import dataclass

import torch

# Continuation positions beyond this share one acceptance rate.
_RATE_POSITIONS = 8


class ContextIndex:
    """The n-grams of one sequence's context, on the host, for `find`: for every n-gram of at most `max_match` tokens,
    where its most recent occurrence with a token after it ends. `extend` indexes the tokens a cycle appended, so a
    cycle's search costs a few dictionary lookups whatever the context's length, and reads nothing from a device."""

    def __init__(self, max_match: int, tokens: list[int] = ()):
        self.max_match = max_match
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence with a follower
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append `tokens` to the context."""
        first_new_end = max(len(self.tokens), 1)
        self.tokens.extend(tokens)
        for end in range(first_new_end, len(self.tokens)):  # windows ending at `end` now have a token after them
            for size in range(1, min(self.max_match, end) + 1):
                self.ends[tuple(self.tokens[end - size : end])] = end

    def find(self, max_tokens: int) -> tuple[list[int], int]:
        """The tokens that followed the most recent earlier occurrence of the context's longest suffix of at most
        `max_match` tokens, at most `max_tokens` of them; `(continuation, match length)`, `([], 0)` when no suffix of
        one token or more occurs earlier."""
        length = len(self.tokens)
        for size in range(min(self.max_match, length - 1), 0, -1):
            end = self.ends.get(tuple(self.tokens[length - size :]))
            if end is not None:
                return self.tokens[end : end + max_tokens], size
        return [], 0


def find_continuation(tokens: list[int], max_match: int, max_tokens: int) -> tuple[list[int], int]:
    """`ContextIndex.find` over `tokens` indexed at once."""
    return ContextIndex(max_match, tokens).find(max_tokens)


@dataclass(frozen=True)
class ContinuationAcceptance:
    """How often continuation tokens were accepted in this call, by match length and position: `accepted[n - 1][j]`
    of `proposed[n - 1][j]` tokens at position `j` (0-based) of a continuation found by an `n`-token match, counted
    only when the tokens before them were accepted. Starts from one accepted of two (a rate of 1/2)."""

    accepted: tuple[tuple[float, ...], ...]
    proposed: tuple[tuple[float, ...], ...]

    @classmethod
    def prior(cls, max_match: int) -> "ContinuationAcceptance":
        return cls(((1.0,) * _RATE_POSITIONS,) * max_match, ((2.0,) * _RATE_POSITIONS,) * max_match)

    def log_rates(self, match: int, length: int) -> list[float]:
        """The `length` log acceptance rates of the positions of a continuation found by a `match`-token match."""
        accepted, proposed = self.accepted[match - 1], self.proposed[match - 1]
        last = _RATE_POSITIONS - 1
        return [math.log(accepted[min(j, last)] / proposed[min(j, last)]) for j in range(length)]

    def updated(self, match: int, kept: int, accepted: int) -> "ContinuationAcceptance":
        """After a cycle that verified the first `kept` continuation tokens of a `match`-token match and accepted the
        first `accepted` of them: each verified position reached (all before it accepted) counts as proposed."""
        if kept == 0:
            return self
        row_accepted, row_proposed = list(self.accepted[match - 1]), list(self.proposed[match - 1])
        for position in range(min(accepted + 1, kept)):
            bucket = min(position, _RATE_POSITIONS - 1)
            row_proposed[bucket] += 1
            row_accepted[bucket] += position < accepted
        return ContinuationAcceptance(
            _with_row(self.accepted, match - 1, row_accepted), _with_row(self.proposed, match - 1, row_proposed)
        )


def _with_row(rows: tuple[tuple[float, ...], ...], index: int, row: list[float]) -> tuple[tuple[float, ...], ...]:
    return rows[:index] + (tuple(row),) + rows[index + 1 :]


def merge_continuation(
    tokens: torch.Tensor,
    scores: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    continuation: torch.Tensor,
    log_rates: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge each row's continuation into its cycle's draft candidates (the arguments of `tree.build_tree`), with
    shapes that do not depend on the data: every row gets `M` more candidates, those a continuation does not need
    (its tokens that are draft candidates already, or past its end) scored `-inf`, so that no tree keeps them.

    Args:
        tokens, scores, parents, depths: `[b, C]` the draft's candidates (target ids, cumulative log-probabilities,
            parent candidate index or -1 for the root's children, depth), parents before children.
        continuation: `[b, M]` target ids proposed after each row's root; -1 past a row's continuation.
        log_rates: `[b, M]` log acceptance rate of each continuation position given the ones before it.
    Returns:
        The merged candidates `(tokens, scores, parents, depths)` `[b, C + M]`, still numbered parents before
        children, and `[b, M]` the candidate index holding each continuation token (past its end: one never kept).
    """
    batch, num_candidates = tokens.shape
    positions = continuation.shape[1]
    scores = scores.clone()
    parent = parents.new_full((batch,), -1)  # the candidate holding the previous continuation token (-1: the root)
    parent_score = scores.new_zeros(batch)
    agreeing = torch.ones(batch, dtype=torch.bool, device=tokens.device)  # every token so far is a draft candidate
    chain, new_scores, new_parents = [], [], []
    for position in range(positions):
        same = (parents == parent[:, None]) & (tokens == continuation[:, position, None])  # [b, C]: at most one
        agreeing = agreeing & same.any(-1)
        candidate = same.int().argmax(-1)
        estimate = parent_score + log_rates[:, position]
        current = scores.gather(-1, candidate[:, None])[:, 0]
        agreed_score = torch.maximum(current, estimate)
        scores.scatter_(-1, candidate[:, None], torch.where(agreeing, agreed_score, current)[:, None])
        new_scores.append(torch.where(agreeing, -torch.inf, estimate))
        new_parents.append(parent)
        parent = torch.where(agreeing, candidate, num_candidates + position)
        parent_score = torch.where(agreeing, agreed_score, estimate)
        chain.append(parent)
    new_depths = torch.arange(1, positions + 1, device=tokens.device).expand(batch, -1)
    return (
        torch.cat([tokens, continuation.clamp_min(0)], dim=-1),
        torch.cat([scores, torch.stack(new_scores, dim=-1).to(scores.dtype)], dim=-1),
        torch.cat([parents, torch.stack(new_parents, dim=-1)], dim=-1),
        torch.cat([depths, new_depths.to(depths.dtype)], dim=-1),
        torch.stack(chain, dim=-1),
    )


__all__ = ["ContextIndex", "ContinuationAcceptance", "find_continuation", "merge_continuation"]
