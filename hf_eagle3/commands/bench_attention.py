"""`hf-eagle3 bench-attention`: one verification forward after a long context, with each key/value head's query heads
folded into its query rows (`decoding.grouped_attention`, what EAGLE-3 verification runs) and as transformers' sdpa
runs it (every key/value head repeated for each of its query heads).

The target is Llama-3.1-8B-shaped (hidden size 4096, 32 query heads over 8 key/value heads of 128, intermediate size
14336, vocabulary 128256) with random weights and `--layers` decoder layers; its cache holds random keys and values
for each context length (nothing to prefill). At each context the two forwards of `--tokens` tree nodes (a tree mask,
positions after the context) run back to back `--repetitions` times after a warm-up of both, each time after the
cache is cut back to the context; each one's time is the median. The two forwards' logits are compared too.
"""

import argparse
import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from ..configuration_eagle3 import MAX_TREE_TOKENS
from ..decoding import grouped_attention
from ..decoding.calibration import machine_description
from ..decoding.tree import tree_attention_mask
from ..utils.options import MAX_CONTEXT, MAX_REPETITIONS, MAX_THREADS, int_in

LLAMA_3_1_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072)


def random_target(config: LlamaConfig, dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).to(dtype).eval()


def filled_cache(target, context: int) -> DynamicCache:
    """A cache holding `context` random key / value entries in every layer."""
    config, cache = target.config, DynamicCache()
    shape = (1, config.num_key_value_heads, context, config.head_dim)
    for layer in range(config.num_hidden_layers):
        cache.update(torch.randn(shape, dtype=target.dtype), torch.randn(shape, dtype=target.dtype), layer)
    return cache


def verify_once(target, cache: DynamicCache, input_ids: torch.Tensor, mask: torch.Tensor, kwargs: dict
                ) -> tuple[float, torch.Tensor]:
    """Seconds and logits of one verification forward of `input_ids` `[1, n]` after the cache's entries; the cache
    holds only those again after it."""
    context, tokens = cache.get_seq_length(), input_ids.shape[1]
    positions = torch.arange(context, context + tokens)[None]
    start = time.perf_counter()
    logits = target(input_ids, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True,
                    **kwargs).logits
    seconds = time.perf_counter() - start
    cache.crop(-tokens)
    return seconds, logits


@torch.no_grad()
def time_verification(target, contexts: list[int], tokens: int, repetitions: int) -> list[dict]:
    """Per context: the median milliseconds of a `tokens`-node verification forward with and without the fold, and
    the largest difference of their logits."""
    chain = torch.ones(tokens, tokens, dtype=torch.bool).tril()  # any tree's mask costs the same
    input_ids = torch.randint(0, target.config.vocab_size, (1, tokens))
    ways = {"repeated": {}, "folded": grouped_attention.forward_kwargs(target.config._attn_implementation)}
    rows = []
    for context in contexts:
        cache = filled_cache(target, context)
        mask = tree_attention_mask(chain, torch.ones(context, dtype=torch.bool), target.dtype)
        logits = {name: verify_once(target, cache, input_ids, mask, kwargs)[1] for name, kwargs in ways.items()}
        samples = {name: [] for name in ways}  # after the warm-up above, interleaved
        for _ in range(repetitions):
            for name, kwargs in ways.items():
                samples[name].append(verify_once(target, cache, input_ids, mask, kwargs)[0])
        before, after = (1000 * statistics.median(samples[name]) for name in ways)
        rows.append({"context": context, "repeated_ms": before, "folded_ms": after,
                     "logits_max_difference": float((logits["folded"] - logits["repeated"]).abs().max())})
    return rows


def markdown_table(rows: list[dict], layers: int) -> str:
    lines = ["| cached tokens | keys repeated (ms) | folded (ms) | saved per layer (ms) | logits max difference |",
             "|---|---|---|---|---|"]
    for row in rows:
        saved = (row["repeated_ms"] - row["folded_ms"]) / layers
        lines.append(f"| {row['context']} | {row['repeated_ms']:.1f} | {row['folded_ms']:.1f} | {saved:.1f} | "
                     f"{row['logits_max_difference']:.2g} |")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    config = LlamaConfig(**LLAMA_3_1_8B, num_hidden_layers=args.layers)
    for dtype in args.dtype:
        target = random_target(config, getattr(torch, dtype))
        rows = time_verification(target, args.contexts, args.tokens, args.repetitions)
        print(f"{machine_description(target.device)}, {dtype}, {torch.get_num_threads()} threads, Llama-3.1-8B "
              f"shapes with {args.layers} layers, {args.tokens} tokens verified, median of {args.repetitions}")
        print(markdown_table(rows, args.layers))
        del target


def register_cli(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench-attention", help="Verification attention after a long context, query heads folded or keys repeated.",
        description=__doc__)
    parser.add_argument("--contexts", type=int_in(1, MAX_CONTEXT), nargs="+", default=[2048, 8192],
                        help="cached tokens before the verified ones")
    parser.add_argument("--tokens", type=int_in(1, MAX_TREE_TOKENS), default=16,
                        help="tree nodes verified in one forward")
    parser.add_argument("--layers", type=int_in(1, 32), default=2,
                        help="decoder layers of the Llama-3.1-8B-shaped target")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"],
                        help="the target's dtypes, timed one after the other")
    parser.add_argument("--repetitions", type=int_in(1, MAX_REPETITIONS), default=5,
                        help="timed forwards of each way per context, interleaved (the median counts)")
    parser.add_argument("--threads", type=int_in(1, MAX_THREADS), help="torch threads (default: torch's own choice)")
    parser.set_defaults(run=_run)
