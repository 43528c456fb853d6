"""`hf-eagle3 bench`: speedup, acceptance length and per-position acceptance of EAGLE-3 against what a user would pick
instead (plain `generate`, prompt-lookup decoding, plain decoding with a static cache and `torch.compile`), measured
right.

Every method runs once on the first prompt of every set before anything is timed (kernel selection for each new
shape can cost many times a normal forward). Then, for each prompt, the methods run back to back, `repetitions`
times, and each method's time on that prompt is the median of its repetitions. Speedup of a method on a prompt is
its tokens per second over plain decoding's (new tokens / seconds, prefill included); a set's speedup is the median
over its prompts. In bfloat16 two methods can part at a near-tie and end their answers at different lengths, so their
times alone would compare unequal work. Greedy outputs are compared with plain
decoding as they come, and every mismatch is reported with where the outputs part and how far apart the two tokens
were in the target's logits there, as plain decoding and as the method computed them.

Why bf16 can part where float32 never does: plain decoding runs the target on one new token per forward, a method that
verifies several tokens per forward (EAGLE-3, and transformers' prompt lookup alike) scores each of them over a longer,
masked key sequence, and the attention kernel's reductions depend on that layout (on our CPU the bf16 matrix
multiplications give each row the same result whatever the number of rows; attention does not). In bf16 the logits
then differ by up to about 1 (a few units of bf16 resolution at their magnitude), so greedy decoding can take the other
branch of a near-tie. Such a mismatch is a *near-tie* when the two computations disagree on the gap between
the two tokens by at most `NEAR_TIE_LOGITS[dtype]`; any other mismatch is an error. EAGLE-3 methods named with `+exact`
verify with `exact_attention=True` (each node attends exactly as plain decoding would), which removes the difference
where the rest of the layer is row-invariant, as on CPU.

`plain:DTYPE` decodes plainly with a copy of the target in another dtype (what a user who never changed the dtype
gets), and every `auto` method records what the calibration predicted for it next to what it measured: the
predicted speedup (from the acceptance profile's τ for the set, where the profile holds τ per set, else over all its
prompts) and the speedup the cost model gives at the τ measured on the set, which separates an error of the machine
costs from a set whose τ differs from the profile's.

The engines users deploy (vLLM, llama.cpp, OpenVINO GenAI) join as methods, each in a process of its own, greedy and
in float32, their EAGLE-3 checked against their own plain decoding (`bench_engines`).

`--cpu-layout` runs every method with the models' linear layers laid out by `hf_eagle3.optimize` (the layout
measured fastest here); with `--verification-cost` it measures the forwards in every layout instead, interleaved, and
tables them side by side.
"""

import argparse
import copy
import json
import statistics
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import CompileConfig

from ..configuration_eagle3 import MAX_TREE_DEPTH, MAX_TREE_TOKENS
from ..decoding.calibration import TreeChoice, choose_tree, machine_description, verification_cost
from ..decoding.cpu_layout import LAYOUTS, onednn_packs, optimize, standard_layout, weight_layout
from ..decoding.stats import CYCLE_PARTS, Eagle3RowStats
from ..engines import ENGINE_METHODS, engine_method
from ..modeling_eagle3 import Eagle3DraftModel
from ..publishing.results import settings_description
from ..resources.loading import PROMPT_SETS, add_model_arguments, load_models, load_prompt_set, prompt_set_packages
from ..utils.extras import require
from ..utils.fingerprint import draft_identity
from ..utils.options import MAX_NEW_TOKENS, MAX_PROMPTS, MAX_REPETITIONS, float_in, int_in
from ..utils.transformers_api import compile_on_every_device
from .bench_engines import EngineMethod, check_engine_methods, engine_entry, engine_record, start_engines

NEAR_TIE_LOGITS = {torch.float32: 1e-3, torch.float16: 1.0, torch.bfloat16: 1.0}


PLAIN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Static-cache room past the longest prompt and its answer, for EAGLE-3's last tree (any profiled one)
TREE_ROOM = 64


def compiled_kwargs(max_cache_len: int | None = None) -> dict:
    """`generate` settings for decoding with a static cache and `torch.compile`, transformers' own way
    (`CompileConfig`); on CPU, transformers compiles only when told to (`_compile_all_devices`). A `max_cache_len`
    that fits every prompt gives every call the same cache shape: one compilation for the whole benchmark (per tree
    size for EAGLE-3, which compiles its verification forward)."""
    compile_config = CompileConfig(fullgraph=False, dynamic=False, mode="default")
    compile_on_every_device(compile_config)
    return {"cache_implementation": "static", "compile_config": compile_config, "max_cache_len": max_cache_len}


@dataclass(frozen=True)
class Method:
    """One way of decoding: plain, prompt lookup, compiled plain, EAGLE-3 with a tree shape (`top_k == 1`: chain),
    with or without context n-gram candidates, or an engine's (`bench_engines`)."""

    name: str
    generate_kwargs: dict
    dtype: torch.dtype | None = None  # plain decoding with a copy of the target in this dtype (`plain:DTYPE`)

    @property
    def is_eagle3(self) -> bool:
        return "tree_top_k" in self.generate_kwargs or "tree_shape" in self.generate_kwargs

    @property
    def is_engine(self) -> bool:
        return engine_method(self.name) is not None

    @property
    def is_auto(self) -> bool:
        return self.generate_kwargs.get("tree_shape") == "auto"

    @property
    def path_baseline(self) -> str:
        """The plain decoding on this method's path, which `auto`'s calibration predicts its speedup over: `compiled`
        for a method verifying through the compiled forward, else `plain`."""
        return "compiled" if "compile_config" in self.generate_kwargs else "plain"


