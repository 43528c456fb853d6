"""The decoding loop's state: each sequence (`Row`), and the rows the target's cache holds (`BatchState`), in one
index space, the cache's order."""

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache, StaticCache

from ..utils.transformers_api import crop_cache
from .proposer import Proposer, to_device
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
class Row:
    """One sequence of the batch: row `index` of the call's batch (what logits processors index), its tokens so far
    (left padding included: what plain decoding's stopping criteria and logits processors see) on the device and as a
    host copy, its statistics, and the length at which the stopping criteria first held."""

    index: int
    tokens: torch.Tensor  # [L] on the device
    host_tokens: list[int]
    stats: Eagle3RowStats = field(default_factory=Eagle3RowStats)
    stop_length: int | None = None
    scores: list[torch.Tensor] = field(default_factory=list)  # [1, V] per emitted token, with output_scores
    logits: list[torch.Tensor] = field(default_factory=list)  # [1, V] per emitted token, with output_logits

    def emit(self, new_tokens: list[int], device_tokens: torch.Tensor, scores: torch.Tensor | None,
             logits: torch.Tensor | None, stopping: Stopping) -> list[int]:
        """Append `new_tokens` (also on the device, `device_tokens`, with the processed scores and raw logits
        `[m, V]` that chose them where the output keeps them), stopping exactly where plain decoding would. A row
        that has stopped and decodes on only respects `max_length`. Returns the tokens appended."""
        if self.stop_length is not None:
            kept = min(len(new_tokens), stopping.max_length - len(self.host_tokens))
        else:
            kept = self._kept_until_stop(new_tokens, scores, logits, stopping)
        self.host_tokens.extend(new_tokens[:kept])
        self.tokens = torch.cat([self.tokens, device_tokens[:kept]])
        return new_tokens[:kept]

    def _kept_until_stop(self, new_tokens: list[int], scores: torch.Tensor | None, logits: torch.Tensor | None,
                         stopping: Stopping) -> int:
        """How many of `new_tokens` the row keeps: the criteria see each new token's prefix in turn, on a host copy of
        the tokens (a CPU tensor, also beside a target on an accelerator), so their verdicts wait on no device."""
        extended, start = torch.tensor([self.host_tokens + new_tokens]), len(self.host_tokens)
        for kept in range(1, len(new_tokens) + 1):
            if stopping.keep_scores:
                self.scores.append(scores[kept - 1, None])
            if stopping.keep_logits:
                self.logits.append(logits[kept - 1, None])
            if stopping.criteria(extended[:, : start + kept], tuple(self.scores) if stopping.keep_scores else None)[0]:
                self.stop_length = start + kept
                if self.stats.acceptance_lengths:  # a cut cycle counts the tokens it emitted
                    self.stats.acceptance_lengths[-1] = kept
                return kept
        return len(new_tokens)

    def record(self, length: int, continuation_accepted: int, plain: bool, cycle=None) -> None:
        """Count a verified cycle that emitted `length` tokens in the row's statistics (with the tree and accepted
        path where greedy cycles are recorded), unless the row has stopped and decodes on."""
        if self.stop_length is not None:
            return
        self.stats.continuation_tokens += continuation_accepted
        if plain:  # the root alone: a plain decoding step
            self.stats.plain_cycles.append(len(self.stats.acceptance_lengths))
        self.stats.acceptance_lengths.append(length)  # accepted drafted tokens + the bonus token
        if cycle is not None:  # references only: nothing computed on the decoding path
            self.stats.greedy_cycles.append(cycle)


def decoding_rows(rows: list[Row], live: list[Row], stopping: Stopping) -> list[int]:
    """Indices into `live` (the rows still in the cache) of those that decode on, given every row of the call."""
    stop_lengths = [row.stop_length for row in rows]
    final_length = max(stop_lengths) if None not in stop_lengths else stopping.max_length
    return [
        index for index, row in enumerate(live)
        if row.stop_length is None
        or (not stopping.pad_stopped_rows and len(row.host_tokens) < min(final_length, stopping.max_length))
    ]


@dataclass
class BatchState:
    """The rows the target's `cache` holds, in its order, their `proposer`, and for each row: which cache entries it
    sees (`visible` `[b, P]`), their positions (`key_positions` `[b, P]`) and the position of its root, its last
    token, not yet cached (`root_positions` `[b]`). `cache_length` is `P`, kept on the host."""

    rows: list[Row]
    proposer: Proposer
    cache: DynamicCache | StaticCache
    visible: torch.Tensor
    key_positions: torch.Tensor
    root_positions: torch.Tensor

    @property
    def cache_length(self) -> int:
        return self.visible.shape[1]

    def select(self, indices: list[int]) -> "BatchState":
        """The state of the rows `indices` only: the others leave the batch, the cache and the proposer."""
        if len(indices) == len(self.rows):
            return self
        index = to_device(torch.tensor(indices), self.visible.device)
        select_cache_rows(self.cache, index)
        self.proposer.select(index, indices)
        return BatchState([self.rows[i] for i in indices], self.proposer, self.cache, self.visible[index],
                          self.key_positions[index], self.root_positions[index])

    def advance(self, lengths: torch.Tensor, longest: int) -> "BatchState":
        """The state after each row kept `lengths[i]` new cache entries from its root on, contiguous after the prefix;
        the cache grew by the `longest`, and a row that kept fewer hides the rest from now on."""
        offsets = torch.arange(longest, device=lengths.device)
        visible = torch.cat([self.visible, offsets[None] < lengths[:, None]], dim=1)
        key_positions = torch.cat([self.key_positions, self.root_positions[:, None] + offsets], dim=1)
        return BatchState(self.rows, self.proposer, self.cache, visible, key_positions, self.root_positions + lengths)


def select_cache_rows(cache: DynamicCache | StaticCache, rows: torch.Tensor) -> None:
    """Keep the batch rows `rows` of every cache layer, each layer indexed on its own device (a target spread over
    several devices)."""
    for layer in cache.layers:
        layer.batch_select_indices(rows.to(layer.keys.device, non_blocking=True))


def keep_cache_entries(cache: DynamicCache | StaticCache, start: int, keep: torch.Tensor, length: int) -> None:
    """Of each row's cache entries from `start` on (the cache holds `length`), keep those at offsets `keep[b]`
    (`[B, M]`, sorted), moved to be contiguous; where a row keeps fewer than `M`, its `keep` repeats any offset (the
    row's mask hides those). Each layer is indexed on its own device; a static cache's tensors are updated in place (a
    compiled forward holds their addresses)."""
    end = start + keep.shape[1]
    for layer in cache.layers:
        offsets = (start + keep).to(layer.keys.device, non_blocking=True)
        index = offsets[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
        layer.keys[:, :, start:end] = layer.keys.gather(2, index)
        layer.values[:, :, start:end] = layer.values.gather(2, index)
    crop_cache(cache, end - length)
