"""`hf-eagle3 demo`: the main job. EAGLE-3 with the shipped draft on the embedded SmolLM2 target, against the fastest
plain `generate` this machine offers.

The dtype and the tree are chosen by measurement, not by a default tuned on one CPU: for each candidate dtype the
calibration (`calibration.choose_tree`, cached) measures this machine's decode step, verification and drafting costs
and predicts the fastest tree shape; the demo decodes in the dtype predicted fastest, and compares with plain
decoding in every candidate dtype, timed with interleaved repetitions after a warm-up of every shape.
"""

import argparse
import statistics
import time

import torch

from ..decoding.calibration import TreeChoice, choose_tree, machine_description
from ..resources.loading import DTYPES, load_draft, load_target
from ..resources.prompts import chat_input_ids

DEFAULT_PROMPTS = (
    "Explain in a few sentences why the sky is blue.",
    "Write a short poem about a lighthouse keeper.",
    "Give three tips for writing clear Python code.",
)


def _seconds(function, *args) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    output = function(*args)
    return time.perf_counter() - start, output


def run_demo(
    prompts: list[str], max_new_tokens: int, dtypes: list[str], repetitions: int, threads: int | None,
    exact_attention: bool = False,
) -> dict:
    """Calibrate each dtype of `dtypes`, decode with EAGLE-3 in the one predicted fastest, and time it against plain
    decoding in every dtype of `dtypes` on each prompt. Returns the choices, the per-prompt measurements and the
    medians (speedups are against the fastest plain decoding measured)."""
    if threads:
        torch.set_num_threads(threads)
    models, choices = {}, {}
    for name in dtypes:
        target, tokenizer = load_target("smollm2", DTYPES[name])
        draft = load_draft("shipped", DTYPES[name])
        models[name] = (target, draft)
        choices[name] = choose_tree(target, draft)

    def predicted_tokens_per_second(choice: TreeChoice) -> float:
        return choice.predicted_speedup / choice.costs.plain_step

    chosen = max(dtypes, key=lambda name: predicted_tokens_per_second(choices[name]))
    eagle_target, draft = models[chosen]
    kwargs = {"max_new_tokens": max_new_tokens, "do_sample": False}

    def plain(name, input_ids):
        return models[name][0].generate(input_ids, **kwargs)

    def eagle(input_ids):
        return eagle_target.generate(input_ids, **kwargs, assistant_model=draft, exact_attention=exact_attention)

    runs = []
    for prompt in prompts:
        input_ids = chat_input_ids(tokenizer, prompt)
        for name in dtypes:  # warm-up: every kernel shape of every method
            plain(name, input_ids)
        eagle(input_ids)
        plain_seconds, plain_outputs, eagle_seconds, taus = {name: [] for name in dtypes}, {}, [], []
        for _ in range(repetitions):  # interleaved, so that machine noise hits every method alike
            for name in dtypes:
                seconds, plain_outputs[name] = _seconds(plain, name, input_ids)
                plain_seconds[name].append(seconds)
            seconds, eagle_output = _seconds(eagle, input_ids)
            eagle_seconds.append(seconds)
            taus.append(draft.generation_stats.mean_acceptance_length if draft.generation_stats.settings else 1.0)
        new_tokens = eagle_output.shape[1] - input_ids.shape[1]
        plain_tokens = {name: output.shape[1] - input_ids.shape[1] for name, output in plain_outputs.items()}
        runs.append({
            "prompt": prompt,
            "text": tokenizer.decode(eagle_output[0, input_ids.shape[1]:], skip_special_tokens=True),
            "identical_to_plain": torch.equal(plain_outputs[chosen], eagle_output),
            "plain_tokens_per_second": {name: plain_tokens[name] / statistics.median(plain_seconds[name])
                                        for name in dtypes},
            "eagle_tokens_per_second": new_tokens / statistics.median(eagle_seconds),
            "plain_seconds": {name: statistics.median(times) for name, times in plain_seconds.items()},
            "eagle_seconds": statistics.median(eagle_seconds),
            "tau": statistics.median(taus),
        })
    fastest_plain = max(dtypes, key=lambda name: statistics.median(run["plain_tokens_per_second"][name]
                                                                   for run in runs))
    for run in runs:
        run["speedup"] = run["plain_seconds"][fastest_plain] / run["eagle_seconds"]
        run["speedup_same_dtype"] = run["plain_seconds"][chosen] / run["eagle_seconds"]
    return {
        "machine": machine_description(),
        "threads": torch.get_num_threads(),
        "choices": choices,
        "chosen_dtype": chosen,
        "fastest_plain_dtype": fastest_plain,
        "runs": runs,
        "speedup": statistics.median(run["speedup"] for run in runs),
        "speedup_same_dtype": statistics.median(run["speedup_same_dtype"] for run in runs),
        "predicted_speedup": choices[chosen].predicted_speedup,
    }


