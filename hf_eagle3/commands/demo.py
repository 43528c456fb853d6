"""`hf-eagle3 demo`: the main job. EAGLE-3 with the shipped draft on the embedded SmolLM2 target, against the fastest
plain `generate` this machine offers.

The dtype and the tree are chosen by measurement, not by a default tuned on one CPU: for each candidate dtype the
calibration (`calibration.choose_tree`, cached) measures this machine's decode step, verification and drafting costs
and predicts the fastest tree shape; the demo decodes in the dtype predicted fastest, and compares with plain
decoding in every candidate dtype, interleaved, after a warm-up of every method on the first prompt.

The prompts come from the sets the README reports on, `DEMO_PROMPTS_PER_SET` of each, spread over them
(`prompts.spread`): the first question of every MT-bench category (chat: writing to humanities) and HumanEval problems
0, 20, ..., 140 (code). The acceptance profile the prediction reads was measured on other prompts spread over the same
sets (`prompts.calibration_prompts`). The speedup line is the median over them, each against the faster plain
decoding of its set (on a CPU without bf16 units, bfloat16 can be the faster for chat and the slower for code).
Greedy outputs are compared with plain decoding in the same dtype (`bench.first_divergence`): in reduced precision a
prompt whose output parts from plain decoding is reported with where, how many tokens differ from there, and at what
logit gap (a near-tie when the two computations disagree by at most `bench.NEAR_TIE_LOGITS`). First the linear
layers of both models are laid out as `hf_eagle3.optimize` measures fastest on this machine, for plain decoding and
EAGLE-3 alike, so that both are as fast as this machine makes them (`--no-cpu-layout`: as loaded). Last it shows
where the time went: each part of a cycle (drafting, verification, the rest) and plain decoding's step per token,
measured, beside what the calibration had for them, so that a prediction that missed names the cost it got wrong.

Its cost, counted in target forwards (about 50-90 ms each for SmolLM2 on two CPU cores): per dtype a calibration
(about twenty seconds), then (prompts x repetitions + 1 warm-up) x (max_new_tokens per plain dtype + about
max_new_tokens / τ EAGLE-3 cycles): with the defaults (16 prompts, 2 repetitions, 64 tokens, 2 dtypes) about
33 x 160 = 5,300 forwards, so about nine minutes in all.
"""

import argparse
import statistics
import time

import torch

from ..decoding.calibration import TreeChoice, choose_tree, machine_description
from ..decoding.cpu_layout import optimize, weight_layout
from ..decoding.stats import CYCLE_PARTS
from ..resources.loading import DTYPES, load_draft, load_target
from ..resources.prompts import chat_input_ids, humaneval_prompts, mt_bench_first_turns, spread
from ..utils.options import MAX_NEW_TOKENS, MAX_PROMPTS, MAX_REPETITIONS, MAX_THREADS, int_in
from .bench import NEAR_TIE_LOGITS, Call, first_divergence, prediction_entry

DEMO_PROMPTS_PER_SET = 8


def demo_prompts(per_set: int = DEMO_PROMPTS_PER_SET) -> list[tuple[str, str]]:
    """`(set, user message)`: `per_set` MT-bench first turns and HumanEval problems each, spread over the set."""
    return ([("mt-bench", text) for text in spread(mt_bench_first_turns(), per_set)]
            + [("humaneval", text) for text in spread(humaneval_prompts(), per_set)])


def _timed(function, *args) -> tuple[float, object]:
    start = time.perf_counter()
    output = function(*args)
    return time.perf_counter() - start, output


def _comparison(plain_output, eagle_output, prompt_length: int, dtype: torch.dtype) -> dict:
    """How EAGLE-3's greedy output compares with plain decoding's: identical, or where it parts, how many of its
    tokens differ from there, and the logit gaps there (`bench.first_divergence`)."""
    if torch.equal(plain_output.sequences, eagle_output.sequences):
        return {"identical": True}
    divergence = first_divergence(plain_output, eagle_output, prompt_length)
    disagreement = divergence["disagreement"]
    return divergence | {
        "identical": False,
        "differing_tokens": eagle_output.sequences.shape[1] - prompt_length - divergence["position"],
        "near_tie": disagreement is not None and disagreement <= NEAR_TIE_LOGITS.get(dtype, 1e-3),
    }