def methods_from_names(
    names: list[str], depth: int, top_k: int, total_tokens: int, max_cache_len: int | None = None
) -> list[Method]:
    """`plain`, `plain:DTYPE` (plain decoding with the target in `DTYPE`: float32, bfloat16 or float16),
    `prompt-lookup`, `compiled` (plain decoding with a static cache and `torch.compile`), `chain`, `tree`
    (the fixed shape `depth` x `top_k` x `total_tokens`), `tree:DEPTHxTOPKxTOTAL` for a tree of another shape, or
    `auto` (`tree_shape="auto"`: the shape calibrated for this machine, or plain decoding where no tree pays), or an
    engine's (`ENGINE_METHODS`: `vllm`, `vllm+eagle3`, ...); `compiled` methods size their static cache to
    `max_cache_len` tokens. An EAGLE-3 method decodes with the draft's `ngram_candidates` setting; the suffix `+ngram`
    puts context n-gram candidates in its trees, `-ngram` leaves them out, `+exact` verifies with
    `exact_attention=True`, and `+compiled` verifies as `compiled` decodes, with a static cache and `torch.compile`
    (suffixes in that order)."""
    methods = []
    for name in names:
        eagle3_name, compiled = name.removesuffix("+compiled"), name.endswith("+compiled")
        static = compiled_kwargs(max_cache_len) if compiled else {}
        eagle3_name, exact = eagle3_name.removesuffix("+exact"), eagle3_name.endswith("+exact")
        ngram = {}
        for suffix, enabled in (("+ngram", True), ("-ngram", False)):
            if eagle3_name.endswith(suffix):
                eagle3_name, ngram = eagle3_name.removesuffix(suffix), {"ngram_candidates": enabled}
        if name == "plain":
            methods.append(Method(name, {}))
        elif name.startswith("plain:") and name[6:] in PLAIN_DTYPES:
            methods.append(Method(name, {}, dtype=PLAIN_DTYPES[name[6:]]))
        elif name == "prompt-lookup":
            methods.append(Method(name, {"prompt_lookup_num_tokens": 10}))
        elif name == "compiled":
            methods.append(Method(name, compiled_kwargs(max_cache_len)))
        elif name in ENGINE_METHODS:
            methods.append(Method(name, {}))
        elif eagle3_name == "auto":
            methods.append(Method(name, {"tree_shape": "auto", "exact_attention": exact} | ngram | static))
        elif eagle3_name == "chain" or eagle3_name == "tree" or eagle3_name.startswith("tree:"):
            if eagle3_name == "chain":
                tree_depth, tree_top_k, tree_total = depth, 1, depth
            elif eagle3_name == "tree":
                tree_depth, tree_top_k, tree_total = depth, top_k, total_tokens
            else:
                tree_depth, tree_top_k, tree_total = (int(part) for part in eagle3_name[5:].split("x"))
            shape = {"tree_depth": tree_depth, "tree_top_k": tree_top_k, "tree_total_tokens": tree_total}
            methods.append(Method(name, shape | {"exact_attention": exact} | ngram | static))
        else:
            raise ValueError(
                f"Unknown method {name!r}: use plain, plain:float32 / plain:bfloat16 / plain:float16, prompt-lookup, "
                f"compiled, chain, tree, tree:DxKxN or auto (EAGLE-3 methods may end in +ngram or -ngram, then +exact "
                f"or +compiled), or an engine's: {', '.join(ENGINE_METHODS)}."
            )
    if methods[0].name != "plain":
        raise ValueError("The first method must be `plain`: speedups and output checks are measured against it.")
    return methods


def acceptance_by_position(acceptance_lengths: list[int], depth: int) -> list[float | None]:
    """n-α for n = 0..depth-1: the rate at which the n-th drafted token is accepted when the previous ones were."""
    accepted = [length - 1 for length in acceptance_lengths]  # drafted tokens accepted per cycle
    rates = []
    for position in range(depth):
        reached = sum(1 for count in accepted if count >= position)
        rates.append(sum(1 for count in accepted if count > position) / reached if reached else None)
    return rates


def cycles_ending_outside_vocabulary(new_tokens: torch.Tensor, acceptance_lengths: list[int],
                                     drafted: torch.Tensor, plain_cycles: list[int] = ()) -> int:
    """How many tree cycles ended on a token the draft cannot propose: the target's own token, a cycle's last, outside
    the draft vocabulary (`drafted`: the draft's `t2d`). `new_tokens` (`[T]`) are the call's; the cycles emitted all
    but the prefill's first; `plain_cycles` (indices) drafted nothing and do not count."""
    if not acceptance_lengths:
        return 0
    ends = torch.tensor(acceptance_lengths).cumsum(0) - 1 + (new_tokens.numel() - sum(acceptance_lengths))
    drafting = torch.ones(len(acceptance_lengths), dtype=torch.bool)
    drafting[list(plain_cycles)] = False
    return int((~drafted[new_tokens[ends[drafting]].to(drafted.device)]).sum())


