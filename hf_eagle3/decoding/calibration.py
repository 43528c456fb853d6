"""The draft tree's shape for the machine at hand: what each shape costs here, measured, combined with the draft's
acceptance profile into a predicted speed for every shape.

A tree shape (depth `D`, top-k `K`, `N` drafted tokens) decodes

    τ(D, K, N) / (t_draft(D, K) + t_verify(N + 1) + t_other)

tokens per second, against `1 / t_plain` for plain decoding. τ belongs to the draft and its target (the draft's
*acceptance profile*, `Eagle3Config.acceptance_profile`, recorded by `hf-eagle3 tune-tree`): it does not depend on
the hardware. The times do, a lot: a 13-token verification costs 1.1 decode steps on a CPU with AMX and 2.6 on one
without, and bfloat16 is several times slower than float32 where the CPU has no bf16 matrix unit. So they are
measured where decoding runs, on the path that will run (`calibration_key`: dtype, device, threads, batch size, eager
or compiled, the length of a static cache, the weight layout of `cpu_layout.optimize`), and cached under
`$HF_EAGLE3_CACHE/calibration`. Plain decoding's step grows with the tokens cached before it (on a 2-core Zen 4 EPYC,
bfloat16: 53 / 60 / 61 ms after 48 / 160 / 320), a verification forward's much less, so through a dynamic cache the
decode step is measured after each of `PLAIN_CONTEXTS` tokens and a call's prediction reads it at the call's mean
context (`MachineCosts.plain_step_at`). A forward through a static cache attends to all of its entries (those past the
sequence masked), so its cost grows with the cache's length, not the sequence's: on a 2-core Zen 4 EPYC a compiled
1-token forward of SmolLM2-135M takes 48 ms with 200 entries and 77 ms with 900. A static cache's costs are measured
at its length.

A batch of `B` rows verifies every row's tree in one forward of `B (N + 1)` tokens and drafts each level of every
row's tree in one draft forward, so the costs of a batch are measured at its size. Rows decode independently, so a
batch emits `B τ` tokens per cycle against `B` per plain step: the prediction above holds with the batch's costs.

Measuring on a noisy machine: every cost is sampled in `CALIBRATION_ROUNDS` interleaved rounds after a round that
only warms every shape up, so that a change of load hits every cost alike, and the medians count. The decode step is
plain `generate`'s own, the median time between its tokens (a clock in its stopping criteria). A measurement whose
spread (interquartile range over median, `MachineCosts.spread`) exceeds `MAX_SPREAD` is taken again once; still
noisy, it is recorded as such (and measured again by the next process) and `auto` decodes plainly, saying so.
Within a call, `online.OnlineCheck` compares the call's real speed with plain decoding's calibrated speed and its
cycles with their predicted cost; when the shape seems to lose, or its cycles cost other than predicted, the call
decodes plainly for a few cycles, measuring plain decoding there, and keeps the faster. What such a call measured, the
tree's cycles and plain decoding's step side by side, moves the record halfway (in log scale) toward it
(`correct_calibration`), so that a wrong record is mended without measuring again inside a user's call: its
`speed_scale` (the machine's speed, every cost alike) and its `cycle_scale` (the cycles against plain decoding, every
shape alike). A machine slower or faster than when it was calibrated moves the first, which changes no predicted
speedup; only a record whose cycles are wrong against plain decoding moves the second. The shapes keep the order
their interleaved measurement gave them, and one call that ran at a noisy moment neither pins its shape to its own
cost (after which nothing would measure that shape again) nor sends the next call to another shape.

The cache is an optimisation, never a point of failure: a record that cannot be read or is invalid is reported once,
naming the file, and measured again; a cache that cannot be written (read-only, full, a file in the way) is reported
once and the costs are kept in memory for the process. Profiles are checked before anything is allocated
(`profile_problem`); a prediction above `MAX_PREDICTED_SPEEDUP`, or not finite, is never acted on.
`hf-eagle3 tune-tree --recalibrate` measures again and replaces the record; `--show-calibration` prints it.

`choose_tree` picks the predicted-fastest shape, or none when no shape is predicted to beat plain decoding by
`MIN_PREDICTED_SPEEDUP`: `generate(..., tree_shape="auto")` then decodes plainly.
"""

import contextlib
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, StaticCache, StoppingCriteria, StoppingCriteriaList
from transformers.utils import logging

from ..configuration_eagle3 import MAX_TREE_DEPTH, MAX_TREE_TOKENS
from ..modeling_eagle3 import Eagle3DraftModel
from ..utils.cache import cache_dir
from ..utils.fingerprint import digest, model_fingerprint, tensor_digest
from ..utils.transformers_api import CACHE, attention_implementation, crop_cache
from . import grouped_attention
from .compiled import compiled_forward
from .cpu_layout import weight_layout
from .drafter import Eagle3Drafter, TreeSettings, max_candidates
from .tree import tree_attention_mask