def _median_split(splits: list[dict | None]) -> dict | None:
    """The median of each part over the `CYCLE_PARTS` splits given (`None` ones left out; `None` if none is left)."""
    splits = [split for split in splits if split]
    return {part: statistics.median(split[part] for split in splits) for part in CYCLE_PARTS} if splits else None


def _calibrated_cycle_ms(costs, shape) -> dict | None:
    """The calibration's split of a cycle of `shape` (`None` when nothing was measured or the call decoded plainly)."""
    if costs is None or shape is None:
        return None
    return {part: 1000 * seconds for part, seconds in costs.cycle_parts(shape).items()}


def _fastest_plain_by_set(runs: list[dict]) -> dict[str, str]:
    """For each prompt set of `runs`, the dtype whose plain decoding has the highest median tokens/s over the set's
    prompts. Per set, because the answer can differ: without bf16 units, bfloat16 decodes a token faster than float32
    (half the bytes to read) and prefills a long prompt slower, so it can be the faster plain decoding for short chat
    prompts and the slower for long code prompts, and a user picks the faster one for their own prompts."""
    def median_tokens_per_second(prompt_set: str, name: str) -> float:
        return statistics.median(run["plain_tokens_per_second"][name] for run in runs if run["set"] == prompt_set)

    dtypes = runs[0]["plain_tokens_per_second"]
    return {prompt_set: max(dtypes, key=lambda name: median_tokens_per_second(prompt_set, name))
            for prompt_set in dict.fromkeys(run["set"] for run in runs)}