def first_divergence(plain_output, output, prompt_length: int) -> dict:
    """Where greedy `output` leaves `plain_output` (both `GenerateDecoderOnlyOutput`s with `scores`), and each run's
    logit gap between the two tokens there.

    `plain_gap` is how much plain decoding's logits preferred its token, `method_gap` how much the method's preferred
    its own; their sum is the amount by which the two computations disagree (`None` when one output is a prefix of
    the other: a difference in stopping, never a near-tie).
    """
    plain_tokens, tokens = plain_output.sequences[0, prompt_length:], output.sequences[0, prompt_length:]
    common = min(len(plain_tokens), len(tokens))
    differing = (plain_tokens[:common] != tokens[:common]).nonzero()
    if len(differing) == 0:
        return {"position": common, "plain_gap": None, "method_gap": None, "disagreement": None}
    position = int(differing[0])
    plain_token, token = int(plain_tokens[position]), int(tokens[position])
    plain_logits, method_logits = plain_output.scores[position][0].float(), output.scores[position][0].float()
    plain_gap = float(plain_logits[plain_token] - plain_logits[token])
    method_gap = float(method_logits[token] - method_logits[plain_token])
    return {"position": position, "plain_token": plain_token, "token": token, "plain_gap": plain_gap,
            "method_gap": method_gap, "disagreement": plain_gap + method_gap}


def run_benchmark(
    target,
    draft: Eagle3DraftModel,
    prompt_sets: dict[str, list[torch.Tensor]],
    methods: list[Method],
    max_new_tokens: int,
    repetitions: int,
    sampling: dict | None = None,
    progress: bool = True,
    records_path: Path | None = None,
    engines: dict[str, EngineMethod] | None = None,
) -> dict:
    """Time every method on every prompt (interleaved); returns `{"summary": ..., "records": ...}`. Each prompt's
    records are also appended to `records_path` (JSON lines) as soon as they are measured. The engine methods
    decode in the processes of `engines` (`bench_engines.start_engines`), by method name; they time themselves."""
    from tqdm.auto import tqdm

    base_kwargs = {"max_new_tokens": max_new_tokens, **(sampling or {"do_sample": False})}
    greedy = not base_kwargs.get("do_sample", False)

    near_tie = NEAR_TIE_LOGITS.get(target.dtype, 1e-3)
    if greedy:  # every method keeps its scores alike, so a mismatch is diagnosed without a rerun
        base_kwargs.update(return_dict_in_generate=True, output_scores=True)

    # plain:DTYPE decodes with its own copy of the target (dtype and weights' layout as the target's otherwise)
    copies = {method.dtype: copy.deepcopy(target).to(method.dtype) for method in methods
              if method.dtype is not None and method.dtype != target.dtype}

    def decode(method: Method, input_ids: torch.Tensor):
        if method.is_engine:
            output = engines[method.name].runner.generate(input_ids[0].tolist(), max_new_tokens)
            return output.seconds, output, None
        assistant = {"assistant_model": draft} if method.is_eagle3 else {}
        model = copies.get(method.dtype, target)
        start = time.perf_counter()
        output = model.generate(input_ids, **base_kwargs, **method.generate_kwargs, **assistant)
        seconds = time.perf_counter() - start
        return seconds, output, draft.generation_stats if method.is_eagle3 else None

    # warm-up: every method on every set's first prompt, which compiles, calibrates `auto` on first use (a minute or
    # more on two cores) and fills the caches the timed runs then find
    warm_up = [(method, prompts[0]) for prompts in prompt_sets.values() for method in methods]
    for method, input_ids in tqdm(warm_up, disable=not progress, desc="warm-up (compiles and calibrates, untimed)"):
        decode(method, input_ids)
    # what the calibration (measured in the warm-up, cached) predicts for each `auto` method
    choices = {method.name: choose_tree(target, draft, method.generate_kwargs.get("ngram_candidates"), 1,
                                        method.generate_kwargs.get("compile_config"),
                                        method.generate_kwargs.get("max_cache_len"))
               for method in methods if method.is_auto}

    records, call_choices = [], {}

    def keep(record: dict) -> None:
        records.append(record)
        if records_path is not None:
            with open(records_path, "a") as file:
                file.write(json.dumps(record) + "\n")

    bar = tqdm(total=sum(len(p) for p in prompt_sets.values()), disable=not progress, desc="bench")
    for set_name, prompts in prompt_sets.items():
        for index, input_ids in enumerate(prompts):
            times = {method.name: [] for method in methods}
            outputs, stats = {}, {}
            for _ in range(repetitions):
                for method in methods:
                    seconds, outputs[method.name], stats[method.name] = decode(method, input_ids)
                    times[method.name].append(seconds)
            sequences = {method.name: outputs[method.name].sequences if greedy else outputs[method.name]
                         for method in methods if not method.is_engine}
            plain_output = outputs["plain"]
            for method in methods:
                if method.is_engine:
                    record = {"set": set_name, "prompt": index, "method": method.name,
                              "seconds": statistics.median(times[method.name]), "prompt_tokens": input_ids.shape[1]}
                    keep(record | engine_record(method.name, outputs, max_new_tokens, engines[method.name]))
                    continue
                new_tokens = sequences[method.name].shape[1] - input_ids.shape[1]
                record = {
                    "set": set_name,
                    "prompt": index,
                    "method": method.name,
                    "seconds": statistics.median(times[method.name]),
                    "new_tokens": new_tokens,
                    "prompt_tokens": input_ids.shape[1],
                    "identical_to_plain": torch.equal(sequences[method.name], sequences["plain"]),
                }
                if greedy and not record["identical_to_plain"]:
                    divergence = first_divergence(plain_output, outputs[method.name], input_ids.shape[1])
                    disagreement = divergence["disagreement"]
                    divergence["near_tie"] = disagreement is not None and disagreement <= near_tie
                    record["divergence"] = divergence
                if stats[method.name] is not None:
                    run = stats[method.name]
                    if run.choice is not None:  # the last repetition's, as the statistics below
                        call_choices[set_name, index, method.name] = run.choice
                    record.update(
                        acceptance_lengths=run.acceptance_lengths,
                        plain_cycles=run.plain_cycles,
                        ends_outside_vocabulary=cycles_ending_outside_vocabulary(
                            sequences[method.name][0, input_ids.shape[1]:], run.acceptance_lengths, draft.t2d,
                            run.plain_cycles),
                        prefill_seconds=run.prefill_seconds,
                        draft_seconds=run.draft_seconds,
                        verify_seconds=run.verify_seconds,
                        other_seconds=run.other_seconds,
                        continuation_tokens=run.continuation_tokens,
                        depth=run.settings.depth if run.settings else 0,
                        shape=(f"{run.settings.depth}x{run.settings.top_k}x{run.settings.total_tokens}"
                               if run.settings else "plain"),
                    )
                keep(record)
            bar.update()
    bar.close()
    return summarise(records, methods, greedy, choices, call_choices)