def _describe_choice(name: str, choice: TreeChoice) -> str:
    costs = choice.costs
    head = f"  {name:9s}: decode step {1000 * costs.plain_step:5.1f} ms"
    if choice.settings is None:
        best = choice.predictions[0].tokens_per_second * costs.plain_step
        return f"{head}; no tree is predicted to pay (the best at {best:.2f}x): plain decoding"
    shape = choice.settings
    return (f"{head}; verifying {shape.total_tokens + 1} tokens {1000 * costs.verify[shape.total_tokens + 1]:5.1f} ms, "
            f"drafting {1000 * costs.draft[shape.depth, shape.top_k]:4.1f} ms -> tree {shape.depth}x{shape.top_k}x"
            f"{shape.total_tokens} (depth x top-k x tokens), predicted {choice.predicted_speedup:.2f}x plain")


def _run(args: argparse.Namespace) -> None:
    dtypes = list(DTYPES) if args.dtype == "auto" else [args.dtype]
    result = run_demo(args.prompt or list(DEFAULT_PROMPTS), args.max_new_tokens, dtypes, args.repetitions,
                      args.threads, args.exact_attention)
    chosen, fastest = result["chosen_dtype"], result["fastest_plain_dtype"]
    print(f"machine: {result['machine']}, {result['threads']} torch threads")
    print("calibration (measured here, cached; τ from the draft's acceptance profile):")
    for name, choice in result["choices"].items():
        print(_describe_choice(name, choice))
    print(f"EAGLE-3 decodes in {chosen}: the fastest predicted"
          + (" (and as plain decoding: no tree pays on this machine)" if result["choices"][chosen].settings is None
             else ""))
    print()
    for index, run in enumerate(result["runs"], 1):
        plain = ", ".join(f"{name} {tps:.1f}" for name, tps in run["plain_tokens_per_second"].items())
        print(f"prompt {index}: {run['prompt']}")
        print(f"  {run['text'][:160].strip()!r}{'...' if len(run['text']) > 160 else ''}")
        print(f"  plain generate (tokens/s): {plain}; EAGLE-3 ({chosen}): {run['eagle_tokens_per_second']:.1f}; "
              f"speedup {run['speedup']:.2f}x over plain {fastest}; τ {run['tau']:.2f}; "
              f"output identical to plain {chosen}: {run['identical_to_plain']}")
    print()
    predicted, measured = result["predicted_speedup"], result["speedup_same_dtype"]
    print(f"speedup over the fastest plain decoding here ({fastest}): {result['speedup']:.2f}x "
          f"(median over {len(result['runs'])} prompts of {args.repetitions} interleaved runs)")
    print(f"over plain {chosen}: measured {measured:.2f}x, predicted by the calibration {predicted:.2f}x "
          f"({100 * (predicted - measured) / measured:+.0f} %)")
    if not all(run["identical_to_plain"] for run in result["runs"]) and chosen != "float32":
        print("(in reduced precision the multi-token verification forward rounds differently from one-token decoding, "
              "so near-ties can flip; --exact-attention or --dtype float32 give plain decoding's output bit for bit)")


def register_cli(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="EAGLE-3 vs plain generate on the embedded SmolLM2 target.",
                                   description=__doc__)
    parser.add_argument("--prompt", action="append",
                        help=f"a user message (repeatable; default: {len(DEFAULT_PROMPTS)} built-in prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                        help="auto: the dtype EAGLE-3 is predicted fastest in on this machine, measured")
    parser.add_argument("--repetitions", type=int, default=3,
                        help="timed runs of each decoding per prompt, interleaved (the median counts)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--exact-attention", action="store_true",
                        help="verify with exact_attention=True (bf16 output identical to plain decoding, slower)")
    parser.set_defaults(run=_run)