def run_demo(
    prompts: list[tuple[str, str]], max_new_tokens: int, dtypes: list[str], repetitions: int, threads: int | None,
    exact_attention: bool = False, cpu_layout: bool = True,
) -> dict:
    """Calibrate each dtype of `dtypes`, decode with EAGLE-3 in the one predicted fastest, and time it against plain
    decoding in every dtype of `dtypes` on each `(set, prompt)` (interleaved, after a warm-up of every method on the
    first prompt). Returns the choices, the per-prompt measurements and the medians (speedups are against the fastest
    plain decoding measured on the prompt's set)."""
    if threads:
        torch.set_num_threads(threads)
    models, choices, layouts = {}, {}, {}
    for name in dtypes:
        target, tokenizer = load_target("smollm2", DTYPES[name])
        draft = load_draft("shipped", DTYPES[name])
        if cpu_layout:
            optimize(target)
            optimize(draft)
        models[name] = (target, draft)
        layouts[name] = weight_layout(target)
        choices[name] = choose_tree(target, draft)

    def predicted_tokens_per_second(choice: TreeChoice) -> float:
        return choice.predicted_speedup / choice.plain_step if choice.costs else 0.0

    chosen = max(dtypes, key=lambda name: predicted_tokens_per_second(choices[name]))
    eagle_target, draft = models[chosen]
    greedy = {"max_new_tokens": max_new_tokens, "do_sample": False, "return_dict_in_generate": True,
              "output_scores": True}  # scores kept by every method alike: a mismatch is diagnosed without a rerun

    def plain(name: str, input_ids: torch.Tensor):
        return models[name][0].generate(input_ids, **greedy)

    def eagle(input_ids: torch.Tensor):
        return eagle_target.generate(input_ids, **greedy, assistant_model=draft, exact_attention=exact_attention)

    encoded = [(prompt_set, text, chat_input_ids(tokenizer, text)) for prompt_set, text in prompts]
    for name in dtypes:  # warm-up: every method's kernels
        plain(name, encoded[0][2])
    eagle(encoded[0][2])
    runs = []
    for prompt_set, text, input_ids in encoded:
        plain_seconds, plain_outputs, eagle_seconds, prefills = {name: [] for name in dtypes}, {}, [], []
        taus, decoded_plainly, cycle_ms, switched = [], [], [], False
        for _ in range(repetitions):  # interleaved, so that machine noise hits every method alike
            for name in dtypes:
                seconds, plain_outputs[name] = _timed(plain, name, input_ids)
                plain_seconds[name].append(seconds)
            seconds, eagle_output = _timed(eagle, input_ids)
            eagle_seconds.append(seconds)
            stats = eagle_output.eagle3_stats
            prefills.append(stats.prefill_seconds)
            taus.append(stats.mean_tree_acceptance_length if stats.settings else 1.0)  # of its drafted trees
            decoded_plainly.append(len(stats.plain_cycles))  # tokens, where the tree lost to plain decoding
            switched |= "went on plainly" in (stats.shape_choice or "")
            if stats.num_cycles:
                cycle_ms.append({part: 1000 * getattr(stats, f"{part}_seconds") / stats.num_cycles
                                 for part in CYCLE_PARTS})
        prompt_length = input_ids.shape[1]
        new_tokens = eagle_output.sequences.shape[1] - prompt_length
        choice = stats.choice or choices[chosen]  # the one the call decoded with: for its context, costs corrected
        plain_tokens = {name: output.sequences.shape[1] - prompt_length for name, output in plain_outputs.items()}
        runs.append({
            "set": prompt_set,
            "prompt": text,
            "text": tokenizer.decode(eagle_output.sequences[0, prompt_length:], skip_special_tokens=True),
            "new_tokens": new_tokens,
            "prompt_tokens": prompt_length,
            "comparison": _comparison(plain_outputs[chosen], eagle_output, prompt_length, DTYPES[chosen]),
            "plain_tokens_per_second": {name: plain_tokens[name] / statistics.median(plain_seconds[name])
                                        for name in dtypes},
            "eagle_tokens_per_second": new_tokens / statistics.median(eagle_seconds),
            "prefill_seconds": statistics.median(prefills),
            "tau": statistics.median(taus),
            "decoded_plainly": statistics.median(decoded_plainly),
            "cycle_ms": _median_split(cycle_ms),
            # plain decoding's step per further token: its call less EAGLE-3's prefill (the same target forward;
            # the draft's share of it is a few ms)
            "plain_step_ms": 1000 * (statistics.median(plain_seconds[chosen]) - statistics.median(prefills))
            / max(plain_tokens[chosen] - 1, 1),
            "choice": choice,
            "calibrated_cycle_ms": _calibrated_cycle_ms(choice.costs, stats.settings),
            "calibrated_plain_step_ms": 1000 * choice.costs.plain_step_at(prompt_length + new_tokens / 2)
            if choice.costs else None,
            "switched_to_plain": switched,
        })
    fastest_plain = _fastest_plain_by_set(runs)
    for run in runs:
        # tokens/s, not times: in bfloat16 a method can part at a near-tie and end its answer at another length
        run["fastest_plain_dtype"] = fastest_plain[run["set"]]
        run["speedup"] = run["eagle_tokens_per_second"] / run["plain_tokens_per_second"][run["fastest_plain_dtype"]]
        run["speedup_same_dtype"] = run["eagle_tokens_per_second"] / run["plain_tokens_per_second"][chosen]
    by_set = {prompt_set: statistics.median(run["speedup"] for run in runs if run["set"] == prompt_set)
              for prompt_set in fastest_plain}
    measured = statistics.median(run["speedup_same_dtype"] for run in runs)
    return {
        "machine": machine_description(),
        "threads": torch.get_num_threads(),
        "choices": choices,
        "layouts": layouts,
        "chosen_dtype": chosen,
        "fastest_plain_dtype_by_set": fastest_plain,
        "runs": runs,
        "speedup": statistics.median(run["speedup"] for run in runs),
        "speedup_by_set": by_set,
        "speedup_same_dtype": measured,
        "cycle_ms": _median_split([run["cycle_ms"] for run in runs]),
        "plain_step_ms": statistics.median(run["plain_step_ms"] for run in runs),
        "calibrated_cycle_ms": _median_split([run["calibrated_cycle_ms"] for run in runs]),
        "calibrated_plain_step_ms": statistics.median(run["calibrated_plain_step_ms"] for run in runs)
        if choices[chosen].costs else None,
        "prediction": prediction_entry(choices[chosen], measured,
                                       [Call(run["new_tokens"], run["prefill_seconds"], run["tau"],
                                             run["prompt_tokens"], run["set"], run["choice"], run["decoded_plainly"])
                                        for run in runs]),
    }


