"""What the decoding loop asks of a row's source of candidates (`Proposer`), and the EAGLE-3 one.

As transformers' `CandidateGenerator` names `get_candidates` / `update_candidate_strategy`, a proposer is asked for
a tree to verify (`propose`) and told what the target verified (`accepted`). `Eagle3Proposer` drafts the tree with
the EAGLE-3 draft (`Eagle3Drafter`) and merges the context's n-gram continuation into it (`ngram`), learning how
often continuations of each match length are accepted. `PlainProposer` proposes no candidate: verifying its tree is
one plain decoding step (where a call tries plain decoding for a few cycles, or found its tree slower than plain
decoding, `online`: its EAGLE-3 proposer paused).
"""

from dataclasses import dataclass
from typing import Protocol

import torch

from ..modeling_eagle3 import Eagle3DraftModel
from .drafter import DraftProposal, Eagle3Drafter, TreeSettings
from .ngram import ContinuationAcceptance, find_continuation
from .tree import DraftTree


@dataclass
class Verified:
    """Positions the target verified: their positions `[m]`, the target's features there `[m, 3 k_t]` and the token
    after each `[m]` (the next prompt token, or the token the target emitted)."""

    positions: torch.Tensor
    features: torch.Tensor
    next_tokens: torch.Tensor


class Proposer(Protocol):
    def propose(self, tokens: torch.Tensor, root_position: int) -> DraftProposal:
        """A tree to verify below the last of `tokens` (the row's sequence so far), which sits at `root_position`."""

    def accepted(self, verified: Verified, proposal: DraftProposal | None = None,
                 path: torch.Tensor | None = None) -> None:
        """The target verified `verified`: the prompt (no proposal), or the nodes `path` of `proposal`'s tree."""


def continuation_tokens(proposal: DraftProposal, path: torch.Tensor) -> int:
    """How many of the accepted `path`'s drafted tokens the context continuation proposed (a prefix of it)."""
    if not proposal.continuation_nodes.numel():
        return 0
    return int((proposal.continuation_nodes[:, None] == path[None, :]).any(-1).sum())


class Eagle3Proposer:
    """The EAGLE-3 draft's trees for one sequence, with its context n-gram continuations when `ngram_candidates`;
    `context_start` is where the sequence's context begins (left padding is no context)."""

    def __init__(self, draft: Eagle3DraftModel, settings: TreeSettings, sampling_temperature: float | None,
                 ngram_candidates: bool, context_start: int = 0):
        self.drafter = Eagle3Drafter(draft, settings, sampling_temperature)
        self.ngram_candidates = ngram_candidates
        self.max_match, self.max_continuation = draft.config.ngram_max_match, draft.config.ngram_max_tokens
        self.continuation_acceptance = ContinuationAcceptance.prior(self.max_match)
        self.context_start = context_start
        self.match = 0  # length of the n-gram match behind this cycle's context continuation (0: none)

    def propose(self, tokens: torch.Tensor, root_position: int) -> DraftProposal:
        continuation, self.match = (
            find_continuation(tokens[self.context_start :], self.max_match, self.max_continuation)
            if self.ngram_candidates else (None, 0)
        )
        log_rates = (
            self.continuation_acceptance.log_rates(self.match, continuation.numel(), continuation.device)
            if self.match else None
        )
        return self.drafter.draft_tree(tokens[-1], root_position, continuation, log_rates)

    def accepted(self, verified: Verified, proposal: DraftProposal | None = None,
                 path: torch.Tensor | None = None) -> None:
        if proposal is not None and self.match:
            self.continuation_acceptance = self.continuation_acceptance.updated(
                self.match, proposal.continuation_nodes.numel(), continuation_tokens(proposal, path)
            )
        self.drafter.extend(verified.next_tokens[None], verified.features[None], verified.positions[None])


class PlainProposer:
    """No candidates: the tree is the root alone, and verifying it is one plain decoding step. It stands in for the
    `paused` proposer of a call that decodes plainly for a while and may go back to it: what the target verifies
    meanwhile is kept, and told to the paused proposer in one go when it resumes (`resumed`)."""

    def __init__(self, paused: Proposer):
        self.paused = paused
        self.pending: list[Verified] = []

    def propose(self, tokens: torch.Tensor, root_position: int) -> DraftProposal:
        root, empty = tokens[-1:], tokens.new_zeros(0)
        tree = DraftTree(tokens=root, parents=empty.new_zeros(1), depths=empty.new_zeros(1),
                         ancestors=torch.ones(1, 1, dtype=torch.bool, device=root.device), candidate_ids=empty,
                         candidate_rank_keys=torch.zeros(0, dtype=torch.float64, device=root.device),
                         candidate_depths=empty)
        return DraftProposal(tree, None, None, empty)

    def accepted(self, verified: Verified, proposal: DraftProposal | None = None,
                 path: torch.Tensor | None = None) -> None:
        self.pending.append(verified)

    def resumed(self) -> Proposer:
        """The paused proposer, told what the target verified since it was paused (one draft forward)."""
        if self.pending:
            pending, self.pending = self.pending, []
            self.paused.accepted(Verified(torch.cat([verified.positions for verified in pending]),
                                          torch.cat([verified.features for verified in pending]),
                                          torch.cat([verified.next_tokens for verified in pending])))
        return self.paused