# A shape must be predicted this much faster than plain decoding to be used; a prediction above the maximum (or not
# finite) comes from a damaged record or a broken measurement and is never acted on.
MIN_PREDICTED_SPEEDUP, MAX_PREDICTED_SPEEDUP = 1.05, 20.0
CALIBRATION_PREFIX = 160  # cached tokens the costs are measured after: a prompt and part of an answer
CALIBRATION_NEW_TOKENS = 16  # tokens of the plain and EAGLE-3 `generate` calls of each round
CALIBRATION_ROUNDS = 5  # interleaved rounds of every measurement, after one that warms up
MAX_SPREAD = 0.25  # the largest interquartile range / median of a cost that is trusted
PLAIN_CONTEXTS = (48, CALIBRATION_PREFIX, 320)  # cached tokens the decode step of a dynamic cache is measured after
CALIBRATION_METHOD = 6  # in the key: records of an earlier way of measuring or correcting are measured again
SECONDS_RANGE = (1e-6, 3600.0)  # a measured cost outside this is no measurement
MAX_RECORD_BYTES = 1 << 20
CORRECTION_WEIGHT = 0.5  # how far one call moves the record's scales toward what it measured, in log scale
# A scale outside its range is no correction: the machine's speed may change by orders of magnitude (a loaded or
# throttled machine), the cycles against plain decoding only by what the calibration's shapes missed; corrections stop
# at the bounds, and a record past them is measured again (a cycle_scale of 1e3 would keep every call plain for good,
# as nothing is measured while a call decodes plainly).
SCALE_RANGE = {"speed_scale": (1e-3, 1e3), "cycle_scale": (0.1, 10.0)}
CPU_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")  # what decides a CPU's float32 / bfloat16 speed
logger = logging.get_logger(__name__)
# Costs measured in this process that could not be written to the cache, or stayed noisy, by record path: the
# process measures them once, not at every call
_KEPT_IN_MEMORY: dict[Path, "MachineCosts"] = {}


def cpu_info() -> tuple[str, set[str] | None]:
    """(this machine's processor model, its instruction-set flags, or None where /proc/cpuinfo does not list them)."""
    model, flags = platform.processor() or platform.machine(), None
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        flags = set()
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    return model, flags


def machine_description(device: torch.device | str = "cpu") -> str:
    """The processor decoding runs on, with the instruction-set flags that decide its speed."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model, flags = cpu_info()
    if flags is None:
        return model
    present = [flag for flag in CPU_FLAGS if flag in flags]
    return f"{model} ({', '.join(present) if present else 'none of ' + ', '.join(CPU_FLAGS)})"


def _seconds(value, name: str, low: float = SECONDS_RANGE[0]) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= SECONDS_RANGE[1]:
        raise ValueError(f"{name} must be seconds in [{low:g}, {SECONDS_RANGE[1]:g}], got {value!r}")
    return float(value)


def _count(value, name: str, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise ValueError(f"{name} must be an integer in [1, {high}], got {value!r}")
    return value


@dataclass(frozen=True)
class MachineCosts:
    """Seconds, measured on one machine for one target, draft, dtype, thread count and batch size.

    `plain_step`: one token per row of plain greedy `generate` after `CALIBRATION_PREFIX` cached tokens, and
    `plain_steps[c]` after `c` (through a dynamic cache; empty through a static one, whose step depends on its length
    alone); `verify[n]`: one target forward over `n` tokens per
    row (a tree of `n - 1` nodes and its root); `draft[(depth, top_k)]`: the draft's work in one cycle, every row;
    `other`: the rest of a cycle (acceptance, cache compaction, bookkeeping); `spread`: the interquartile range over
    median, over the measurement's rounds, of the predicted speedup of the shape the medians choose (`MAX_SPREAD`);
    `speed_scale`: the machine's speed where calls measured it (seconds now over seconds when it was calibrated), and
    `cycle_scale`: the cycles' cost against plain decoding's step where calls measured both, over that of the
    calibration; running geometric means over the calls that measured them (`correct_calibration`; 1 until one
    does). Plain decoding's step is predicted at its measured value times `speed_scale` (`plain_step_at`), every
    shape's cycle at its measured parts times both (`cycle_parts`).
    """

    machine: str
    plain_step: float
    verify: dict[int, float]
    draft: dict[tuple[int, int], float]
    other: float
    spread: float = 0.0
    plain_steps: dict[int, float] = field(default_factory=dict)
    speed_scale: float = 1.0
    cycle_scale: float = 1.0

    def cycle_parts(self, shape: TreeSettings) -> dict[str, float]:
        """The predicted seconds of each part of a cycle of `shape` (`stats.CYCLE_PARTS`): drafting, verifying its
        tree and the rest, as measured, times `speed_scale` and `cycle_scale`."""
        scale = self.speed_scale * self.cycle_scale
        return {"draft": scale * self.draft[shape.depth, shape.top_k],
                "verify": scale * self.verify[shape.total_tokens + 1], "other": scale * self.other}

    def plain_step_at(self, context: float | None) -> float:
        """Plain decoding's predicted step with `context` tokens cached: interpolated between the measured
        `plain_steps`, the nearest measured beyond them (`plain_step` without a context or with fewer than two
        measured), times `speed_scale`."""
        return self.speed_scale * self._measured_step_at(context)

    def _measured_step_at(self, context: float | None) -> float:
        points = sorted(self.plain_steps.items())
        if context is None or len(points) < 2:
            return self.plain_step
        if context <= points[0][0]:
            return points[0][1]
        for (low, low_step), (high, high_step) in zip(points, points[1:]):
            if context <= high:
                return low_step + (high_step - low_step) * (context - low) / (high - low)
        return points[-1][1]

    def to_json(self) -> dict:
        return asdict(self) | {"draft": [[*shape, seconds] for shape, seconds in self.draft.items()]}

    @classmethod
    def from_json(cls, record) -> "MachineCosts":
        """The costs of a cache record, every field checked (a `ValueError` or `TypeError` names the first wrong)."""
        if not isinstance(record, dict) or not isinstance(record.get("machine"), str):
            raise TypeError("the costs must be an object with a machine name")
        verify, draft, plain_steps = record.get("verify"), record.get("draft"), record.get("plain_steps", {})
        if not isinstance(verify, dict) or not isinstance(draft, list) or not isinstance(plain_steps, dict):
            raise TypeError("verify and plain_steps must map token counts to seconds, draft list [depth, top_k, "
                            "seconds]")
        if not all(isinstance(entry, list) and len(entry) == 3 for entry in draft):
            raise ValueError("draft must list [depth, top_k, seconds]")
        spread = record.get("spread", 0.0)
        if isinstance(spread, bool) or not isinstance(spread, int | float) or not 0 <= spread < math.inf:
            raise ValueError(f"spread must be a finite number >= 0, got {spread!r}")
        scales = {name: record.get(name, 1.0) for name in SCALE_RANGE}
        for name, scale in scales.items():
            low, high = SCALE_RANGE[name]
            if isinstance(scale, bool) or not isinstance(scale, int | float) or not low <= scale <= high:
                raise ValueError(f"{name} must be a number in [{low:g}, {high:g}], got {scale!r}")
        return cls(
            machine=record["machine"],
            plain_step=_seconds(record.get("plain_step"), "plain_step"),
            verify={_count(int(n) if n.isdigit() else n, "a verified token count", MAX_TREE_TOKENS + 1):
                    _seconds(seconds, f"verify[{n}]") for n, seconds in verify.items()},
            draft={(_count(depth, "a tree depth", MAX_TREE_DEPTH), _count(top_k, "a top-k", MAX_TREE_TOKENS)):
                   _seconds(seconds, f"draft[{depth}, {top_k}]") for depth, top_k, seconds in draft},
            other=_seconds(record.get("other"), "other", low=0.0),
            spread=float(spread),
            plain_steps={_count(int(n) if n.isdigit() else n, "a cached token count", 1 << 20):
                         _seconds(seconds, f"plain_steps[{n}]") for n, seconds in plain_steps.items()},
            speed_scale=float(scales["speed_scale"]),
            cycle_scale=float(scales["cycle_scale"]),
        )


@dataclass(frozen=True)
class ShapePrediction:
    settings: TreeSettings
    tau: float  # tokens per target forward, from the acceptance profile
    cycle_seconds: float
    tau_by_set: dict[str, float] = field(default_factory=dict)  # the profile's τ per prompt set, where it has them

    @property
    def tokens_per_second(self) -> float:
        return self.tau / self.cycle_seconds

    def tau_for(self, prompt_set: str | None) -> float:
        """The profile's τ for prompts of `prompt_set` (`"mt-bench"`, `"humaneval"`), or over all its prompts."""
        return self.tau_by_set.get(prompt_set, self.tau)


