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


def find_continuation(tokens: torch.Tensor, max_match: int, max_tokens: int) -> tuple[torch.Tensor, int]:
    """The tokens that followed the most recent earlier occurrence of the longest suffix of `tokens` (`[L]`) of at
    most `max_match` tokens, at most `max_tokens` of them; `(continuation [m], match length)`, `m = 0` when no
    suffix of one token or more occurs earlier."""
    length = tokens.numel()
    for size in range(min(max_match, length - 1), 0, -1):
        windows = tokens[: length - 1].unfold(0, size, 1)  # every earlier window that has a token after it
        starts = (windows == tokens[length - size :]).all(-1).nonzero()
        if starts.numel():
            start = int(starts[-1]) + size
            return tokens[start : start + max_tokens], size
    return tokens[:0], 0


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

    def log_rates(self, match: int, length: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """`[length]` log acceptance rates of the positions of a continuation found by a `match`-token match."""
        accepted, proposed = self.accepted[match - 1], self.proposed[match - 1]
        last = _RATE_POSITIONS - 1
        rates = [math.log(accepted[min(j, last)] / proposed[min(j, last)]) for j in range(length)]
        return torch.tensor(rates, device=device)

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
    """Merge a continuation into a cycle's draft candidates (the arguments of `tree.build_tree`).

    Args:
        tokens, scores, parents, depths: `[C]` the draft's candidates (target ids, cumulative log-probabilities,
            parent candidate index or -1 for the root's children, depth), parents before children.
        continuation: `[m]` target ids proposed after the root.
        log_rates: `[m]` log acceptance rate of each continuation position given the ones before it.
    Returns:
        The merged candidates `(tokens, scores, parents, depths)`, still numbered parents before children, and `[m]`
        the candidate index holding each continuation token.
    """
    scores = scores.clone()
    parent, parent_score = -1, 0.0
    chain = []
    for position in range(continuation.numel()):
        same = ((parents == parent) & (tokens == continuation[position])).nonzero()
        if same.numel() == 0:  # the rest hangs below `parent` as new candidates
            rest = continuation[position:]
            new_scores = (parent_score + log_rates[position:].cumsum(0)).to(scores.dtype)
            first = tokens.numel()
            new_ids = torch.arange(first, first + rest.numel(), device=tokens.device)
            new_parents = torch.cat([new_ids.new_full((1,), parent), new_ids[:-1]])
            new_depths = position + 1 + torch.arange(rest.numel(), device=tokens.device)
            return (
                torch.cat([tokens, rest]),
                torch.cat([scores, new_scores]),
                torch.cat([parents, new_parents]),
                torch.cat([depths, new_depths.to(depths.dtype)]),
                torch.cat([tokens.new_tensor(chain), new_ids]),
            )
        parent = int(same[0])
        parent_score = max(float(scores[parent]), parent_score + float(log_rates[position]))
        scores[parent] = parent_score
        chain.append(parent)
    return tokens, scores, parents, depths, tokens.new_tensor(chain)


__all__ = ["ContinuationAcceptance", "find_continuation", "merge_continuation"]
