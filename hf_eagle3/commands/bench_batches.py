"""`hf-eagle3 bench-batches`: throughput over a batch (tokens per second, every row's generated tokens) of plain
batched `generate` against EAGLE-3 batched `generate`, at several batch sizes.

Each batch size takes the first `batch_size` prompts of the round-robin of MT-bench first turns and HumanEval prompts,
chat-templated and left-padded as a tokenizer with `padding_side="left"` pads them. EAGLE-3 decodes with
`tree_shape="auto"`: the tree the calibration predicts fastest at that batch size on this machine (or plain decoding
when none pays); with `fixed_tree`, EAGLE-3 with that fixed shape is timed too (what the calibration's choice is
checked against), or alone with `auto=False`. The methods run once per batch size before anything is timed; then, per
batch size, they run back to back `repetitions` times, and each method's time is the median, as are the draft and
verification milliseconds per cycle of an EAGLE-3 method (from its `eagle3_stats`). Greedy outputs are compared row
for row.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ..configuration_eagle3 import MAX_TREE_TOKENS
from ..decoding.calibration import machine_description
from ..resources.loading import add_model_arguments, load_models, prompt_texts
from ..utils.options import MAX_BATCH, MAX_NEW_TOKENS, MAX_REPETITIONS, int_in

PAD_AFTER_STOP = "tokens after a row's end (padding) are not counted"


def chat_batch(tokenizer, messages: list[str]) -> dict:
    """Left-padded `input_ids` and `attention_mask` of single-turn chats, ready for the assistant's answers."""
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        return tokenizer.apply_chat_template([[{"role": "user", "content": text}] for text in messages],
                                             add_generation_prompt=True, padding=True, return_dict=True,
                                             return_tensors="pt")
    finally:
        tokenizer.padding_side = padding_side


def generated_tokens(sequences: torch.Tensor, prompt_width: int, eos_token_ids: set[int]) -> int:
    """Tokens the rows generated, each up to and including its first end-of-sequence token (padding after it is
    not generated)."""
    total = 0
    for row in sequences[:, prompt_width:].tolist():
        ends = [index for index, token in enumerate(row) if token in eos_token_ids]
        total += ends[0] + 1 if ends else len(row)
    return total


def run_batches(target, tokenizer, draft, batch_sizes: list[int], max_new_tokens: int, repetitions: int,
                fixed_tree: tuple[int, int, int] | None = None, auto: bool = True) -> list[dict]:
    texts = [text for pair in zip(prompt_texts("mt-bench"), prompt_texts("humaneval")) for text in pair]
    eos = target.generation_config.eos_token_id
    eos_token_ids = set(eos if isinstance(eos, list) else [eos])
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                  return_dict_in_generate=True)
    rows = []
    for batch_size in batch_sizes:
        batch = chat_batch(tokenizer, texts[:batch_size])
        width = batch["input_ids"].shape[1]

        methods = {"plain": dict()}
        if auto:
            methods["eagle3"] = dict(assistant_model=draft, tree_shape="auto")
        if fixed_tree:
            depth, top_k, total_tokens = fixed_tree
            methods["fixed"] = dict(assistant_model=draft, tree_depth=depth, tree_top_k=top_k,
                                    tree_total_tokens=total_tokens)
        for method in methods.values():  # warm-up (and the calibration at this batch size, once per machine)
            target.generate(**batch, **kwargs, **method)
        times, cycle_ms, outputs = {name: [] for name in methods}, {name: [] for name in methods}, {}
        for _ in range(repetitions):
            for name, method in methods.items():
                start = time.perf_counter()
                outputs[name] = target.generate(**batch, **kwargs, **method)
                times[name].append(time.perf_counter() - start)
                if name != "plain":
                    cycle_ms[name].append(milliseconds_per_cycle(outputs[name].eagle3_stats))
        # each method's own count: in bfloat16 a row can part from plain decoding at a near-tie and end elsewhere
        tokens = {name: generated_tokens(outputs[name].sequences, width, eos_token_ids) for name in methods}
        speed = {name: tokens[name] / statistics.median(times[name]) for name in methods}
        row = {"batch_size": batch_size, "generated_tokens": tokens["plain"]}
        for name in methods:
            row[f"{name}_tokens_per_second"] = speed[name]
            if name == "plain":
                continue
            stats = outputs[name].eagle3_stats
            shape = stats.settings
            row[name] = {
                "speedup": speed[name] / speed["plain"],
                "tree": f"depth {shape.depth}, top-k {shape.top_k}, {shape.total_tokens} tokens" if shape else "plain",
                "tau": stats.mean_tree_acceptance_length if shape else None,  # None: no tree verified
                "identical_rows": sum(torch.equal(row, plain_row) for row, plain_row
                                      in zip(outputs[name].sequences, outputs["plain"].sequences)),
                "shape_choice": stats.shape_choice,
                **{f"{part}_ms_per_cycle": median_or_none([ms[part] for ms in cycle_ms[name]])
                   for part in ("draft", "verify")},
            }
        rows.append(row)
    return rows