@dataclass(frozen=True)
class TreeChoice:
    """What `choose_tree` decided: `settings` (None: decode plainly), why, and every shape's prediction. `costs` are
    `None` when nothing was measured (an unusable profile); `path` is the cache record they came from or went to."""

    settings: TreeSettings | None
    predicted_speedup: float  # of the chosen shape over plain decoding (1.0 when decoding plainly)
    reason: str
    costs: MachineCosts | None
    predictions: list[ShapePrediction]
    path: Path | None = None
    context_length: float | None = None  # the mean tokens cached while the call decodes, where known

    @property
    def prediction(self) -> ShapePrediction | None:
        """The chosen shape's prediction (`None` when decoding plainly)."""
        return self.predictions[0] if self.settings is not None else None

    @property
    def plain_step(self) -> float | None:
        """Plain decoding's calibrated step at the call's context (`None`: nothing measured)."""
        return self.costs.plain_step_at(self.context_length) if self.costs is not None else None

    def call_speedup(self, new_tokens: int, prefill_seconds: float, tau: float | None = None,
                     prompt_tokens: int | None = None, plain_tokens: int = 0) -> float:
        """The predicted speedup of a whole `generate` call over plain decoding: both pay the same prefill
        (`prefill_seconds`, which also gives the first token); then plain decoding takes a decode step per further
        token (at the call's mean context, from `prompt_tokens`, else the choice's), EAGLE-3 a cycle per `tau` of them
        (default: the profile's), except for `plain_tokens` it decoded plainly (where the online check found the tree
        slower), a decode step each. `predicted_speedup` is its limit for long answers; for short ones the prefill
        dilutes it."""
        prediction = self.prediction
        decoded = new_tokens - 1
        if prediction is None or self.costs is None or decoded < 1:
            return 1.0
        plain_step = (self.plain_step if prompt_tokens is None
                      else self.costs.plain_step_at(prompt_tokens + new_tokens / 2))
        drafted = max(decoded - plain_tokens, 0)
        return ((prefill_seconds + decoded * plain_step)
                / (prefill_seconds + drafted * prediction.cycle_seconds / (tau or prediction.tau)
                   + (decoded - drafted) * plain_step))


