"""The draft tree's shape for the machine at hand: what each shape costs here, measured, combined with the draft's
acceptance profile into a predicted speed for every shape.

A tree shape (depth `D`, top-k `K`, `N` drafted tokens) decodes

    τ(D, K, N) / (t_draft(D, K) + t_verify(N + 1) + t_other)

tokens per second, against `1 / t_plain` for plain decoding. τ belongs to the draft and its target (the draft's
*acceptance profile*, `Eagle3Config.acceptance_profile`, recorded by `hf-eagle3 tune-tree`): it does not depend on
the hardware. The times do, a lot: a 13-token verification costs 1.1 decode steps on a CPU with AMX and 2.6 on one
without, and bfloat16 is several times slower than float32 where the CPU has no bf16 matrix unit. So they are
measured where decoding runs, for the dtype, device, thread count and batch size in use (`measure_costs`, about ten
seconds), and cached under `$HF_EAGLE3_CACHE/calibration`, keyed by everything they depend on (`calibrate`).

A batch of `B` rows verifies every row's tree in one forward of `B (N + 1)` tokens and drafts row after row, so the
costs of a batch are measured at its size: a forward's cost grows with `B (N + 1)`, and on a CPU a large batch can
leave no room for a tree at all. Rows decode independently, so a batch emits `B τ` tokens per cycle against `B` per
plain step: the prediction above holds with the batch's costs.

`choose_tree` picks the predicted-fastest shape, or none when no shape is predicted to beat plain decoding by
`MIN_PREDICTED_SPEEDUP`: `generate(..., tree_shape="auto")` then decodes plainly.
"""

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache

from ..modeling_eagle3 import Eagle3DraftModel
from ..utils.cache import cache_dir
from ..utils.fingerprint import digest, model_fingerprint, tensor_digest
from .compatibility import SPECIAL_TOKENS
from .drafter import Eagle3Drafter, TreeSettings
from .tree import tree_attention_mask

# A shape must be predicted this much faster than plain decoding to be used: predictions are within about 10 % of
# measured speed, and "auto" must never be slower than plain decoding.
MIN_PREDICTED_SPEEDUP = 1.05
CALIBRATION_PREFIX = 160  # cached tokens the costs are measured after: a prompt and part of an answer
CPU_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")  # what decides a CPU's float32 / bfloat16 speed


def machine_description(device: torch.device | str = "cpu") -> str:
    """The processor decoding runs on, with the instruction-set flags that decide its speed."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model, flags = platform.processor() or platform.machine(), set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
        present = [flag for flag in CPU_FLAGS if flag in flags]
        return f"{model} ({', '.join(present) if present else 'none of ' + ', '.join(CPU_FLAGS)})"
    return model


@dataclass(frozen=True)
class MachineCosts:
    """Seconds, measured on one machine for one target, draft, dtype, thread count and batch size.

    `plain_step`: one token per row of plain greedy `generate`; `verify[n]`: one target forward over `n` tokens per
    row (a tree of `n - 1` nodes and its root); `draft[(depth, top_k)]`: the draft's work in one cycle, every row;
    `other`: the rest of a cycle (acceptance, cache compaction, bookkeeping).
    """

    machine: str
    plain_step: float
    verify: dict[int, float]
    draft: dict[tuple[int, int], float]
    other: float

    def to_json(self) -> dict:
        return asdict(self) | {"draft": [[*shape, seconds] for shape, seconds in self.draft.items()]}

    @classmethod
    def from_json(cls, record: dict) -> "MachineCosts":
        return cls(
            machine=record["machine"],
            plain_step=record["plain_step"],
            verify={int(n): seconds for n, seconds in record["verify"].items()},
            draft={(depth, top_k): seconds for depth, top_k, seconds in record["draft"]},
            other=record["other"],
        )


@dataclass(frozen=True)
class ShapePrediction:
    settings: TreeSettings
    tau: float  # tokens per target forward, from the acceptance profile
    cycle_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tau / self.cycle_seconds


@dataclass(frozen=True)
class TreeChoice:
    """What `choose_tree` decided: `settings` (None: decode plainly), why, and every shape's prediction."""

    settings: TreeSettings | None
    predicted_speedup: float  # of the chosen shape over plain decoding (1.0 when decoding plainly)
    reason: str
    costs: MachineCosts
    predictions: list[ShapePrediction]


