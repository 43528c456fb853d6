"""The calibration's prediction checked against the call itself: a call decoding with the shape `tree_shape="auto"`
chose knows, cycle after cycle, what each part of the cycle cost (`stats.CYCLE_PARTS`) and how many tokens it
emitted. When the call's speed so far falls short of plain decoding's calibrated speed by `margin`, after
`min_cycles` cycles (the first, which may pay for kernel selection, not counted), the call goes on plainly: at most
`min_cycles + 1` cycles are spent at the losing speed, whatever the length of the call. When the cycles cost other
than predicted (by more than `cost_margin`), the cached costs were wrong (`costs_disproved`), and the record is
corrected toward what the call measured (`median_cycle`; `calibration.correct_calibration`): the next call predicts
with it, without measuring anything again. Both read the median of the first `min_cycles` counted cycles, so that
one cycle that paid for something else (a compilation, a burst of load) neither disproves a record nor goes into it.
"""

import enum
import statistics
from dataclasses import dataclass, field

from .stats import CYCLE_PARTS


class Decision(enum.Enum):
    KEEP = "keep"  # go on with the tree
    PLAIN = "plain"  # go on plainly: the tree is slower than plain decoding here


@dataclass
class OnlineCheck:
    """The running check of one call. `plain_step`: calibrated seconds per token (per row) of plain decoding;
    `predicted_cycle`: the calibrated seconds of one cycle of the call's shape."""

    plain_step: float
    predicted_cycle: float
    min_cycles: int = 8
    margin: float = 0.10
    cost_margin: float = 0.25
    cycles: int = 0  # observed until the decision, the first included
    seconds: float = 0.0  # of the counted cycles
    tokens: float = 0.0  # emitted per row by the counted cycles
    decision: Decision = Decision.KEEP
    samples: list[float] = field(default_factory=list)  # the first `min_cycles` counted cycles' seconds

    def observe(self, part_seconds: dict[str, float], tokens: float) -> Decision:
        """Count one cycle whose parts took `part_seconds` (by `CYCLE_PARTS`) and that emitted `tokens` per row; the
        decision for the next ones (once `PLAIN`, it stays, and later cycles are not counted)."""
        if self.decision is Decision.PLAIN:
            return self.decision
        self.cycles += 1
        if self.cycles == 1:
            return self.decision
        seconds = sum(part_seconds[part] for part in CYCLE_PARTS)
        self.seconds += seconds
        if len(self.samples) < self.min_cycles:
            self.samples.append(seconds)
        self.tokens += tokens
        if self.cycles > self.min_cycles and self.tokens_per_second < (1 - self.margin) / self.plain_step:
            self.decision = Decision.PLAIN
        return self.decision

    @property
    def counted(self) -> int:
        """The cycles the check has counted (all observed but the first)."""
        return max(self.cycles - 1, 0)

    @property
    def tokens_per_second(self) -> float:
        """Tokens per row and second of the counted cycles."""
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")

    @property
    def speedup(self) -> float:
        """The counted cycles' speed over plain decoding's calibrated speed."""
        return self.tokens_per_second * self.plain_step

    @property
    def median_cycle(self) -> float:
        """The median seconds of a whole cycle over the first `min_cycles` counted cycles (0 before any)."""
        return statistics.median(self.samples) if self.samples else 0.0

    @property
    def costs_disproved(self) -> bool:
        """Whether the first `min_cycles` counted cycles cost other than predicted by more than `cost_margin` (their
        median; not only a lower τ), once they are counted."""
        return (len(self.samples) >= self.min_cycles
                and abs(self.median_cycle / self.predicted_cycle - 1) > self.cost_margin)
