"""`hf-eagle3 bench-batches`: throughput over a batch (tokens per second, every row's generated tokens) of plain
batched `generate` against EAGLE-3 batched `generate`, at several batch sizes.

Each batch size takes the first `batch_size` prompts of the round-robin of MT-bench first turns and HumanEval prompts,
chat-templated and left-padded as a tokenizer with `padding_side="left"` pads them. EAGLE-3 decodes with
`tree_shape="auto"`: the tree the calibration predicts fastest at that batch size on this machine (or plain decoding
when none pays). Both methods run once per batch size before anything is timed; then, per batch size, they run back
to back `repetitions` times, and each method's time is the median. Greedy outputs are compared row for row.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from .calibration import machine_description
from .loading import add_model_arguments, load_models, prompt_texts

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


def run_batches(target, tokenizer, draft, batch_sizes: list[int], max_new_tokens: int, repetitions: int) -> list[dict]:
    texts = [text for pair in zip(prompt_texts("mt-bench"), prompt_texts("humaneval")) for text in pair]
    eos = target.generation_config.eos_token_id
    eos_token_ids = set(eos if isinstance(eos, list) else [eos])
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    rows = []
    for batch_size in batch_sizes:
        batch = chat_batch(tokenizer, texts[:batch_size])
        width = batch["input_ids"].shape[1]

        def plain():
            return target.generate(**batch, **kwargs)

        def eagle3():
            return target.generate(**batch, **kwargs, assistant_model=draft, tree_shape="auto",
                                   return_dict_in_generate=True)

        plain(), eagle3()  # warm-up (and the calibration at this batch size, once per machine)
        times = {"plain": [], "eagle3": []}
        for _ in range(repetitions):
            for name, method in (("plain", plain), ("eagle3", eagle3)):
                start = time.perf_counter()
                output = method()
                times[name].append(time.perf_counter() - start)
                if name == "plain":
                    plain_output = output
                else:
                    eagle3_output = output
        stats = eagle3_output.eagle3_stats
        tokens = generated_tokens(plain_output, width, eos_token_ids)
        seconds = {name: statistics.median(values) for name, values in times.items()}
        shape = stats.settings
        rows.append({
            "batch_size": batch_size,
            "generated_tokens": tokens,
            "plain_tokens_per_second": tokens / seconds["plain"],
            "eagle3_tokens_per_second": tokens / seconds["eagle3"],
            "speedup": seconds["plain"] / seconds["eagle3"],
            "tree": f"depth {shape.depth}, top-k {shape.top_k}, {shape.total_tokens} tokens" if shape else "plain",
            "tau": stats.mean_acceptance_length if shape else 1.0,
            "identical_rows": sum(torch.equal(a, b) for a, b in zip(eagle3_output.sequences, plain_output)),
            "shape_choice": stats.shape_choice,
        })
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = ["| batch | plain tok/s | EAGLE-3 tok/s | speedup | tree (calibrated) | τ | rows equal |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['batch_size']} | {row['plain_tokens_per_second']:.1f} | "
                     f"{row['eagle3_tokens_per_second']:.1f} | {row['speedup']:.2f}x | {row['tree']} | "
                     f"{row['tau']:.2f} | {row['identical_rows']}/{row['batch_size']} |")
    return "\n".join(lines) + "\n"


def _run(args: argparse.Namespace) -> None:
    target, tokenizer, draft = load_models(args)
    rows = run_batches(target, tokenizer, draft, args.batch_sizes, args.max_new_tokens, args.repetitions)
    print(f"{machine_description(target.device)}, {args.dtype}, {torch.get_num_threads()} threads, "
          f"{args.max_new_tokens} new tokens; {PAD_AFTER_STOP}")
    print(markdown_table(rows))
    if args.output:
        Path(args.output).write_text(json.dumps({"machine": machine_description(target.device), "rows": rows},
                                                indent=1))


def register_cli(subparsers) -> None:
    parser = subparsers.add_parser("bench-batches", help="Throughput of plain against EAGLE-3 batched generate.")
    add_model_arguments(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--output", help="write the figures to this JSON file")
    parser.set_defaults(run=_run)
