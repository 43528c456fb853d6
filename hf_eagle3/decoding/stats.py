"""What an EAGLE-3 `generate` call did (per-row acceptance, the call's time split, the tree it used and why), and the
output that returns it."""

import contextlib
import itertools
import time
from dataclasses import dataclass, field

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .calibration import TreeChoice
from .drafter import TreeSettings
from .tree import DraftTree


def _mean(lengths: list[int]) -> float | None:
    """The mean of `lengths`; `None` for no lengths (no cycle of that kind ran: not applicable, not 0)."""
    return sum(lengths) / len(lengths) if lengths else None


@dataclass
class Eagle3RowStats:
    """What EAGLE-3 decoding did for one sequence of a call.

    `acceptance_lengths[i]` is the number of tokens the row's cycle `i` emitted from one target forward (accepted
    drafted tokens + the bonus token); the first token (from the prefill) is not counted, nor cycles after the row
    stopped. `greedy_cycles` holds each cycle's `DraftTree` and accepted path (node indices, root first), for greedy
    decoding with `record_greedy_cycles=True` only. With `ngram_candidates`, `continuation_tokens` counts the accepted
    drafted tokens that the context continuation proposed (alone or with the draft). `plain_cycles` are the indices
    of the cycles that verified the root alone, plain decoding steps: a `tree_shape="auto"` call decodes plainly
    where the online check found its tree slower than plain decoding."""

    acceptance_lengths: list[int] = field(default_factory=list)
    greedy_cycles: list[tuple[DraftTree, torch.Tensor]] = field(default_factory=list)
    continuation_tokens: int = 0
    plain_cycles: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float | None:
        """τ of this row: mean tokens per target forward."""
        return _mean(self.acceptance_lengths)

    @property
    def tree_acceptance_lengths(self) -> list[int]:
        """`acceptance_lengths` of the cycles that verified a drafted tree (all but `plain_cycles`)."""
        plain = set(self.plain_cycles)
        return [length for cycle, length in enumerate(self.acceptance_lengths) if cycle not in plain]

    @property
    def mean_tree_acceptance_length(self) -> float | None:
        """τ of this row's drafted trees: mean tokens per target forward over the cycles that verified one."""
        return _mean(self.tree_acceptance_lengths)


CYCLE_PARTS = ("draft", "verify", "other")  # where a cycle's time goes: `Eagle3GenerationStats.{part}_seconds`


@dataclass
class Eagle3GenerationStats:
    """What one EAGLE-3 `generate` call did: `rows[b]` for row `b` of the batch (`Eagle3RowStats`), the time split of
    the whole call (wall-clock seconds) and `num_cycles`, the verification forwards of the target.

    The row fields read across the batch: `acceptance_lengths` and `greedy_cycles` list every row's cycles, row after
    row (for one sequence, its own), `continuation_tokens` sums them. With `tree_shape="auto"`, `shape_choice` says
    which shape was chosen and why, and `choice` is the calibration's choice the call decoded with (its costs and
    predictions: what the call's speed is checked against); `settings` is `None` when the call decoded plainly (the
    draft was not run).
    """

    settings: TreeSettings | None
    rows: list[Eagle3RowStats] = field(default_factory=list)
    num_cycles: int = 0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    shape_choice: str | None = None
    choice: TreeChoice | None = None

    @property
    def acceptance_lengths(self) -> list[int]:
        return [length for row in self.rows for length in row.acceptance_lengths]

    @property
    def greedy_cycles(self) -> list[tuple[DraftTree, torch.Tensor]]:
        return [cycle for row in self.rows for cycle in row.greedy_cycles]

    @property
    def continuation_tokens(self) -> int:
        return sum(row.continuation_tokens for row in self.rows)

    @property
    def plain_cycles(self) -> list[int]:
        """Indices into `acceptance_lengths` of the cycles that decoded plainly (`Eagle3RowStats.plain_cycles`)."""
        offsets = itertools.accumulate((len(row.acceptance_lengths) for row in self.rows), initial=0)
        return [offset + cycle for row, offset in zip(self.rows, offsets) for cycle in row.plain_cycles]

    @property
    def mean_acceptance_length(self) -> float | None:
        """τ: mean tokens per target forward and row (verification cycles only, plain ones included)."""
        return _mean(self.acceptance_lengths)

    @property
    def mean_tree_acceptance_length(self) -> float | None:
        """τ of the drafted trees: mean tokens per target forward and row over the cycles that verified one."""
        return _mean([length for row in self.rows for length in row.tree_acceptance_lengths])

    @property
    def other_seconds(self) -> float:
        """Time of the cycles spent outside drafting and verification: acceptance, bookkeeping, Python."""
        return self.total_seconds - self.prefill_seconds - self.draft_seconds - self.verify_seconds

    def split(self) -> tuple[float, float]:
        """The drafting and verification seconds so far, to take one cycle's share with `split_since`."""
        return self.draft_seconds, self.verify_seconds

    def split_since(self, start: float, before: tuple[float, float]) -> dict[str, float]:
        """Seconds of each of `CYCLE_PARTS` since `time.perf_counter()` read `start` and `split()` read
        `before`."""
        draft, verify = self.draft_seconds - before[0], self.verify_seconds - before[1]
        return {"draft": draft, "verify": verify, "other": time.perf_counter() - start - draft - verify}


@dataclass
class Eagle3GenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` of an EAGLE-3 `generate` call, with what the call did (`eagle3_stats`).

    `cache` (`past_key_values` before transformers 5.24: `utils.transformers_api.output_cache`) is the target's cache
    for one sequence; for a batch it is `None` (rows leave the batch as they finish, and the kept entries of rows that
    accepted fewer tokens are interleaved with unused ones)."""

    eagle3_stats: Eagle3GenerationStats | None = None


class Stopwatch:
    """Accumulates the time of a call's parts into fields of the stats. Where the split is read as the call goes
    (`measured`: the online check weighs every cycle's), it synchronises the device around each part, so that the
    split is real; otherwise, on CUDA, it records events, read once at the end of the call (`finish`), so that timing
    costs the loop no wait. On a CPU the wall clock is the split."""

    def __init__(self, stats: Eagle3GenerationStats, device: torch.device, measured: bool):
        self.stats = stats
        self.device = device
        self.synchronize = device.type == "cuda" and measured
        self.events: list[tuple[str, object, object]] | None = [] if device.type == "cuda" and not measured else None

    @contextlib.contextmanager
    def time(self, field_name: str):
        if self.events is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events.append((field_name, start, end))
            return
        if self.synchronize:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        yield
        if self.synchronize:
            torch.cuda.synchronize(self.device)
        setattr(self.stats, field_name, getattr(self.stats, field_name) + time.perf_counter() - start)

    def finish(self) -> None:
        """Add up the recorded events (one wait for the device, at the end of the call)."""
        if not self.events:
            return
        torch.cuda.synchronize(self.device)
        for field_name, start, end in self.events:
            setattr(self.stats, field_name, getattr(self.stats, field_name) + start.elapsed_time(end) / 1000)
        self.events.clear()