def profile_shapes(profile: list[dict], ngram_candidates: bool | None = None) -> list[tuple[TreeSettings, float]]:
    """(shape, τ) of the rows of an acceptance profile measured with context n-gram candidates in the tree or without
    (`ngram_candidates`; `None`: every row)."""
    return [(TreeSettings(row["tree_depth"], row["tree_top_k"], row["tree_total_tokens"]), row["tau"])
            for row in profile
            if ngram_candidates is None or row.get("ngram_candidates", False) == ngram_candidates]


def predict(profile: list[dict], costs: MachineCosts, ngram_candidates: bool = False) -> list[ShapePrediction]:
    """The predicted speed on the measured machine of every profiled shape, fastest first. With `ngram_candidates`,
    a shape's τ is the one profiled with context candidates in the tree, or, for shapes profiled only without them,
    that one (a lower bound: the candidates share the same token budget)."""
    taus = dict(profile_shapes(profile, False))
    if ngram_candidates:
        taus |= dict(profile_shapes(profile, True))
    predictions = [
        ShapePrediction(shape, tau, costs.draft[shape.depth, shape.top_k] + costs.verify[shape.total_tokens + 1]
                        + costs.other)
        for shape, tau in taus.items()
    ]
    return sorted(predictions, key=lambda prediction: -prediction.tokens_per_second)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def verification_cost(
    target, sizes: list[int], prefix_length: int = CALIBRATION_PREFIX, repetitions: int = 5,
    layer_ids: list[int] | None = None, batch_size: int = 1,
) -> dict[int, float]:
    """Median seconds of one target forward over `n` new tokens per row of `batch_size` after a cached
    `prefix_length`-token prefix, for each `n` in `sizes`, as verification runs it (a 4D tree mask; the hidden states
    at `layer_ids`), interleaved repetitions after a warm-up of every size."""
    device = target.device
    vocab_size = target.config.get_text_config().vocab_size
    cache = DynamicCache()
    target(torch.randint(0, vocab_size, (batch_size, prefix_length), device=device), cache=cache)
    prefix_visible = torch.ones(prefix_length, dtype=torch.bool, device=device)
    seconds = {n: [] for n in sizes}
    for repetition in range(repetitions + 1):
        for n in sizes:
            chain = torch.ones(n, n, dtype=torch.bool, device=device).tril()  # any tree's mask costs the same
            mask = tree_attention_mask(chain, prefix_visible, target.dtype).expand(batch_size, -1, -1, -1)
            tokens = torch.randint(0, vocab_size, (batch_size, n), device=device)
            positions = torch.arange(prefix_length, prefix_length + n, device=device)[None].expand(batch_size, -1)
            start = time.perf_counter()
            target(input_ids=tokens, position_ids=positions, attention_mask=mask, cache=cache,
                   output_hidden_states=layer_ids, use_cache=True)
            _synchronize(device)
            if repetition:  # the first round only warms up
                seconds[n].append(time.perf_counter() - start)
            cache.crop(-n)
    return {n: statistics.median(times) for n, times in seconds.items()}