def milliseconds_per_cycle(stats) -> dict[str, float | None]:
    """Draft and verification milliseconds per cycle of one call (`None` for a call that decoded plainly)."""
    if not stats.num_cycles or stats.settings is None:
        return {"draft": None, "verify": None}
    return {part: 1000 * getattr(stats, f"{part}_seconds") / stats.num_cycles for part in ("draft", "verify")}


def median_or_none(values: list[float | None]) -> float | None:
    return None if None in values or not values else statistics.median(values)


def markdown_table(rows: list[dict]) -> str:
    lines = ["| batch | method | tok/s | speedup | tree | τ | draft / verify ms per cycle | rows equal to plain |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['batch_size']} | plain | {row['plain_tokens_per_second']:.1f} | 1.00x | | | | |")
        for name, label in (("eagle3", "EAGLE-3, tree_shape='auto'"), ("fixed", "EAGLE-3, fixed tree")):
            if name in row:
                method = row[name]
                # a call that decoded plainly ran plain decoding: its ratio to plain is noise, not a speedup
                speedup, tau = ((f"{method['speedup']:.2f}x", f"{method['tau']:.2f}") if method["tau"] is not None
                                else ("plain decoding (no speedup to measure)", "n/a"))
                split = ("n/a" if method.get("draft_ms_per_cycle") is None
                         else f"{method['draft_ms_per_cycle']:.1f} / {method['verify_ms_per_cycle']:.1f}")
                lines.append(f"| {row['batch_size']} | {label} | {row[f'{name}_tokens_per_second']:.1f} | "
                             f"{speedup} | {method['tree']} | {tau} | {split} | "
                             f"{method['identical_rows']}/{row['batch_size']} |")
    return "\n".join(lines) + "\n"


def _run(args: argparse.Namespace) -> None:
    if not args.auto and not args.fixed_tree:
        raise ValueError("--no-auto leaves only a fixed tree to time: add --fixed-tree DEPTH TOP_K TOKENS, or drop "
                         "--no-auto.")
    target, tokenizer, draft = load_models(args)
    rows = run_batches(target, tokenizer, draft, args.batch_sizes, args.max_new_tokens, args.repetitions,
                       tuple(args.fixed_tree) if args.fixed_tree else None, auto=args.auto)
    print(f"{machine_description(target.device)}, {args.dtype}, {torch.get_num_threads()} threads, "
          f"{args.max_new_tokens} new tokens; {PAD_AFTER_STOP}")
    print(markdown_table(rows))
    if args.output:
        Path(args.output).write_text(json.dumps({"machine": machine_description(target.device), "rows": rows},
                                                indent=1))


def register_cli(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench-batches", help="Throughput of plain against EAGLE-3 batched generate.",
        description="Time plain batched generate against EAGLE-3 batched generate (tree_shape='auto': the tree the "
                    "calibration predicts fastest at each batch size here) on left-padded chat prompts, and print "
                    "tokens per second, speedup, τ and how many rows match plain greedy decoding.")
    add_model_arguments(parser)
    parser.add_argument("--batch-sizes", type=int_in(1, MAX_BATCH), nargs="+", default=[1, 2, 4, 8],
                        help="batch sizes to time (each takes the first prompts of MT-bench and HumanEval in turn)")
    parser.add_argument("--max-new-tokens", type=int_in(1, MAX_NEW_TOKENS), default=64, help="tokens generated per row")
    parser.add_argument("--repetitions", type=int_in(1, MAX_REPETITIONS), default=3,
                        help="timed runs of each method per batch size, interleaved (the median counts)")
    parser.add_argument("--fixed-tree", type=int_in(1, MAX_TREE_TOKENS), nargs=3, metavar=("DEPTH", "TOP_K", "TOKENS"),
                        help="also time EAGLE-3 with this fixed tree at every batch size")
    parser.add_argument("--no-auto", dest="auto", action="store_false",
                        help="time EAGLE-3 with --fixed-tree only, not tree_shape='auto' (no calibration)")
    parser.add_argument("--output", help="write the figures to this JSON file")
    parser.set_defaults(run=_run)