def _describe_choice(name: str, choice: TreeChoice) -> str:
    costs = choice.costs
    if costs is None:
        return f"  {name:9s}: {choice.reason}"
    steps = " / ".join(f"{1000 * step:.1f}" for _, step in sorted(costs.plain_steps.items()))
    contexts = " / ".join(str(context) for context in sorted(costs.plain_steps))
    head = (f"  {name:9s}: decode step {steps or f'{1000 * costs.plain_step:.1f}'} ms"
            + (f" after {contexts} cached tokens" if steps else "") + f" (spread {costs.spread:.0%})")
    if choice.settings is None:
        return f"{head}; {choice.reason}"
    shape, parts = choice.settings, costs.cycle_parts(choice.settings)
    return (f"{head}; verifying {shape.total_tokens + 1} tokens {1000 * parts['verify']:5.1f} ms, "
            f"drafting {1000 * parts['draft']:4.1f} ms -> tree {shape.depth}x{shape.top_k}x"
            f"{shape.total_tokens} (depth x top-k x tokens), predicted {choice.predicted_speedup:.2f}x plain")


def _describe_comparison(comparison: dict, dtype: str) -> str:
    if comparison["identical"]:
        return f"output identical to plain {dtype}"
    if comparison["disagreement"] is None:
        return f"output a prefix of plain {dtype}'s (it stopped at another length)"
    return (f"output parts from plain {dtype} at token {comparison['position'] + 1} ({comparison['differing_tokens']} "
            f"tokens differ from there): logit gap {comparison['plain_gap']:.3f} in plain decoding, "
            f"{comparison['method_gap']:.3f} in EAGLE-3's verification"
            + (" (a near-tie)" if comparison["near_tie"] else " (NOT a near-tie: a bug, please report it)"))