@torch.no_grad()
def drafting_cost(
    draft: Eagle3DraftModel, shapes: list[TreeSettings], accepted_per_cycle: int = 2,
    prefix_length: int = CALIBRATION_PREFIX, repetitions: int = 5,
) -> dict[TreeSettings, float]:
    """Median seconds the draft spends per cycle with each tree shape (interleaved repetitions after a warm-up):
    feeding `accepted_per_cycle` verified positions, then growing the tree (the draft's embedding must be attached)."""
    device, dtype = draft.device, draft.fc.weight.dtype
    vocab_size, feature_size = draft.config.vocab_size, 3 * draft.config.target_hidden_size
    drafters = {shape: Eagle3Drafter(draft, shape) for shape in shapes}
    for drafter in drafters.values():
        drafter.extend(torch.randint(0, vocab_size, (1, prefix_length), device=device),
                       torch.randn(1, prefix_length, feature_size, device=device, dtype=dtype),
                       torch.arange(prefix_length, device=device)[None])
    positions = torch.arange(prefix_length, prefix_length + accepted_per_cycle, device=device)[None]
    seconds = {shape: [] for shape in shapes}
    for repetition in range(repetitions + 1):
        for shape, drafter in drafters.items():
            tokens = torch.randint(0, vocab_size, (1, accepted_per_cycle), device=device)
            features = torch.randn(1, accepted_per_cycle, feature_size, device=device, dtype=dtype)
            start = time.perf_counter()
            drafter.extend(tokens, features, positions)
            drafter.draft_tree(tokens[0, -1], prefix_length + accepted_per_cycle)
            _synchronize(device)
            if repetition:  # the first round only warms up
                seconds[shape].append(time.perf_counter() - start)
            drafter.num_verified = prefix_length  # the next extend drops this cycle's entries
    return {shape: statistics.median(times) for shape, times in seconds.items()}


@torch.no_grad()
def _generate_seconds(target, prompt: torch.Tensor, new_tokens: int, repetitions: int, **kwargs) -> float:
    """Median seconds of a greedy `generate` of exactly `new_tokens` tokens after `prompt` (after a warm-up run)."""
    runs = []
    for repetition in range(repetitions + 1):
        start = time.perf_counter()
        target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens, do_sample=False, **kwargs)
        if repetition:
            runs.append(time.perf_counter() - start)
    return statistics.median(runs) if runs else 0.0


def measure_costs(
    target, draft: Eagle3DraftModel, profile: list[dict], prefix_length: int = CALIBRATION_PREFIX,
    repetitions: int = 5, batch_size: int = 1,
) -> MachineCosts:
    """Measure, on this machine, everything `predict` needs for the shapes of `profile` at `batch_size` (about ten
    seconds for SmolLM2-135M on two CPU cores at batch size 1). The draft's work is measured for one row: rows draft
    one after another."""
    draft.attach_target(target)
    shapes = [shape for shape, _ in profile_shapes(profile)]
    sizes = sorted({1} | {shape.total_tokens + 1 for shape in shapes})
    verify = verification_cost(target, sizes, prefix_length, repetitions, draft.config.target_layer_ids, batch_size)
    tree_shapes = {(shape.depth, shape.top_k): shape for shape in shapes}  # the draft's work ignores the size
    draft_seconds = drafting_cost(draft, list(tree_shapes.values()), prefix_length=prefix_length,
                                  repetitions=repetitions)
    # Plain decoding's step and a cycle's remainder, from real generate calls over a random prompt
    vocab_size = target.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab_size, (batch_size, prefix_length), device=target.device)
    new_tokens = 24
    prefill = _generate_seconds(target, prompt, 1, 3)
    plain = _generate_seconds(target, prompt, 1 + new_tokens, 3)
    typical = sorted(shapes, key=lambda shape: shape.total_tokens)[len(shapes) // 2]
    stats = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens, do_sample=False, assistant_model=draft, tree_depth=typical.depth,
                            tree_top_k=typical.top_k, tree_total_tokens=typical.total_tokens,
                            return_dict_in_generate=True).eagle3_stats
    return MachineCosts(
        machine=machine_description(target.device),
        plain_step=max(plain - prefill, 1e-9) / new_tokens,
        verify=verify,
        draft={key: batch_size * draft_seconds[shape] for key, shape in tree_shapes.items()},
        other=stats.other_seconds / max(stats.num_cycles, 1),
    )


