"""The calibration's prediction checked against the call itself: a call decoding with the shape `tree_shape="auto"`
chose knows, cycle after cycle, what each part of the cycle cost (`stats.CYCLE_PARTS`) and how many tokens it
emitted.

After `min_cycles` cycles (the first, which may pay for kernel selection, not counted), a call whose cycles cost other
than predicted by more than `cost_margin` (their median, so that one cycle that paid for something else, a
compilation or a burst of load, does not count: `costs_disproved`), or whose speed falls short of plain decoding's
calibrated speed by `margin` (then or later), decodes plainly for a trial of `min_cycles` more cycles, which measures
plain decoding here and now (the first not counted either). The calibrated step alone cannot decide: on a shared
machine the speed drifts by tens of percent between the calibration and a call, so a tree that lost only to a step
measured at a quieter moment would be dropped while it still beats plain decoding, and cycles dearer than predicted
may only be a machine slower than when it was calibrated. After the trial the call keeps the faster of the two,
measured seconds apart: plainly, or back to the tree for the rest of the call (its draft kept current meanwhile); and
what it measured, side by side, corrects the record (`calibration.correct_calibration`), so that the next call predicts
with it, without measuring anything again.

A call that went on plainly tries the tree again after `retry_after` plain tokens, and again after twice as many each
time the tree still loses: τ changes along an answer (a title or a list's first lines can be hard to draft, what
follows them easy), and eight cycles at its start must not decide a long call. A retry catches the draft up on the
tokens decoded plainly (one draft forward), then runs `min_cycles + 1` tree cycles (the first not counted) whose
speed is set against the trial's plain decoding: faster, the call keeps the tree to its end; slower, it goes on
plainly. So a call spends at most `min_cycles + 1` cycles at the losing speed before the trial, and as many per
retry, one retry per doubling of its length: on a 1,000-token answer, five.
"""

import enum
import statistics
from dataclasses import dataclass, field

from .stats import CYCLE_PARTS


class Decision(enum.Enum):
    KEEP = "keep"  # go on with the tree
    TRIAL = "trial"  # decode plainly for `min_cycles` cycles, measuring plain decoding's speed here and now
    PLAIN = "plain"  # go on plainly: the tree was slower than plain decoding here (tried again after a while)


@dataclass
class OnlineCheck:
    """The running check of one call. `plain_step`: calibrated seconds per token (per row) of plain decoding;
    `predicted_cycle`: the calibrated seconds of one cycle of the call's shape; `retry_after`: plain tokens before the
    tree is tried again, doubled after each retry it loses."""

    plain_step: float
    predicted_cycle: float
    min_cycles: int = 8
    margin: float = 0.10
    cost_margin: float = 0.25
    retry_after: int = 32
    cycles: int = 0  # tree cycles observed since the tree (re)started, the first included
    seconds: float = 0.0  # of the counted tree cycles since then
    tokens: float = 0.0  # emitted per row by those cycles
    decision: Decision = Decision.KEEP
    settled: bool = False  # decided for the rest of the call (the tree, after a trial or a retry)
    samples: list[float] = field(default_factory=list)  # the first `min_cycles` counted tree cycles' seconds
    trial_cycles: int = 0  # plain cycles of the trial, the first included
    plain_samples: list[float] = field(default_factory=list)  # the trial's counted plain steps' seconds
    plain_cycles: int = 0  # plain cycles since the call last went on plainly
    retries: int = 0  # times the tree was tried again

    def observe(self, part_seconds: dict[str, float], tokens: float) -> Decision:
        """Count one cycle whose parts took `part_seconds` (by `CYCLE_PARTS`) and that emitted `tokens` per row; the
        decision for the next ones (final once `settled`)."""
        if self.settled:
            return self.decision
        if self.decision is Decision.TRIAL:
            self.trial_cycles += 1
            if self.trial_cycles > 1:  # keeping the tree's draft current (drafting) is not plain decoding's work
                self.plain_samples.append(part_seconds["verify"] + part_seconds["other"])
            if len(self.plain_samples) == self.min_cycles:
                self._settle_against_plain()
            return self.decision
        if self.decision is Decision.PLAIN:
            self.plain_cycles += 1
            if self.plain_cycles == self.retry_after:  # the tree again, measured afresh
                self.decision, self.retries = Decision.KEEP, self.retries + 1
                self.cycles, self.seconds, self.tokens = 0, 0.0, 0.0
            return self.decision
        self.cycles += 1
        if self.cycles == 1:
            return self.decision
        seconds = sum(part_seconds[part] for part in CYCLE_PARTS)
        self.seconds += seconds
        if len(self.samples) < self.min_cycles:
            self.samples.append(seconds)
        self.tokens += tokens
        if self.retries:
            if self.counted == self.min_cycles:
                self._settle_against_plain()
            return self.decision
        losing = self.tokens_per_second < (1 - self.margin) / self.plain_step
        if self.cycles > self.min_cycles and (losing or self.costs_disproved):
            self.decision = Decision.TRIAL
        return self.decision

    def _settle_against_plain(self) -> None:
        """After the trial or a retry: the tree for the rest of the call where its counted cycles beat the trial's
        plain decoding, else plainly until the next retry (twice as far off after a retry)."""
        if self.measured_speedup >= 1:
            self.decision, self.settled = Decision.KEEP, True
            return
        if self.retries:
            self.retry_after *= 2
        self.decision, self.plain_cycles = Decision.PLAIN, 0

    @property
    def counted(self) -> int:
        """The tree cycles the check has counted (all observed but the first)."""
        return max(self.cycles - 1, 0)

    @property
    def tokens_per_second(self) -> float:
        """Tokens per row and second of the counted tree cycles since the tree (re)started."""
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")

    @property
    def speedup(self) -> float:
        """The counted tree cycles' speed over plain decoding's calibrated speed."""
        return self.tokens_per_second * self.plain_step

    @property
    def measured_plain_step(self) -> float | None:
        """Plain decoding's step measured by the trial (the median of its counted cycles; `None` before it ends)."""
        return statistics.median(self.plain_samples) if len(self.plain_samples) == self.min_cycles else None

    @property
    def measured_speedup(self) -> float | None:
        """The counted tree cycles' speed over the trial's plain decoding (`None` before the trial ends)."""
        step = self.measured_plain_step
        return None if step is None else self.tokens_per_second * step

    @property
    def measured_cycle(self) -> float:
        """The median seconds of a tree cycle over the first `min_cycles` counted ones (0 before any)."""
        return statistics.median(self.samples) if self.samples else 0.0

    @property
    def costs_disproved(self) -> bool:
        """Whether the first `min_cycles` counted cycles cost other than predicted by more than `cost_margin`
        (`measured_cycle`; not only a lower τ), once they are counted."""
        return (len(self.samples) >= self.min_cycles
                and abs(self.measured_cycle / self.predicted_cycle - 1) > self.cost_margin)