class Call(NamedTuple):
    """What `prediction_entry` reads of one timed `auto` call."""

    new_tokens: int
    prefill_seconds: float
    tau: float  # measured over the cycles that verified a drafted tree
    prompt_tokens: int
    prompt_set: str | None  # the set the prompt came from: the profile's τ for it is predicted, where it has one
    choice: TreeChoice | None = None  # the one the call decoded with (`Eagle3GenerationStats.choice`), where known
    plain_tokens: int = 0  # decoded plainly, one a target forward, where the online check found the tree slower


def prediction_entry(choice: TreeChoice, measured_speedup: float, calls: list[Call]) -> dict:
    """What the calibration predicted for an `auto` method against what it measured: `measured_speedup` is the calls'
    median speedup over plain decoding on the path calibrated (`Method.path_baseline`). Per call, from the choice the
    call decoded with (`choice` for a call that does not say: a call chooses for its own context, and after the online
    check corrected the record, from the corrected costs), the speedup predicted for its answer length after its
    prefill, at its context (`TreeChoice.call_speedup`), with the acceptance profile's τ for the call's prompt set
    (`ShapePrediction.tau_for`), and with the call's own τ and the tokens it decoded plainly; the medians over the
    calls, and the error of each."""
    choices = [call.choice or choice for call in calls]
    profile_taus = [call_choice.prediction.tau_for(call.prompt_set) if call_choice.prediction is not None else 1.0
                    for call, call_choice in zip(calls, choices)]
    predicted = statistics.median(
        call_choice.call_speedup(call.new_tokens, call.prefill_seconds, tau, call.prompt_tokens)
        for call, call_choice, tau in zip(calls, choices, profile_taus))
    at_measured_tau = statistics.median(
        call_choice.call_speedup(call.new_tokens, call.prefill_seconds, call.tau, call.prompt_tokens, call.plain_tokens)
        for call, call_choice in zip(calls, choices))
    cycles = [1000 * call_choice.prediction.cycle_seconds for call_choice in choices if call_choice.prediction]
    return {
        "predicted_speedup": predicted,
        # the calibration's for long answers, no prefill
        "decoding_speedup": statistics.median(call_choice.predicted_speedup for call_choice in choices),
        "predicted_tau": statistics.median(profile_taus),
        "predicted_cycle_ms": statistics.median(cycles) if cycles else None,
        "measured_tau": statistics.median(call.tau for call in calls),
        "predicted_speedup_at_measured_tau": at_measured_tau,
        "measured_speedup_over_path_plain": measured_speedup,
        "prediction_error": predicted / measured_speedup - 1,
        "cost_model_error": at_measured_tau / measured_speedup - 1,
    }


def _tokens_per_second(record: dict) -> float:
    """A timed call's new tokens over its seconds, prefill included."""
    return record["new_tokens"] / record["seconds"]