def calibration_key(target, draft: Eagle3DraftModel, batch_size: int = 1) -> dict:
    """Everything the measured costs depend on: the machine, the software, the target and the draft (shape and
    weights), the dtype, the device, the torch thread count and the batch size."""
    return {
        "machine": machine_description(target.device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(target.device),
        "threads": torch.get_num_threads(),
        "dtype": str(target.dtype),
        "attention": target.config._attn_implementation,
        "target": model_fingerprint(target),
        # less the target's special-token ids, which the draft's first `generate` records in its config
        "draft": digest({name: value for name, value in draft.config.to_dict().items() if name not in SPECIAL_TOKENS}),
        "draft_weights": tensor_digest(draft.fc.weight),
        "draft_dtype": str(draft.fc.weight.dtype),
        "batch_size": batch_size,
    }


def calibration_path(key: dict) -> Path:
    return cache_dir() / "calibration" / f"{digest(key)}.json"


def calibrate(target, draft: Eagle3DraftModel, batch_size: int = 1) -> tuple[MachineCosts, Path]:
    """This machine's costs for `target` and `draft` at `batch_size` (see `measure_costs`), measured once and then
    read from the cache file (returned too) for as long as nothing they depend on changes (`calibration_key`)."""
    if not draft.config.acceptance_profile:
        raise ValueError(
            "tree_shape='auto' needs the draft's acceptance profile, which this draft's config does not record: run "
            "`hf-eagle3 tune-tree --draft DIR --save-to DIR` once, or pass tree_depth / tree_top_k / "
            "tree_total_tokens."
        )
    key = calibration_key(target, draft, batch_size)
    path = calibration_path(key)
    if path.is_file():
        record = json.loads(path.read_text())
        if record.get("key") == key:
            return MachineCosts.from_json(record["costs"]), path
    costs = measure_costs(target, draft, draft.config.acceptance_profile, batch_size=batch_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps({"key": key, "costs": costs.to_json()}, indent=1))
    partial.replace(path)  # atomic: a concurrent or killed run never leaves half a file
    return costs, path


def choose_tree(
    target, draft: Eagle3DraftModel, ngram_candidates: bool | None = None, batch_size: int = 1
) -> TreeChoice:
    """The predicted-fastest tree shape for `target` and `draft` on this machine at `batch_size`, with context n-gram
    candidates in the tree or without (default: the draft's `ngram_candidates`), or none (decode plainly) when no
    shape is predicted to beat plain decoding by `MIN_PREDICTED_SPEEDUP`."""
    if ngram_candidates is None:
        ngram_candidates = draft.config.ngram_candidates
    costs, _ = calibrate(target, draft, batch_size)
    predictions = predict(draft.config.acceptance_profile, costs, ngram_candidates)
    if not predictions:
        raise ValueError(
            "tree_shape='auto' without context n-gram candidates needs acceptance-profile rows measured without them; "
            "this draft's were all measured with them: run `hf-eagle3 tune-tree --no-ngram-candidates --save-to DIR`, "
            "or pass ngram_candidates=True or tree_depth / tree_top_k / tree_total_tokens."
        )
    best = predictions[0]
    speedup = best.tokens_per_second * costs.plain_step
    shape = (f"depth {best.settings.depth}, top-k {best.settings.top_k}, {best.settings.total_tokens} tokens"
             + (", context n-gram candidates" if ngram_candidates else ""))
    batch = f", batch size {batch_size}" if batch_size > 1 else ""
    measured = (f"on {costs.machine}, {target.dtype}, {torch.get_num_threads()} threads{batch}: a decode step takes "
                f"{1000 * costs.plain_step:.1f} ms, verifying {best.settings.total_tokens + 1} tokens "
                f"{1000 * costs.verify[best.settings.total_tokens + 1]:.1f} ms, drafting "
                f"{1000 * costs.draft[best.settings.depth, best.settings.top_k]:.1f} ms")
    if speedup < MIN_PREDICTED_SPEEDUP:
        reason = (f"EAGLE-3 decodes plainly here: the fastest tree ({shape}, τ {best.tau:.2f}) is predicted at "
                  f"{speedup:.2f}x plain decoding ({measured}). Pass tree_depth / tree_top_k / tree_total_tokens to "
                  "force a tree.")
        return TreeChoice(None, 1.0, reason, costs, predictions)
    reason = f"tree {shape} (τ {best.tau:.2f}) predicted at {speedup:.2f}x plain decoding ({measured})"
    return TreeChoice(best.settings, speedup, reason, costs, predictions)