def profile_problem(profile, draft_vocab_size: int) -> str | None:
    """What makes an acceptance profile unusable here (`None`: nothing): every row a shape whose sizes are integers
    within `MAX_TREE_DEPTH` / `MAX_TREE_TOKENS` and the draft's vocabulary, that a tree of its depth and top-k holds,
    with a finite τ in [1, tokens + 1]. Checked before any shape is measured or allocated."""
    if not isinstance(profile, list) or not profile:
        return "the acceptance profile is empty or not a list of rows"
    for row in profile:
        try:
            if not isinstance(row, dict):
                raise TypeError("not an object")
            depth = _count(row.get("tree_depth"), "tree_depth", MAX_TREE_DEPTH)
            top_k = _count(row.get("tree_top_k"), "tree_top_k", min(MAX_TREE_TOKENS, draft_vocab_size))
            total = _count(row.get("tree_total_tokens"), "tree_total_tokens", MAX_TREE_TOKENS)
            for name in ("prompts", "cycles"):  # what the row's τ rests on (profiles recorded before lack them)
                if name in row and (type(row[name]) is not int or row[name] < 0):
                    raise ValueError(f"{name} must be a count, got {row[name]!r}")
            if not isinstance(row.get("ngram_candidates", False), bool):
                raise TypeError(f"ngram_candidates must be true or false, got {row['ngram_candidates']!r}")
            if total > max_candidates(depth, top_k):
                raise ValueError(f"{total} tokens do not fit a tree of depth {depth} and top-k {top_k}")
            by_set = row.get("tau_by_set", {})
            if not isinstance(by_set, dict) or not all(isinstance(name, str) for name in by_set):
                raise TypeError("tau_by_set must map prompt-set names to τ")
            taus = {"tau": row.get("tau")} | {f"tau_by_set[{name!r}]": tau for name, tau in by_set.items()}
            for name, tau in taus.items():
                if isinstance(tau, bool) or not isinstance(tau, int | float) or not 1 <= tau <= total + 1:
                    raise ValueError(f"{name} must be a number in [1, tree_total_tokens + 1 = {total + 1}], got "
                                     f"{tau!r}")
        except (TypeError, ValueError) as error:
            return f"the acceptance profile row {str(row)[:200]} is invalid ({error})"
    return None


def profile_rows(profile: list[dict], ngram_candidates: bool | None = None) -> list[tuple[TreeSettings, dict]]:
    """(shape, row) of the rows of an acceptance profile measured with context n-gram candidates in the tree or
    without (`ngram_candidates`; `None`: every row)."""
    return [(TreeSettings(row["tree_depth"], row["tree_top_k"], row["tree_total_tokens"]), row)
            for row in profile
            if ngram_candidates is None or row.get("ngram_candidates", False) == ngram_candidates]


def profile_shapes(profile: list[dict], ngram_candidates: bool | None = None) -> list[tuple[TreeSettings, float]]:
    """(shape, τ) of the rows of an acceptance profile (see `profile_rows`)."""
    return [(shape, row["tau"]) for shape, row in profile_rows(profile, ngram_candidates)]


def _missing_costs(profile: list[dict], costs: MachineCosts) -> list[str]:
    """The costs `predict` needs for the shapes of `profile` that `costs` lacks."""
    missing = []
    for shape, _ in profile_shapes(profile):
        if shape.total_tokens + 1 not in costs.verify:
            missing.append(f"verify[{shape.total_tokens + 1}]")
        if (shape.depth, shape.top_k) not in costs.draft:
            missing.append(f"draft[{shape.depth}, {shape.top_k}]")
    return sorted(set(missing))


def predict(profile: list[dict], costs: MachineCosts, ngram_candidates: bool = False) -> list[ShapePrediction]:
    """The predicted speed on the measured machine of every profiled shape, fastest first. With `ngram_candidates`,
    a shape's τ is the one profiled with context candidates in the tree, or, for shapes profiled only without them,
    that one (a lower bound: the candidates share the same token budget)."""
    rows = {shape: row for shape, row in profile_rows(profile, False)}
    if ngram_candidates:
        rows |= dict(profile_rows(profile, True))
    predictions = [ShapePrediction(shape, row["tau"], sum(costs.cycle_parts(shape).values()), row.get("tau_by_set", {}))
                   for shape, row in rows.items()]
    return sorted(predictions, key=lambda prediction: -prediction.tokens_per_second)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(device: torch.device, function: Callable[[], object]) -> float:
    start = time.perf_counter()
    function()
    _synchronize(device)
    return time.perf_counter() - start


def _spread(samples: list[float]) -> float:
    """Interquartile range over median (0 for fewer than two samples)."""
    if len(samples) < 2:
        return 0.0
    quartiles = statistics.quantiles(samples, n=4, method="inclusive")
    return (quartiles[2] - quartiles[0]) / max(statistics.median(samples), 1e-12)


def _interleaved(probes: dict, rounds: int) -> dict:
    """Samples of every probe (a callable returning seconds), `rounds` times each, interleaved round by round after
    a round that only warms every probe up."""
    samples = {name: [] for name in probes}
    for round_index in range(rounds + 1):
        for name, probe in probes.items():
            seconds = probe()
            if round_index:
                samples[name].append(seconds)
    return samples


def _verification_probes(
    target, sizes: list[int], prefix_length: int, layer_ids: list[int] | None, batch_size: int, compile_config=None,
    static_length: int | None = None,
) -> dict[int, Callable[[], float]]:
    """One probe per size `n`: a target forward over `n` new tokens per row after a cached `prefix_length`-token
    prefix, as verification runs it (a 4D tree mask, query groups folded for sdpa (`grouped_attention`), the hidden
    states at `layer_ids`; through a static cache of `static_length` entries where given, and with `compile_config`
    through the compiled forward, as compiled verification does: a compiled forward needs a static cache, of
    `prefix_length + max(sizes)` unless given)."""
    device = target.device
    vocab_size = target.config.get_text_config().vocab_size
    if static_length is None and compile_config is not None:
        static_length = prefix_length + max(sizes)
    cache = (StaticCache(config=target.config, max_cache_len=static_length) if static_length else DynamicCache())
    forward = compiled_forward(target, compile_config) if compile_config is not None else target
    target(torch.randint(0, vocab_size, (batch_size, prefix_length), device=device), **{CACHE: cache})
    prefix_visible = torch.ones(prefix_length, dtype=torch.bool, device=device)
    folded = grouped_attention.forward_kwargs(attention_implementation(target.config))

    def probe(n: int) -> float:
        chain = torch.ones(n, n, dtype=torch.bool, device=device).tril()  # any tree's mask costs the same
        mask = tree_attention_mask(chain, prefix_visible, target.dtype)
        if static_length:
            mask = torch.nn.functional.pad(mask, (0, static_length - mask.shape[-1]),
                                           value=torch.finfo(target.dtype).min)
        mask = mask.expand(batch_size, -1, -1, -1)
        tokens = torch.randint(0, vocab_size, (batch_size, n), device=device)
        positions = torch.arange(prefix_length, prefix_length + n, device=device)[None].expand(batch_size, -1)
        seconds = _timed(device, lambda: forward(input_ids=tokens, position_ids=positions, attention_mask=mask,
                                                 **{CACHE: cache}, output_hidden_states=layer_ids, use_cache=True,
                                                 **folded))
        crop_cache(cache, -n)
        return seconds

    return {n: (lambda n=n: probe(n)) for n in sizes}