def summarise(records: list[dict], methods: list[Method], greedy: bool,
              choices: dict[str, TreeChoice] | None = None,
              call_choices: dict[tuple[str, int, str], TreeChoice] | None = None) -> dict:
    """Per set and method: median speedup, tokens/s, τ, n-α, time split, greedy mismatches; for `auto` methods whose
    calibration is in `choices` and whose path's plain decoding ran too (`Method.path_baseline`), its prediction
    (`prediction_entry`, from each call's own choice where `call_choices` has it by set, prompt and method) against
    the speedup over that."""
    choices, call_choices = choices or {}, call_choices or {}
    summary = {}
    for set_name in dict.fromkeys(record["set"] for record in records):
        speed_of = {name: {r["prompt"]: _tokens_per_second(r) for r in records
                           if r["set"] == set_name and r["method"] == name} for name in ("plain", "compiled")}
        for method in methods:
            rows = [r for r in records if r["set"] == set_name and r["method"] == method.name]
            entry = {
                "speedup": statistics.median(_tokens_per_second(r) / speed_of["plain"][r["prompt"]] for r in rows),
                "tokens_per_second": sum(r["new_tokens"] for r in rows) / sum(r["seconds"] for r in rows),
                "prompts": len(rows),
                # an engine's plain decoding, the reference of its EAGLE-3 method, is compared with nothing (None)
                "greedy_mismatches": [r["prompt"] for r in rows if greedy and r["identical_to_plain"] is False],
                "near_tie_mismatches": [r["prompt"] for r in rows if r.get("divergence", {}).get("near_tie")],
            }
            if method.is_engine:
                entry |= engine_entry(method.name, [r for r in records if r["set"] == set_name], _tokens_per_second)
            if method.is_eagle3:
                # τ, n-α and the rest over the cycles that verified a drafted tree: not the plain decoding steps of a
                # call the online check sent on plainly (records written before they were told apart hold none)
                calls_stats = [Eagle3RowStats(r["acceptance_lengths"], plain_cycles=r.get("plain_cycles", []))
                               for r in rows]
                lengths = [length for stats in calls_stats for length in stats.tree_acceptance_lengths]
                cycles = len(lengths)
                entry["shapes"] = sorted({r["shape"] for r in rows})
                # tree_shape="auto" decoded plainly: one token per target forward
                entry["tau"] = sum(lengths) / cycles if cycles else 1.0
                entry["plain_cycles"] = sum(len(stats.plain_cycles) for stats in calls_stats)
                baseline = speed_of[method.path_baseline]
                if method.name in choices and baseline:
                    calls = [Call(r["new_tokens"], r["prefill_seconds"],
                                  stats.mean_tree_acceptance_length or 1.0, r["prompt_tokens"], set_name,
                                  call_choices.get((set_name, r["prompt"], method.name)), len(stats.plain_cycles))
                             for r, stats in zip(rows, calls_stats)]
                    measured = statistics.median(_tokens_per_second(r) / baseline[r["prompt"]] for r in rows)
                    entry.update(prediction_entry(choices[method.name], measured, calls),
                                 prediction_baseline=method.path_baseline)
                if not cycles:
                    entry.update(n_alpha=[], accepted_length_histogram={}, ends_outside_vocabulary=None)
                    summary.setdefault(set_name, {})[method.name] = entry
                    continue
                entry.update(
                    n_alpha=acceptance_by_position(lengths, rows[0]["depth"]),
                    accepted_length_histogram={n: lengths.count(n) for n in sorted(set(lengths))},
                    # records written before the field existed hold no count
                    ends_outside_vocabulary=sum(r["ends_outside_vocabulary"] for r in rows) / cycles
                    if all("ends_outside_vocabulary" in r for r in rows) else None,
                    # over every target forward after the prefill, plain decoding steps included
                    cycle_ms={part: 1000 * sum(r[f"{part}_seconds"] for r in rows)
                              / sum(len(r["acceptance_lengths"]) for r in rows) for part in CYCLE_PARTS},
                )
            summary.setdefault(set_name, {})[method.name] = entry
    return {"summary": summary, "records": records}


# What the columns of `markdown_table` mean, written under it in bench.md
TABLE_LEGEND = """\
- **tree (DxKxN)**: the tree shape decoded with, depth x top-k x drafted tokens (`auto`: the shape calibrated for this
  machine, or `plain` where no tree pays; a chain is top-k 1).
- **speedup**: the median over the set's prompts of the method's tokens/s over plain decoding's on the same prompt.
- **predicted (error)**: for `auto`, the speedup the calibration predicted (the acceptance profile's τ for the set,
  where it holds one, over the predicted cycle time), and how far it is from the measured speedup. The calibration
  predicts the speedup over plain decoding on its own path: for `+compiled`, over `compiled` (the cell then gives that
  measured speedup too; without `compiled` in the run there is no prediction to check).
- **at measured τ**: the speedup the predicted costs give at the τ each call measured, with the tokens it decoded
  plainly (where the online check found the tree slower) at the predicted decode step: its error is the cost model's
  alone, the rest of the error above is the set's τ differing from the profile's.
- **tokens/s**: all new tokens of the set / all its seconds, so long answers weigh more; the ratio of two methods'
  tokens/s can therefore differ from their speedup, which weighs every prompt alike.
- **τ**: tokens per target forward (accepted drafted tokens + 1), over the cycles that verified a drafted tree: not
  the plain decoding steps of a call the online check sent on plainly.
- **n-α**: the share of those cycles whose n-th drafted token (0: the first) is accepted, among those that accepted
  0..n-1.
- **ends outside vocab.**: the share of cycles that ended on a token outside the draft vocabulary, which the draft
  cannot propose (only a context n-gram can): the cycles a larger `--draft-vocab-size` gives a chance, if its new rows
  learn enough (docs/training.md).
- **draft / verify / other ms per cycle**: where a cycle's time goes (drafting the tree, the target's verification
  forward, the rest), per target forward after the prefill, plain decoding steps included.
- **greedy mismatches (near-ties)**: prompts whose greedy output differs from plain decoding's (those where the two
  computations disagree by less than the dtype's rounding on the logit gap of the two tokens).
- **engine rows** (`vllm`, `llama.cpp`, `openvino`, with their version; `+eagle3`: the draft as `save_pretrained`
  writes it drafting a chain of the `chain` method's depth): each engine in its own process, greedy, float32, with its
  own threads, timed by itself after loading (the prompt's forward included) and warmed up like every method. Their
  speedup is over plain `generate`, and for `+eagle3` also over the engine's own plain decoding; τ is from the
  engine's own counters; an `+eagle3` output is compared with its engine's plain output, not with `generate`'s.
"""


def bench_markdown(summary: dict, machine: str, dtype: str, threads: int) -> str:
    """bench.md: the setup, [`markdown_table`] and what its columns mean (`TABLE_LEGEND`)."""
    return (f"Measured on {machine}, {dtype}, {threads} torch threads.\n\n" + markdown_table(summary) + "\n"
            + TABLE_LEGEND)


