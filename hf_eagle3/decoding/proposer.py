"""What the decoding loop asks of a batch's source of candidates (`Proposer`), and the EAGLE-3 one.

As transformers' `CandidateGenerator` names `get_candidates` / `update_candidate_strategy`, a proposer is asked for
every row's tree to verify (`propose`) and told what the target verified (`accepted`). `Eagle3Proposer` drafts the
trees with the EAGLE-3 draft (`Eagle3Drafter`, one forward per tree level for all rows) and merges each row's context
n-gram continuation into its tree (`ngram`), learning how often continuations of each match length are accepted.
`PlainProposer` proposes no candidate: verifying its trees is one plain decoding step (where a call tries plain
decoding for a few cycles, or found its tree slower than plain decoding, `online`: its EAGLE-3 proposer paused).

What a proposer reads on the host (the continuation's search, its acceptance rates) comes from the tokens the loop
read back anyway (`Emitted`): proposing and feeding never wait on the device.
"""

from dataclasses import dataclass
from typing import Protocol

import torch

from ..modeling_eagle3 import Eagle3DraftModel
from .drafter import DraftProposal, Eagle3Drafter, TreeSettings
from .ngram import ContextIndex, ContinuationAcceptance
from .static_draft import StaticDraft
from .tree import root_only


@dataclass
class Verified:
    """Positions the target verified, for every row: their positions `[b, m]`, the target's features there
    `[b, m, 3 k_t]`, the token after each `[b, m]` (the next prompt token, or the token the target emitted) and which
    of them each row feeds (`fed` `[b, m]` bool: left padding, the tail of a shorter accepted path, are not fed)."""

    positions: torch.Tensor
    features: torch.Tensor
    next_tokens: torch.Tensor
    fed: torch.Tensor

    def select(self, rows: torch.Tensor) -> "Verified":
        return Verified(self.positions[rows], self.features[rows], self.next_tokens[rows], self.fed[rows])


@dataclass
class Emitted:
    """What each row's cycle emitted, read back to the host: its new tokens, and of its tree's context continuation
    the tokens the tree held (`continuation_kept`) and those accepted (`continuation_accepted`)."""

    tokens: list[list[int]]
    continuation_kept: list[int]
    continuation_accepted: list[int]

    def select(self, rows: list[int]) -> "Emitted":
        return Emitted([self.tokens[i] for i in rows], [self.continuation_kept[i] for i in rows],
                       [self.continuation_accepted[i] for i in rows])


class Proposer(Protocol):
    def propose(self, root_tokens: torch.Tensor, root_positions: torch.Tensor) -> DraftProposal:
        """Every row's tree to verify below its last token (`root_tokens` `[b]`), which sits at `root_positions`."""

    def accepted(self, verified: Verified, emitted: Emitted | None = None) -> None:
        """The target verified `verified`: the prompts (no `emitted`), or the accepted paths of the last proposal."""

    def select(self, rows: torch.Tensor, host_rows: list[int]) -> None:
        """Keep the rows `rows` (the same indices on the device and the host) only."""


class Eagle3Proposer:
    """The EAGLE-3 draft's trees for a batch of sequences, with their context n-gram continuations when
    `ngram_candidates`; `contexts` are the rows' tokens so far, from where each row's context begins (left padding is
    no context). With `static`, the draft's forwards keep fixed shapes (a call whose forwards are compiled)."""

    def __init__(self, draft: Eagle3DraftModel, settings: TreeSettings, sampling_temperature: float | None,
                 ngram_candidates: bool, contexts: list[list[int]], static: StaticDraft | None = None):
        self.drafter = Eagle3Drafter(draft, settings, sampling_temperature, static)
        self.max_match, self.max_continuation = draft.config.ngram_max_match, draft.config.ngram_max_tokens
        self.contexts = [ContextIndex(self.max_match, tokens) for tokens in contexts] if ngram_candidates else None
        self.continuation_acceptance = [ContinuationAcceptance.prior(self.max_match)] * len(contexts)
        self.matches = [0] * len(contexts)  # each row's n-gram match behind this cycle's continuation (0: none)

    def propose(self, root_tokens: torch.Tensor, root_positions: torch.Tensor) -> DraftProposal:
        if self.contexts is None:
            return self.drafter.draft_tree(root_tokens, root_positions)
        continuation, log_rates = self._continuations(root_tokens.device)
        return self.drafter.draft_tree(root_tokens, root_positions, continuation, log_rates)

    def _continuations(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's continuation `[b, M]` (-1 past its end) and its positions' log acceptance rates (`-inf` there),
        found on the host and sent to `device` without waiting."""
        width = self.max_continuation
        tokens, rates = [], []
        for row, context in enumerate(self.contexts):
            continuation, self.matches[row] = context.find(width)
            row_rates = self.continuation_acceptance[row].log_rates(self.matches[row], len(continuation))
            padding = width - len(continuation)
            tokens.append(continuation + [-1] * padding)
            rates.append(row_rates + [-float("inf")] * padding)
        return to_device(torch.tensor(tokens), device), to_device(torch.tensor(rates), device)

    def accepted(self, verified: Verified, emitted: Emitted | None = None) -> None:
        if emitted is not None and self.contexts is not None:
            for row, context in enumerate(self.contexts):
                context.extend(emitted.tokens[row])
                if self.matches[row]:
                    self.continuation_acceptance[row] = self.continuation_acceptance[row].updated(
                        self.matches[row], emitted.continuation_kept[row], emitted.continuation_accepted[row])
        self.drafter.extend(verified.next_tokens, verified.features, verified.positions, verified.fed)

    def select(self, rows: torch.Tensor, host_rows: list[int]) -> None:
        self.drafter.select(rows)
        if self.contexts is not None:
            self.contexts = [self.contexts[i] for i in host_rows]
        self.continuation_acceptance = [self.continuation_acceptance[i] for i in host_rows]
        self.matches = [self.matches[i] for i in host_rows]


class PlainProposer:
    """No candidates: every tree is its root alone, and verifying them is one plain decoding step. It stands in for
    the `paused` proposer of a call that decodes plainly for a while and may go back to it: what the target verifies
    meanwhile is kept, and told to the paused proposer in one go when it resumes (`resumed`)."""

    def __init__(self, paused: Proposer):
        self.paused = paused
        self.pending: list[tuple[Verified, Emitted]] = []

    def propose(self, root_tokens: torch.Tensor, root_positions: torch.Tensor) -> DraftProposal:
        empty = root_tokens.new_zeros(root_tokens.shape[0], 0)
        return DraftProposal(root_only(root_tokens), None, None, empty)

    def accepted(self, verified: Verified, emitted: Emitted | None = None) -> None:
        self.pending.append((verified, emitted))

    def select(self, rows: torch.Tensor, host_rows: list[int]) -> None:
        self.paused.select(rows, host_rows)
        self.pending = [(verified.select(rows), emitted.select(host_rows)) for verified, emitted in self.pending]

    def resumed(self) -> Proposer:
        """The paused proposer, told what the target verified since it was paused (one draft forward)."""
        if self.pending:
            pending, self.pending = self.pending, []
            verified = Verified(*(torch.cat([getattr(v, name) for v, _ in pending], dim=1)
                                  for name in ("positions", "features", "next_tokens", "fed")))
            rows = len(pending[0][1].tokens)
            emitted = Emitted([sum((e.tokens[row] for _, e in pending), []) for row in range(rows)], [0] * rows,
                              [0] * rows)
            self.paused.accepted(verified, emitted)
        return self.paused


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`, without waiting for the device: through pinned memory on CUDA."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