@torch.no_grad()
def verification_cost(
    target, sizes: list[int], prefix_length: int = CALIBRATION_PREFIX, repetitions: int = CALIBRATION_ROUNDS,
    layer_ids: list[int] | None = None, batch_size: int = 1,
) -> dict[int, float]:
    """Median seconds of one target forward over `n` new tokens per row of `batch_size` after a cached
    `prefix_length`-token prefix, for each `n` in `sizes`, as verification runs it (a 4D tree mask; the hidden states
    at `layer_ids`), interleaved repetitions after a warm-up of every size."""
    samples = _interleaved(_verification_probes(target, sizes, prefix_length, layer_ids, batch_size), repetitions)
    return {n: statistics.median(times) for n, times in samples.items()}


def _drafting_probes(draft: Eagle3DraftModel, shapes: list[TreeSettings], accepted_per_cycle: int,
                     prefix_length: int, batch_size: int = 1) -> dict[TreeSettings, Callable[[], float]]:
    """One probe per shape: the draft's work in one cycle for `batch_size` rows, feeding `accepted_per_cycle`
    verified positions, then growing the trees (the draft's embedding must be attached)."""
    device, dtype = draft.device, draft.fc.weight.dtype
    vocab_size, feature_size = draft.config.vocab_size, 3 * draft.config.target_hidden_size
    drafters = {shape: Eagle3Drafter(draft, shape) for shape in shapes}

    def fed(length: int, start: int):
        return (torch.randint(0, vocab_size, (batch_size, length), device=device),
                torch.randn(batch_size, length, feature_size, device=device, dtype=dtype),
                torch.arange(start, start + length, device=device).expand(batch_size, -1),
                torch.ones(batch_size, length, dtype=torch.bool, device=device))

    for drafter in drafters.values():
        drafter.extend(*fed(prefix_length, 0))
    cycle_inputs = fed(accepted_per_cycle, prefix_length)

    def probe(drafter: Eagle3Drafter) -> float:
        def cycle():
            drafter.extend(*cycle_inputs)
            drafter.draft_tree(cycle_inputs[0][:, -1], cycle_inputs[2][:, -1] + 1)

        seconds = _timed(device, cycle)
        drafter.visible = drafter.visible[:, :prefix_length]  # the next extend drops this cycle's entries
        return seconds

    return {shape: (lambda drafter=drafter: probe(drafter)) for shape, drafter in drafters.items()}


@torch.no_grad()
def drafting_cost(
    draft: Eagle3DraftModel, shapes: list[TreeSettings], accepted_per_cycle: int = 2,
    prefix_length: int = CALIBRATION_PREFIX, repetitions: int = CALIBRATION_ROUNDS,
) -> dict[TreeSettings, float]:
    """Median seconds the draft spends per cycle with each tree shape (interleaved repetitions after a warm-up):
    feeding `accepted_per_cycle` verified positions, then growing the tree (the draft's embedding must be attached)."""
    samples = _interleaved(_drafting_probes(draft, shapes, accepted_per_cycle, prefix_length), repetitions)
    return {shape: statistics.median(times) for shape, times in samples.items()}