def markdown_table(summary: dict) -> str:
    lines = [
        ("| set | method | tree (DxKxN) | speedup | predicted (error) | at measured τ (error) | tokens/s | τ | 0-α | "
         "1-α | 2-α | ends outside vocab. | draft / verify / other ms per cycle | greedy mismatches (near-ties) |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for set_name, methods in summary.items():
        for name, entry in methods.items():
            alphas = (entry.get("n_alpha") or [None] * 3)[:3] + [None] * 3
            split = entry.get("cycle_ms")
            lines.append(
                f"| {set_name} | {name}" + (f" ({entry['engine']})" if "engine" in entry else "")
                + f" | {', '.join(entry.get('shapes', [])) or '-'} | {entry['speedup']:.2f}x"
                + (f" ({entry['speedup_over_engine']:.2f}x over {entry['compared_with']})"
                   if "speedup_over_engine" in entry else "") + " | "
                + (f"{entry['predicted_speedup']:.2f}x ({100 * entry['prediction_error']:+.0f} %"
                   + (f" against {entry['measured_speedup_over_path_plain']:.2f}x over {entry['prediction_baseline']}"
                      if entry["prediction_baseline"] != "plain" else "") + ") | "
                   f"{entry['predicted_speedup_at_measured_tau']:.2f}x ({100 * entry['cost_model_error']:+.0f} %) | "
                   if "predicted_speedup" in entry else "- | - | ")
                + f"{entry['tokens_per_second']:.1f} | "
                + (f"{entry['tau']:.2f}" if "tau" in entry else "-")
                + "".join(f" | {a:.2f}" if a is not None else " | -" for a in alphas[:3])
                + (f" | {entry['ends_outside_vocabulary']:.0%}" if entry.get("ends_outside_vocabulary") is not None
                   else " | -")
                + (f" | {split['draft']:.1f} / {split['verify']:.1f} / {split['other']:.1f}" if split else " | -")
                + f" | {_mismatches(entry)} |"
            )
    return "\n".join(lines) + "\n"


def _mismatches(entry: dict) -> str:
    """`2 (1)`: greedy mismatches (near-ties); an engine's against its plain decoding, which is compared with
    nothing."""
    if "compared_with" not in entry:
        return f"{len(entry['greedy_mismatches'])} ({len(entry['near_tie_mismatches'])})"
    if entry["compared_with"] is None:
        return "-"
    return f"{len(entry['greedy_mismatches'])} against {entry['compared_with']}"


def save_plots(summary: dict, output_dir: Path, settings: dict | None = None) -> None:
    """Write `bench.png` ([`plot_summary`])."""
    import matplotlib.pyplot as plt

    figure = plot_summary(summary, settings)
    figure.savefig(output_dir / "bench.png", dpi=120)
    plt.close(figure)


FIGURE_CAPTION = (
    "Speedup: median over prompts of tokens/s over plain decoding's on the same prompt, on one scale for every set.\n"
    "Hatched: cycles that emitted more tokens than the tree is deep (depth + 1), which only a context n-gram branch "
    "can: a continuation of up to ngram_max_tokens tokens\ncopied from the prompt or the answer so far, accepted whole."
)


def plot_summary(summary: dict, settings: dict | None = None):
    """One row per prompt set: the speedup of every method over plain `generate`, the acceptance of each drafted
    position (n-α) and the distribution of tokens per target forward of every EAGLE-3 method, as bars labelled with
    their values on axes from zero; a method keeps its colour in every panel, and the title names the machine and
    the settings (`bench.json`'s `settings`). Returns the matplotlib figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import PercentFormatter

    methods = [name for name in dict.fromkeys(name for entries in summary.values() for name in entries)
               if name != "plain"]
    colours = {name: plt.get_cmap("tab10")(index % 10) for index, name in enumerate(methods)}
    figure, axes = plt.subplots(len(summary), 3, figsize=(17, 4.2 * len(summary) + 1.8), squeeze=False)
    # one speedup scale for every row, so that the sets compare at a glance
    top_speedup = max([entry["speedup"] for entries in summary.values() for entry in entries.values()] + [1.0])
    for (speed, alpha, lengths), (set_name, entries) in zip(axes, summary.items()):
        shown = [name for name in methods if name in entries]
        labels = {name: _method_label(name, entries[name].get("shapes", [])) for name in shown}
        speedups = [entries[name]["speedup"] for name in shown]
        bars = speed.bar(range(len(shown)), speedups, color=[colours[name] for name in shown])
        speed.bar_label(bars, fmt="%.2fx", fontsize=8, padding=2)
        speed.axhline(1.0, color="black", lw=0.8, ls="--", label="plain generate (1x)")
        speed.legend(fontsize=8, loc="upper left")
        speed.set_xticks(range(len(shown)), [labels[name] for name in shown], rotation=15, ha="right", fontsize=8)
        speed.set_ylim(0, top_speedup * 1.3)
        speed.set(title=f"{set_name}: speedup over plain generate", xlabel="method",
                  ylabel="speedup (median over prompts)")

        drafted = [name for name in shown if entries[name].get("n_alpha")]
        width = 0.8 / max(len(drafted), 1)
        shift = {name: (offset - (len(drafted) - 1) / 2) * width for offset, name in enumerate(drafted)}
        positions = max((len(entries[name]["n_alpha"]) for name in drafted), default=0)
        for name in drafted:
            rates = entries[name]["n_alpha"]
            bars = alpha.bar([n + shift[name] for n in range(len(rates))], [rate or 0.0 for rate in rates], width,
                             color=colours[name], label=labels[name])
            alpha.bar_label(bars, labels=["-" if rate is None else f"{rate:.2f}" for rate in rates], fontsize=7,
                            padding=1)
        alpha.set_xticks(range(positions), [str(n) for n in range(positions)])
        alpha.set_ylim(0, 1.08)
        alpha.set(title=f"{set_name}: acceptance of the n-th drafted token (n-α)",
                  xlabel="drafted position n (0: the first drafted token)",
                  ylabel="share accepted (when 0..n-1 were)")

        emitted = sorted({int(n) for name in drafted for n in entries[name]["accepted_length_histogram"]})
        for name in drafted:
            histogram = {int(n): count for n, count in entries[name]["accepted_length_histogram"].items()}
            shares = [histogram.get(n, 0) / sum(histogram.values()) for n in emitted]
            bars = lengths.bar([n + shift[name] for n in emitted], shares, width, color=colours[name],
                               label=labels[name])
            longest_from_tree = len(entries[name]["n_alpha"]) + 1  # depth + 1: longer cycles took an n-gram branch
            for n, bar in zip(emitted, bars):
                if n > longest_from_tree:
                    bar.set_hatch("//")
            lengths.bar_label(bars, labels=[f"{100 * share:.0f}%" if share else "" for share in shares], fontsize=7,
                              padding=1)
        lengths.set_xticks(emitted, [str(n) for n in emitted])
        lengths.yaxis.set_major_formatter(PercentFormatter(1.0))
        lengths.set_ylim(0, 1.08)
        lengths.set(title=f"{set_name}: tokens per target forward", ylabel="share of cycles",
                    xlabel="tokens a cycle emits (accepted drafted tokens + 1)")
        if drafted:
            handles, _ = lengths.get_legend_handles_labels()
            ngram = Patch(facecolor="white", edgecolor="grey", hatch="//",
                          label="longer than the tree: an n-gram branch")
            lengths.legend(handles=[*handles, ngram], fontsize=8, loc="upper right")
    figure.suptitle("hf-eagle3 bench" + (f": {settings_description(settings)}" if settings else ""), fontsize=10)
    figure.text(0.5, 0.005, FIGURE_CAPTION, ha="center", va="bottom", fontsize=8.5)
    figure.tight_layout(rect=(0, 0.055, 1, 1))
    return figure


def _method_label(name: str, shapes: list[str]) -> str:
    """`tree (2x8x12)`, `auto (plain)`; a name that already spells its shape (`tree:3x4x10`) stays as it is."""
    shape = ", ".join(shapes)
    return f"{name} ({shape})" if shape and shape not in name else name


LAYOUT_ROUNDS = 3  # alternations of the weight layouts when comparing them


def verification_cost_report(target, token_counts: list[int], layer_ids: list[int], output_dir: Path,
                             compare_layouts: bool = False) -> str:
    """Measure one target forward over each of `token_counts` new tokens (`calibration.verification_cost`) in the
    target's weight layout, or with `compare_layouts` in the standard one and each of `cpu_layout.LAYOUTS` that
    serves its dtype (`optimize`), alternated `LAYOUT_ROUNDS` times (medians; the target is left in the standard
    layout), write `verification-cost.json` and `verification-cost.md` to `output_dir`, and return the
    markdown table."""
    layouts = {"standard": standard_layout} | {
        layout: lambda model, layout=layout: optimize(model, layout) for layout in LAYOUTS
        if layout != "onednn" or onednn_packs(target.dtype)} if compare_layouts else {
        weight_layout(target): lambda model: model}
    samples = {layout: {n: [] for n in token_counts} for layout in layouts}
    for _ in range(LAYOUT_ROUNDS if compare_layouts else 1):
        for layout, lay_out in layouts.items():
            lay_out(target)
            for n, seconds in verification_cost(target, token_counts, layer_ids=layer_ids).items():
                samples[layout][n].append(seconds)
    if compare_layouts:
        standard_layout(target)
    costs = {layout: {n: statistics.median(times) for n, times in by_size.items()}
             for layout, by_size in samples.items()}
    machine, dtype = machine_description(target.device), str(target.dtype).removeprefix("torch.")
    one = min(token_counts)
    table = (f"Measured on {machine}, {dtype}, {torch.get_num_threads()} torch threads; weight layout "
             f"{' vs '.join(costs)}.\n\n| tokens verified |"
             + "".join(f" {layout} ms | x {one} token |" for layout in costs) + "\n|---|"
             + "---|---|" * len(costs) + "\n"
             + "".join(f"| {n} |" + "".join(f" {1000 * by_size[n]:.1f} | {by_size[n] / by_size[one]:.2f} |"
                                            for by_size in costs.values()) + "\n" for n in token_counts))
    output_dir.mkdir(parents=True, exist_ok=True)
    record = {"machine": machine, "dtype": dtype, "torch_threads": torch.get_num_threads(), "seconds": costs}
    (output_dir / "verification-cost.json").write_text(json.dumps(record, indent=1))
    (output_dir / "verification-cost.md").write_text(table)
    return table


def draft_record(name_or_path: str, draft: Eagle3DraftModel) -> dict:
    """`bench.json`'s `draft`: the draft as named, its fingerprint and config digest (`draft_identity`), so that
    `hf-eagle3 push` never shows these results on another draft's card."""
    return {"name_or_path": str(name_or_path), **draft_identity(draft.config, draft.state_dict())}


def _run(args: argparse.Namespace) -> None:
    if not args.verification_cost:
        require("`hf-eagle3 bench`", {"matplotlib": "bench", **prompt_set_packages(args.prompts)})
        check_engine_methods(args.methods, greedy=args.temperature == 0)
    target, tokenizer, draft = load_models(args)
    if args.verification_cost:
        print(verification_cost_report(target, args.verification_cost, draft.config.target_layer_ids,
                                       Path(args.output), compare_layouts=args.cpu_layout))
        print(f"wrote {args.output}/verification-cost.json, verification-cost.md")
        return
    if args.cpu_layout:
        optimize(target)
        optimize(draft)
    prompt_sets = {name: load_prompt_set(name, tokenizer, args.limit, target, args.max_new_tokens)
                   for name in args.prompts}
    longest = max(prompt.shape[1] for prompts in prompt_sets.values() for prompt in prompts) + args.max_new_tokens
    # one static-cache shape for every compiled method and prompt, with room for EAGLE-3's last tree
    depth = args.tree_depth or draft.config.tree_depth
    methods = methods_from_names(
        args.methods, depth, args.tree_top_k or draft.config.tree_top_k,
        args.tree_total_tokens or draft.config.tree_total_tokens, max_cache_len=longest + TREE_ROOM,
    )
    methods = _measurable(methods, draft)
    sampling = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else None
    output_dir = Path(args.output)
    output_dir.mkdir(parents=True, exist_ok=True)
    records_path = output_dir / "records.jsonl"
    records_path.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as work, ExitStack() as stack:
        engines = start_engines(args.methods, target, tokenizer, draft, depth, Path(work), stack)
        result = run_benchmark(target, draft, prompt_sets, methods, args.max_new_tokens, args.repetitions,
                               sampling, records_path=records_path, engines=engines)
    machine = machine_description(target.device)
    result["settings"] = {key: value for key, value in vars(args).items() if key != "run"} | {
        "machine": machine, "torch_threads": torch.get_num_threads()}
    result["draft"] = draft_record(args.draft, draft)
    (output_dir / "bench.json").write_text(json.dumps(result, indent=1))
    table = bench_markdown(result["summary"], machine, args.dtype, torch.get_num_threads())
    (output_dir / "bench.md").write_text(table)
    save_plots(result["summary"], output_dir, result["settings"])
    print(table)
    print(f"wrote {output_dir}/bench.json, bench.md, bench.png, records.jsonl")


def _measurable(methods: list[Method], draft) -> list[Method]:
    """`methods` without the `auto` ones when the draft records no acceptance profile (a converted public draft),
    saying why: `generate` decodes such a draft with its fixed tree, which the `tree` method measures."""
    auto = [method.name for method in methods if method.is_auto]
    if draft.config.acceptance_profile or not auto:
        return methods
    print(f"Not measured: {', '.join(auto)}: the draft records no acceptance profile, which tree_shape='auto' chooses "
          "from (generate decodes it with its fixed tree, as the `tree` method measures). Record one with "
          "`hf-eagle3 tune-tree --target TARGET --draft DIR --save-to NEW_DIR`.")
    return [method for method in methods if not method.is_auto]


def register_cli(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="Speedup and acceptance of EAGLE-3 vs plain and prompt lookup.",
        description="Time EAGLE-3 (chain, tree, and `auto`, the decoding `generate` uses by default) against plain "
                    "generate and prompt lookup on MT-bench and HumanEval prompts, and write bench.json, bench.md "
                    "(a table with a column legend) and bench.png to --output.")
    add_model_arguments(parser)
    parser.add_argument("--prompts", nargs="+", default=["mt-bench", "humaneval"],
                        help=f"prompt sets: {', '.join(PROMPT_SETS)} or a JSONL file")
    parser.add_argument("--methods", nargs="+", default=["plain", "prompt-lookup", "chain", "tree", "auto"],
                        help="plain (first), plain:float32 / plain:bfloat16 (plain decoding with the target in that "
                             "dtype), prompt-lookup, compiled (static cache + torch.compile), chain, tree (the "
                             "draft's fixed defaults), tree:DEPTHxTOPKxTOTAL, auto (the shape calibrated for this "
                             "machine); EAGLE-3 methods may end in +ngram / -ngram (context n-gram candidates in the "
                             "tree or not; default: the draft's ngram_candidates), then +exact (exact_attention=True: "
                             "greedy outputs bit-identical to plain on CPU) or +compiled (verification through a "
                             "static cache and torch.compile, as `compiled` decodes); the engines, each in its own "
                             "process (`make engines` builds them): vllm, llama.cpp, openvino, plainly or with "
                             "+eagle3 (the draft drafting a chain of --tree-depth; greedy, float32)")
    parser.add_argument("--limit", type=int_in(1, MAX_PROMPTS), help="prompts per set (default: all)")
    parser.add_argument("--max-new-tokens", type=int_in(1, MAX_NEW_TOKENS), default=128,
                        help="tokens generated per prompt")
    parser.add_argument("--repetitions", type=int_in(1, MAX_REPETITIONS), default=3,
                        help="timed runs of every method on every prompt (interleaved; the median counts)")
    parser.add_argument("--temperature", type=float_in(0, 100), default=0.0, help="0: greedy")
    parser.add_argument("--tree-depth", type=int_in(1, MAX_TREE_DEPTH),
                        help="depth of the `tree` and `chain` methods (default: the draft's)")
    parser.add_argument("--tree-top-k", type=int_in(1, MAX_TREE_TOKENS),
                        help="top-k of the `tree` method (default: the draft's)")
    parser.add_argument("--tree-total-tokens", type=int_in(1, MAX_TREE_TOKENS),
                        help="drafted tokens of the `tree` method (default: the draft's)")
    parser.add_argument("--verification-cost", type=int_in(1, MAX_TREE_TOKENS), nargs="+", metavar="N",
                        help="only measure the target's forward time over N tokens (e.g. 1 8 16 32 64), write "
                             "verification-cost.json / .md to --output, and exit")
    parser.add_argument("--cpu-layout", action=argparse.BooleanOptionalAction, default=False,
                        help="run every method with the linear layers laid out as `hf_eagle3.optimize` measures "
                             "fastest here; with --verification-cost, measure every layout, side by side")
    parser.add_argument("--output", default="bench-results", help="directory for the results")
    parser.set_defaults(run=_run)