def _run(args: argparse.Namespace) -> None:
    dtypes = list(DTYPES) if args.dtype == "auto" else [args.dtype]
    prompts = [("custom", text) for text in args.prompt] if args.prompt else demo_prompts(args.prompts_per_set)
    result = run_demo(prompts, args.max_new_tokens, dtypes, args.repetitions, args.threads, args.exact_attention,
                      args.cpu_layout)
    chosen = result["chosen_dtype"]
    layouts = ", ".join(f"{name} {layout}" for name, layout in result["layouts"].items())
    print(f"machine: {result['machine']}, {result['threads']} torch threads; linear layers laid out: {layouts}"
          + (" (measured fastest here; --no-cpu-layout: as loaded)" if args.cpu_layout else ""))
    print("calibration (measured here, cached; τ from the draft's acceptance profile):")
    for name, choice in result["choices"].items():
        print(_describe_choice(name, choice))
    print(f"EAGLE-3 decodes in {chosen}: the fastest predicted"
          + (" (and as plain decoding: no tree pays on this machine)" if result["choices"][chosen].settings is None
             else ""))
    print()
    for index, run in enumerate(result["runs"], 1):
        plain = ", ".join(f"{name} {tps:.1f}" for name, tps in run["plain_tokens_per_second"].items())
        prompt = run["prompt"]
        print(f"prompt {index} ({run['set']}): {prompt[:100].strip()!r}{'...' if len(prompt) > 100 else ''}")
        print(f"  {run['text'][:160].strip()!r}{'...' if len(run['text']) > 160 else ''}")
        print(f"  plain generate (tokens/s): {plain}; EAGLE-3 ({chosen}): {run['eagle_tokens_per_second']:.1f}; "
              f"speedup {run['speedup']:.2f}x over plain {run['fastest_plain_dtype']}; τ {run['tau']:.2f}"
              + ("; the tree lost to plain decoding here, so the call decoded plainly for a part of it"
                 if run["switched_to_plain"] else ""))
        print(f"  {_describe_comparison(run['comparison'], chosen)}")
    print()
    prediction, measured = result["prediction"], result["speedup_same_dtype"]
    sets = ", ".join(f"{name} {speedup:.2f}x over plain {result['fastest_plain_dtype_by_set'][name]}"
                     for name, speedup in result["speedup_by_set"].items())
    if result["choices"][chosen].settings is None:
        print(f"EAGLE-3 decoded plainly here, so there is no speedup to show: the measured ratio to the fastest plain "
              f"decoding, {result['speedup']:.2f}x ({sets}), is this machine's timing noise")
    else:
        print(f"speedup over the fastest plain decoding of each prompt's set here: {result['speedup']:.2f}x, the "
              f"median over {len(result['runs'])} prompts ({sets}) of {args.repetitions} interleaved runs each")
        print(f"over plain {chosen}: measured {measured:.2f}x; predicted by the calibration "
              f"{prediction['predicted_speedup']:.2f}x ({100 * prediction['prediction_error']:+.0f} %), at the "
              f"acceptance profile's τ for each prompt's set (median {prediction['predicted_tau']:.2f}) for calls of "
              f"{args.max_new_tokens} tokens after their prefill; "
              f"at the τ each call's trees measured (median {prediction['measured_tau']:.2f}) and its tokens "
              "decoded plainly at the decode step, "
              f"{prediction['predicted_speedup_at_measured_tau']:.2f}x ({100 * prediction['cost_model_error']:+.0f} %)")
        measured_split, calibrated_split = result["cycle_ms"], result["calibrated_cycle_ms"]
        if measured_split and calibrated_split:
            parts = ", ".join(f"{part} {measured_split[part]:.1f} ms ({calibrated_split[part]:.1f})"
                              for part in CYCLE_PARTS)
            print(f"where the time went, medians over the prompts (calibrated in brackets): a cycle's {parts}; "
                  f"plain {chosen} decoding {result['plain_step_ms']:.1f} ms a token "
                  f"({result['calibrated_plain_step_ms']:.1f} at the prompts' context)")
    parted = [run["comparison"] for run in result["runs"] if not run["comparison"]["identical"]]
    if parted:
        near_ties = sum(1 for comparison in parted if comparison.get("near_tie"))
        print(f"{len(parted)} of {len(result['runs'])} outputs part from plain {chosen} decoding, {near_ties} of them "
              "at near-ties: in reduced precision the multi-token verification forward rounds differently from "
              "one-token decoding, so near-ties can flip; --exact-attention or --dtype float32 give plain decoding's "
              "output bit for bit")


def register_cli(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="EAGLE-3 vs plain generate on the embedded SmolLM2 target.",
                                   description=__doc__)
    parser.add_argument("--prompt", action="append",
                        help="a user message (repeatable; default: MT-bench and HumanEval prompts, spread over each)")
    parser.add_argument("--prompts-per-set", type=int_in(1, MAX_PROMPTS), default=DEMO_PROMPTS_PER_SET,
                        help="MT-bench and HumanEval prompts each, spread over the set, without --prompt")
    parser.add_argument("--max-new-tokens", type=int_in(1, MAX_NEW_TOKENS), default=64,
                        help="tokens generated per prompt")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                        help="auto: the dtype EAGLE-3 is predicted fastest in on this machine, measured")
    parser.add_argument("--repetitions", type=int_in(1, MAX_REPETITIONS), default=2,
                        help="timed runs of each decoding per prompt, interleaved (the median counts)")
    parser.add_argument("--threads", type=int_in(1, MAX_THREADS), default=None,
                        help="torch threads (default: torch's choice)")
    parser.add_argument("--exact-attention", action="store_true",
                        help="verify with exact_attention=True (bf16 output identical to plain decoding, slower)")
    parser.add_argument("--cpu-layout", action=argparse.BooleanOptionalAction, default=True,
                        help="lay the linear layers out as `hf_eagle3.optimize` measures fastest here first, for plain "
                             "decoding and EAGLE-3 alike (--no-cpu-layout: as loaded)")
    parser.set_defaults(run=_run)