class _TokenClock(StoppingCriteria):
    """Stopping criteria that never stop: the time at which `generate` produced each token."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def path_generate_kwargs(compile_config, static_length: int | None) -> dict:
    """`generate` settings of the path calibrated with `compile_config` (`None`: eager) and a static cache of
    `static_length` entries (`None`: dynamic, or for a compiled path the length `generate` gives it)."""
    static = {} if static_length is None else {"cache_implementation": "static", "max_cache_len": static_length}
    if compile_config is not None:
        static = {"cache_implementation": "static", "compile_config": compile_config} | static
    return static


def _plain_step_probe(target, prompt: torch.Tensor, new_tokens: int, path: dict) -> Callable[[], float]:
    """A probe: the median time between the tokens of a plain greedy `generate` (the decode step, everything
    `generate` does per token included, the prefill not)."""

    def probe() -> float:
        clock = _TokenClock()
        target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens, do_sample=False, stopping_criteria=StoppingCriteriaList([clock]),
                        **path)
        return statistics.median(later - earlier for earlier, later in zip(clock.times, clock.times[1:]))

    return probe


def _other_probe(target, draft: Eagle3DraftModel, prompt: torch.Tensor, shape: TreeSettings, new_tokens: int,
                 path: dict) -> Callable[[], float]:
    """A probe: the seconds per cycle an EAGLE-3 `generate` with `shape` spends outside drafting and verification."""

    def probe() -> float:
        stats = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, assistant_model=draft,
                                tree_depth=shape.depth, tree_top_k=shape.top_k, tree_total_tokens=shape.total_tokens,
                                return_dict_in_generate=True, **path).eagle3_stats
        return max(stats.other_seconds, 0.0) / max(stats.num_cycles, 1)

    return probe


@torch.no_grad()
def measure_costs(
    target, draft: Eagle3DraftModel, profile: list[dict], prefix_length: int = CALIBRATION_PREFIX,
    rounds: int = CALIBRATION_ROUNDS, batch_size: int = 1, compile_config=None, static_length: int | None = None,
) -> MachineCosts:
    """Measure, on this machine, everything `predict` needs for the shapes of `profile` at `batch_size`, on the eager
    path or the one compiled with `compile_config`, through a dynamic cache or a static one of `static_length`
    entries: every cost in `rounds` interleaved rounds after a warm-up round, medians, and the spread of the
    prediction they make (about twenty seconds for SmolLM2-135M on two quiet CPU cores at batch size 1, eager). The
    draft's work is measured for one row: rows draft one after another. A static cache too short for the prefix, the
    largest tree and a plain round shortens the prefix, and is lengthened where even that is not enough."""
    draft.attach_target(target)
    shapes = [shape for shape, _ in profile_shapes(profile)]
    sizes = sorted({1} | {shape.total_tokens + 1 for shape in shapes})
    if static_length is not None:
        static_length = max(static_length, max(sizes) + CALIBRATION_NEW_TOKENS + 1)
        prefix_length = min(prefix_length, static_length - max(sizes) - CALIBRATION_NEW_TOKENS)
    path = path_generate_kwargs(compile_config, static_length)
    tree_shapes = {(shape.depth, shape.top_k): shape for shape in shapes}  # the draft's work ignores the size
    vocab_size = target.config.get_text_config().vocab_size

    def prompt(length: int) -> torch.Tensor:
        return torch.randint(0, vocab_size, (batch_size, length), device=target.device)

    static = static_length is not None or compile_config is not None  # a step that depends on the cache's length
    contexts = [prefix_length] if static else sorted({prefix_length, *PLAIN_CONTEXTS})
    typical = sorted(shapes, key=lambda shape: shape.total_tokens)[len(shapes) // 2]
    probes = {("plain", context): _plain_step_probe(target, prompt(context), CALIBRATION_NEW_TOKENS, path)
              for context in contexts}
    probes["other"] = _other_probe(target, draft, prompt(prefix_length), typical, CALIBRATION_NEW_TOKENS, path)
    probes |= {("verify", n): probe for n, probe in _verification_probes(
        target, sizes, prefix_length, draft.config.target_layer_ids, batch_size, compile_config,
        static_length).items()}
    probes |= {("draft", shape): probe for shape, probe in _drafting_probes(
        draft, list(tree_shapes.values()), 2, prefix_length, batch_size).items()}
    samples = _interleaved(probes, rounds)

    def costs_of(pick: Callable[[list[float]], float]) -> MachineCosts:
        return MachineCosts(
            machine=machine_description(target.device),
            plain_step=max(pick(samples["plain", prefix_length]), SECONDS_RANGE[0]),
            plain_steps={context: max(pick(samples["plain", context]), SECONDS_RANGE[0])
                         for context in contexts} if len(contexts) > 1 else {},
            verify={n: max(pick(samples["verify", n]), SECONDS_RANGE[0]) for n in sizes},
            draft={key: max(pick(samples["draft", shape]), SECONDS_RANGE[0])
                   for key, shape in tree_shapes.items()},
            other=pick(samples["other"]),
        )

    costs = costs_of(statistics.median)
    # The spread that matters: of the predicted speedup of the shape the medians choose, round by round
    best = predict(profile, costs, ngram_candidates=True)[0].settings
    speedups = [prediction.tokens_per_second * round_costs.plain_step
                for round_costs in (costs_of(lambda times, r=r: times[r]) for r in range(rounds))
                for prediction in predict(profile, round_costs, ngram_candidates=True) if prediction.settings == best]
    return replace(costs, spread=_spread(speedups))


def calibration_key(target, draft: Eagle3DraftModel, batch_size: int = 1, compile_config=None,
                    static_length: int | None = None) -> dict:
    """Everything the measured costs depend on: the machine, the software, the target and the draft (shape, weights
    and weight layout), the dtype, the device, the torch thread count, the batch size, eager or compiled, a static
    cache's length, and the way of measuring."""
    return {
        "method": CALIBRATION_METHOD,
        "machine": machine_description(target.device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(target.device),
        "threads": torch.get_num_threads(),
        "dtype": str(target.dtype),
        "attention": attention_implementation(target.config),
        "target": model_fingerprint(target),
        "target_layout": weight_layout(target),
        "draft": digest(draft.config.to_dict()),
        "draft_weights": tensor_digest(draft.fc.weight),
        "draft_dtype": str(draft.fc.weight.dtype),
        "draft_layout": weight_layout(draft),
        "batch_size": batch_size,
        "compiled": None if compile_config is None else {
            name: getattr(compile_config, name, None) for name in ("fullgraph", "dynamic", "backend", "mode")},
        "static_length": static_length,
    }


def calibration_path(key: dict) -> Path:
    return cache_dir() / "calibration" / f"{digest(key)}.json"


def read_record(path: Path, key: dict, profile: list[dict]) -> MachineCosts | None:
    """The costs cached at `path` for `key`, or `None`: no record, a record of another key (measured again quietly),
    or one that is unreadable or invalid for `profile` (reported once, naming the file and what to do)."""
    if not path.is_symlink() and not path.exists():
        return None
    try:
        if path.is_symlink() or not path.is_file():
            raise ValueError(f"it is a {'symbolic link' if path.is_symlink() else 'directory'}, not a file")
        if path.stat().st_size > MAX_RECORD_BYTES:
            raise ValueError(f"it is larger than a record ({path.stat().st_size} bytes)")
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or "key" not in record or "costs" not in record:
            raise ValueError("it is not an object with a key and costs")
        if record["key"] != key:
            return None
        costs = MachineCosts.from_json(record["costs"])
        missing = _missing_costs(profile, costs)
        if missing:
            raise ValueError(f"it lacks {', '.join(missing[:4])}")
        return costs
    except (OSError, ValueError, TypeError, AttributeError, RecursionError) as error:
        logger.warning_once(f"hf_eagle3: ignoring the calibration record {path}: {error}. The costs are measured "
                            "again now; if this repeats, delete the file or run `hf-eagle3 tune-tree --recalibrate`.")
        return None


def write_record(path: Path, key: dict, costs: MachineCosts) -> bool:
    """Write `costs` for `key` to `path` atomically (a killed or concurrent run never leaves half a file, a failed
    write no `.partial` file). A failure is reported once, with the fix; returns whether the record was written."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({"key": key, "costs": costs.to_json()}, indent=1))
        partial.replace(path)
        return True
    except OSError as error:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        logger.warning_once(
            f"hf_eagle3: cannot write the calibration record {path} ({error.strerror or error}): the costs measured "
            "now are kept for this process only. Set HF_EAGLE3_CACHE to a writable folder with free space (or remove "
            "what is in the record's place) to keep them.")
        return False


def correct_calibration(choice: TreeChoice, measured_cycle: float, measured_plain_step: float) -> MachineCosts | None:
    """Move the record `choice` was predicted from halfway (`CORRECTION_WEIGHT`, in log scale) toward what a call
    decoding with its shape measured: `measured_cycle` seconds per cycle, and plain decoding's step in the same call
    (`measured_plain_step`; `online.OnlineCheck`'s trial). Its `speed_scale` moves toward the measured step over the
    predicted one, its `cycle_scale` toward the measured cycles against the measured step over the predicted ones
    against the predicted step. The next call predicts with it and measures nothing. A record consistently wrong is
    mended within a few calls (its error halves at each), one call at a noisy moment moves it by half its error at
    most, and every shape alike. A record that no longer holds the costs `choice` read (measured again meanwhile) is
    left as it is. Returns the corrected costs (`None`: nothing corrected); written where the record was, or kept in
    memory for the process where it cannot be."""
    costs, shape, path = choice.costs, choice.settings, choice.path
    if costs is None or shape is None or path is None:
        return None
    predicted_cycle, predicted_step = sum(costs.cycle_parts(shape).values()), choice.plain_step
    cycle, step = max(measured_cycle, SECONDS_RANGE[0]), max(measured_plain_step, SECONDS_RANGE[0])

    def moved(name: str, ratio: float) -> float:
        low, high = SCALE_RANGE[name]
        return min(max(getattr(costs, name) * ratio ** CORRECTION_WEIGHT, low), high)

    corrected = replace(costs, speed_scale=moved("speed_scale", step / predicted_step),
                        cycle_scale=moved("cycle_scale", (cycle / step) / (predicted_cycle / predicted_step)))
    if path in _KEPT_IN_MEMORY:
        if _KEPT_IN_MEMORY[path] != costs:
            return None
        _KEPT_IN_MEMORY[path] = corrected
        return corrected
    try:
        record = json.loads(path.read_text())
        if MachineCosts.from_json(record["costs"]) != costs:
            return None
    except (OSError, ValueError, TypeError, KeyError, RecursionError):
        return None  # gone or damaged since it was read: the next call measures again and says so
    if not write_record(path, record["key"], corrected):
        _KEPT_IN_MEMORY[path] = corrected
    return corrected


def calibrate(target, draft: Eagle3DraftModel, batch_size: int = 1, compile_config=None,
              static_length: int | None = None, recalibrate: bool = False,
              measure: Callable[..., MachineCosts] = measure_costs) -> tuple[MachineCosts, Path]:
    """This machine's costs for `target` and `draft` at `batch_size` on the eager path or the one compiled with
    `compile_config`, through a dynamic cache or a static one of `static_length` entries (`measure`, by default
    `measure_costs`), measured once and then read from the cache file
    (returned too) for as long as nothing they depend on changes (`calibration_key`); `recalibrate` measures again
    and replaces the record. A noisy measurement (`MAX_SPREAD`) is taken again once, and a noisy record measured
    again once per process; costs that could not be written, or stayed noisy, are kept in memory for the process."""
    profile = draft.config.acceptance_profile
    if not profile:
        raise ValueError(
            "tree_shape='auto' needs the draft's acceptance profile, which this draft's config does not record: run "
            "`hf-eagle3 tune-tree --draft DIR --save-to DIR` once, or pass tree_depth / tree_top_k / "
            "tree_total_tokens."
        )
    problem = profile_problem(profile, draft.config.draft_vocab_size)
    if problem:
        raise ValueError(f"{problem}: record the profile again with `hf-eagle3 tune-tree --save-to DIR`.")
    key = calibration_key(target, draft, batch_size, compile_config, static_length)
    path = calibration_path(key)
    if not recalibrate:
        if path in _KEPT_IN_MEMORY:
            return _KEPT_IN_MEMORY[path], path
        costs = read_record(path, key, profile)
        if costs is not None and costs.spread <= MAX_SPREAD:
            return costs, path
    logger.warning(
        f"Calibrating tree_shape='auto' for this machine (batch size {batch_size}"
        f"{', compiled' if compile_config is not None else ''}): measuring decode steps, verifications and drafting "
        f"of {len(profile)} profiled shapes, once; on a busy 2-core CPU this takes one to four minutes for a "
        f"135M-parameter target (more with larger batches, targets or compilation), then {path} is reused."
    )
    for _ in range(2):
        costs = measure(target, draft, profile, batch_size=batch_size, compile_config=compile_config,
                        static_length=static_length)
        if costs.spread <= MAX_SPREAD:
            break
    if write_record(path, key, costs) and costs.spread <= MAX_SPREAD:
        _KEPT_IN_MEMORY.pop(path, None)
    else:
        _KEPT_IN_MEMORY[path] = costs
    return costs, path


def choose_tree(
    target, draft: Eagle3DraftModel, ngram_candidates: bool | None = None, batch_size: int = 1, compile_config=None,
    static_length: int | None = None, context_length: float | None = None,
) -> TreeChoice:
    """The predicted-fastest tree shape for `target` and `draft` on this machine at `batch_size` (on the path compiled
    with `compile_config`, if any, through a static cache of `static_length` entries, if any; for a call decoding
    with `context_length` tokens cached on average, where known), with context n-gram
    candidates in the tree or without (default: the draft's `ngram_candidates`), or none (decode plainly) when no
    shape is predicted to beat plain decoding by `MIN_PREDICTED_SPEEDUP`, when the profile is unusable, the
    measurement too noisy or the prediction absurd."""
    if ngram_candidates is None:
        ngram_candidates = draft.config.ngram_candidates
    profile = draft.config.acceptance_profile
    problem = profile and profile_problem(profile, draft.config.draft_vocab_size)
    if problem:
        reason = (f"EAGLE-3 decodes plainly: {problem}. Record the profile again with `hf-eagle3 tune-tree --save-to "
                  "DIR`, or pass tree_depth / tree_top_k / tree_total_tokens.")
        return TreeChoice(None, 1.0, reason, None, [])
    costs, path = calibrate(target, draft, batch_size, compile_config, static_length)
    predictions = predict(profile, costs, ngram_candidates)
    if not predictions:
        raise ValueError(
            "tree_shape='auto' without context n-gram candidates needs acceptance-profile rows measured without them; "
            "this draft's were all measured with them: run `hf-eagle3 tune-tree --no-ngram-candidates --save-to DIR`, "
            "or pass ngram_candidates=True or tree_depth / tree_top_k / tree_total_tokens."
        )
    best = predictions[0]
    plain_step = costs.plain_step_at(context_length)
    speedup = best.tokens_per_second * plain_step
    tokens = best.settings.total_tokens
    shape = (f"depth {best.settings.depth}, top-k {best.settings.top_k}, {tokens} token{'s' * (tokens > 1)}"
             + (", context n-gram candidates" if ngram_candidates else ""))
    batch = f", batch size {batch_size}" if batch_size > 1 else ""
    compiled = (", compiled" if compile_config is not None else "") + (
        f", a static cache of {static_length}" if static_length is not None else "")
    context = f" after {context_length:.0f} cached tokens" if context_length is not None and costs.plain_steps else ""
    parts = costs.cycle_parts(best.settings)
    scaled = (f" (as calls found them: the machine at {costs.speed_scale:.2f}x the measured costs, the cycles at "
              f"{costs.cycle_scale:.2f}x theirs against plain decoding)"
              if (costs.speed_scale, costs.cycle_scale) != (1, 1) else "")
    measured = (f"on {costs.machine}, {target.dtype}, {torch.get_num_threads()} threads{batch}{compiled}: a decode "
                f"step takes {1000 * plain_step:.1f} ms{context}, verifying {best.settings.total_tokens + 1} tokens "
                f"{1000 * parts['verify']:.1f} ms, drafting {1000 * parts['draft']:.1f} ms{scaled}")
    force = "Pass tree_depth / tree_top_k / tree_total_tokens to force a tree."
    if costs.spread > MAX_SPREAD:
        reason = (f"EAGLE-3 decodes plainly here: this machine was too noisy to calibrate (costs spread by "
                  f"{costs.spread:.0%} over the measurement's rounds, twice; at most {MAX_SPREAD:.0%} is trusted), "
                  f"measured twice. Run `hf-eagle3 tune-tree --recalibrate` when it is quieter. {force}")
        return TreeChoice(None, 1.0, reason, costs, predictions, path, context_length)
    if not MIN_PREDICTED_SPEEDUP <= speedup <= MAX_PREDICTED_SPEEDUP:  # also false for nan
        if speedup > MAX_PREDICTED_SPEEDUP or not math.isfinite(speedup):
            why = (f"its prediction, {speedup:.3g}x, is not believable (the record {path} must be damaged: run "
                   "`hf-eagle3 tune-tree --recalibrate`)")
        else:
            why = f"it is predicted at {speedup:.2f}x plain decoding ({measured})"
        reason = (f"EAGLE-3 decodes plainly here: the fastest tree ({shape}, τ {best.tau:.2f}) is not used: {why}. "
                  f"{force}")
        return TreeChoice(None, 1.0, reason, costs, predictions, path, context_length)
    reason = f"tree {shape} (τ {best.tau:.2f}) predicted at {speedup:.2f}x plain decoding ({measured})"
    return TreeChoice(best.settings, speedup, reason, costs, predictions, path, context_length)
