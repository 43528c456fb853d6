"""The decoding loop's state: each sequence (`Row`), and the rows the target's cache holds (`BatchState`), in one
index space, the cache's order."""

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache, StaticCache

from ..utils.transformers_api import crop_cache
from .drafter import DraftProposal
from .proposer import Proposer, continuation_tokens
from .stats import Eagle3RowStats


@dataclass(frozen=True)
class Stopping:
    """When rows stop, as plain decoding stops them: `criteria` (the call's stopping criteria), `max_length`, whether
    a stopped row is padded (with an EOS criterion; otherwise plain batched decoding computes a stopped row on, up to
    the longest row) and whether scores and logits are kept for the output."""

    criteria: object
    max_length: int
    pad_stopped_rows: bool
    keep_scores: bool
    keep_logits: bool


@dataclass
class Emission:
    """Tokens `[m]` a row is to emit, with the processed scores and raw logits `[m, V]` that chose them."""

    tokens: torch.Tensor
    scores: torch.Tensor
    logits: torch.Tensor


@dataclass
class Row:
    """One sequence of the batch: row `index` of the call's batch (what logits processors index), its tokens so far
    (left padding included: what plain decoding's stopping criteria and logits processors see), its proposer, its
    statistics, and the length at which the stopping criteria first held."""

    index: int
    tokens: torch.Tensor  # [L]
    proposer: Proposer
    stats: Eagle3RowStats = field(default_factory=Eagle3RowStats)
    stop_length: int | None = None
    scores: list[torch.Tensor] = field(default_factory=list)  # [1, V] per emitted token, with output_scores
    logits: list[torch.Tensor] = field(default_factory=list)  # [1, V] per emitted token, with output_logits

    def emit(self, emission: Emission, stopping: Stopping) -> torch.Tensor:
        """Append the emission's tokens, stopping exactly where plain decoding would: the criteria see each new token's
        prefix in turn. A row that has stopped and decodes on only respects `max_length`. Returns the tokens
        appended."""
        if self.stop_length is not None:
            new_tokens = emission.tokens[: stopping.max_length - self.tokens.numel()]
            self.tokens = torch.cat([self.tokens, new_tokens])
            return new_tokens
        extended, kept = torch.cat([self.tokens, emission.tokens]), self.tokens.numel()
        for token_scores, token_logits in zip(emission.scores, emission.logits):
            kept += 1
            if stopping.keep_scores:
                self.scores.append(token_scores[None])
            if stopping.keep_logits:
                self.logits.append(token_logits[None])
            if stopping.criteria(extended[None, :kept], tuple(self.scores) if stopping.keep_scores else None)[0]:
                self.stop_length = kept
                break
        new_tokens = emission.tokens[: kept - self.tokens.numel()]
        if self.stop_length is not None and self.stats.acceptance_lengths:  # a cut cycle counts the tokens it emitted
            self.stats.acceptance_lengths[-1] = new_tokens.numel()
        self.tokens = extended[:kept]
        return new_tokens

    def record(self, proposal: DraftProposal, path: torch.Tensor, record_cycle: bool) -> None:
        """Count a verified cycle in the row's statistics, unless the row has stopped and decodes on."""
        if self.stop_length is not None:
            return
        self.stats.continuation_tokens += continuation_tokens(proposal, path)
        if proposal.tree.tokens.numel() == 1:  # the root alone: a plain decoding step
            self.stats.plain_cycles.append(len(self.stats.acceptance_lengths))
        self.stats.acceptance_lengths.append(path.numel())  # accepted drafted tokens + the bonus token
        if record_cycle:  # references only: nothing computed on the decoding path
            self.stats.greedy_cycles.append((proposal.tree, path))


def decoding_rows(rows: list[Row], live: list[Row], stopping: Stopping) -> list[int]:
    """Indices into `live` (the rows still in the cache) of those that decode on, given every row of the call."""
    stop_lengths = [row.stop_length for row in rows]
    final_length = max(stop_lengths) if None not in stop_lengths else stopping.max_length
    return [
        index for index, row in enumerate(live)
        if row.stop_length is None
        or (not stopping.pad_stopped_rows and row.tokens.numel() < min(final_length, stopping.max_length))
    ]


@dataclass
class BatchState:
    """The rows the target's `cache` holds, in its order, and for each: which cache entries it sees (`visible`
    `[b, P]`), their positions (`key_positions` `[b, P]`) and the position of its root, its last token, not yet
    cached (`root_positions` `[b]`)."""

    rows: list[Row]
    cache: DynamicCache | StaticCache
    visible: torch.Tensor
    key_positions: torch.Tensor
    root_positions: torch.Tensor

    def select(self, indices: list[int]) -> "BatchState":
        """The state of the rows `indices` only: the others leave the batch and the cache."""
        if len(indices) == len(self.rows):
            return self
        index = torch.tensor(indices, device=self.visible.device)
        self.cache.batch_select_indices(index)
        return BatchState([self.rows[i] for i in indices], self.cache, self.visible[index], self.key_positions[index],
                          self.root_positions[index])

    def advance(self, lengths: torch.Tensor) -> "BatchState":
        """The state after each row kept `lengths[i]` new cache entries from its root on, contiguous after the prefix;
        the cache grew by the longest, and a row that kept fewer hides the rest from now on."""
        offsets = torch.arange(int(lengths.max()), device=lengths.device)
        visible = torch.cat([self.visible, offsets[None] < lengths[:, None]], dim=1)
        key_positions = torch.cat([self.key_positions, self.root_positions[:, None] + offsets], dim=1)
        return BatchState(self.rows, self.cache, visible, key_positions, self.root_positions + lengths)


def keep_cache_entries(cache: DynamicCache | StaticCache, start: int, keep: torch.Tensor) -> None:
    """Of each row's cache entries from `start` on, keep those at offsets `keep[b]` (`[B, M]`, sorted), moved to be
    contiguous; where a row keeps fewer than `M`, its `keep` repeats any offset (the row's mask hides those). A static
    cache's tensors are updated in place (a compiled forward holds their addresses)."""
    end = start + keep.shape[1]
    for layer in cache.layers:
        index = (start + keep)[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
        layer.keys[:, :, start:end] = layer.keys.gather(2, index)
        layer.values[:, :, start:end] = layer.values.gather(2, index)
    crop_cache(cache, end - int(cache.get_seq_length()))
