"""`hf-eagle3 tune-tree`: the draft tree's shape for a target, a draft and a machine, chosen from measurements (the
analogue of the official code's automatic tree size).

A shape (depth `D`, top-k `K`, `N` drafted tokens) decodes

    τ(D, K, N) / (t_draft(D, K) + t_verify(N + 1) + t_other)

tokens per second. The times are measured here: drafting a tree of each depth, one target forward over the root and
`N` nodes, and the rest of a real cycle. τ for every `D <= D_max` and `N <= N_max` of one `K` comes from a single
greedy run with the largest tree. Frontiers do not depend on `D` or `N`, so a smaller tree holds the `N` best of the
largest tree's candidates of depth <= `D`. Greedy verification accepts the one path of the target's argmax tokens,
so the smaller tree accepts that path up to the first node it lacks. The smaller trees are evaluated at the largest
tree's cycle starts, which makes their τ an estimate (a close one) rather than what their own run would measure.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from .drafter import Eagle3Drafter, TreeSettings
from .generation import recording_greedy_cycles
from .modeling_eagle3 import Eagle3DraftModel

TOTAL_TOKENS_GRID = (1, 2, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128)


def accepted_in_smaller_trees(
    rank_keys: torch.Tensor,
    candidate_depths: torch.Tensor,
    accepted: torch.Tensor,
    depths: torch.Tensor,
    totals: torch.Tensor,
) -> torch.Tensor:
    """Drafted tokens that trees of depth `depths[a]` and `totals[b]` nodes would have accepted in one greedy cycle.

    Args:
        rank_keys: `[C]` the cycle's candidate ranking (`DraftTree.candidate_rank_keys`; a tree keeps the highest).
        candidate_depths: `[C]` depth of every candidate.
        accepted: `[L]` candidate indices of the drafted tokens the largest tree accepted, root's child first.
        depths: `[A]` depths to evaluate, each <= the largest tree's.
        totals: `[B]` tree sizes to evaluate, each <= the largest tree's.
    Returns:
        `[A, B]` accepted drafted tokens (the bonus token not counted).
    """
    outranked_by = rank_keys[None, :] > rank_keys[accepted][:, None]  # [L, C]
    within_depth = candidate_depths[None, :] <= depths[:, None]  # [A, C]
    rank = (outranked_by[None] & within_depth[:, None]).sum(-1)  # [A, L]: rank among candidates of depth <= D
    path_depths = torch.arange(1, accepted.numel() + 1, device=accepted.device)
    kept = (rank[:, :, None] < totals[None, None, :]) & (path_depths[None, :, None] <= depths[:, None, None])
    return kept.long().cumprod(dim=1).sum(dim=1)  # the path is accepted up to its first missing node


@torch.no_grad()
def verification_cost(target, sizes: list[int], prefix_length: int = 200, repetitions: int = 7) -> dict[int, float]:
    """Median seconds of one target forward over `n` new tokens after a cached `prefix_length`-token prefix, for each
    `n` in `sizes` (interleaved repetitions after a warm-up of every size): what a tree of `n - 1` nodes costs."""
    from transformers import DynamicCache

    device = target.device
    vocab_size = target.config.vocab_size
    prefix = torch.randint(0, vocab_size, (1, prefix_length), device=device)
    cache = DynamicCache()
    target(prefix, cache=cache)
    seconds = {n: [] for n in sizes}
    for repetition in range(repetitions + 1):
        for n in sizes:
            tokens = torch.randint(0, vocab_size, (1, n), device=device)
            start = time.perf_counter()
            target(tokens, cache=cache, logits_to_keep=0)
            _synchronize(device)
            if repetition:  # the first round only warms up
                seconds[n].append(time.perf_counter() - start)
            cache.crop(-n)
    return {n: statistics.median(times) for n, times in seconds.items()}


@torch.no_grad()
def drafting_cost(
    draft: Eagle3DraftModel, shapes: list[TreeSettings], accepted_per_cycle: int = 2, prefix_length: int = 200,
    repetitions: int = 7,
) -> dict[TreeSettings, float]:
    """Median seconds the draft spends per cycle with each tree shape (interleaved repetitions after a warm-up):
    feeding `accepted_per_cycle` verified positions, then growing the tree (the draft's embedding must be attached)."""
    device, dtype = draft.device, draft.dtype
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


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def tune_tree(
    target, draft: Eagle3DraftModel, prompts: list[torch.Tensor], top_ks: list[int], max_depth: int, max_total: int,
    max_new_tokens: int = 128, progress: bool = True,
) -> list[dict]:
    """Predicted speed of every tree shape up to `max_depth` x `max_total` for each top-k in `top_ks`, fastest first.

    Each row: `top_k`, `depth`, `total_tokens`, `tau` (tokens per target forward, estimated from one greedy run per
    top-k with the largest tree over `prompts`), `cycle_ms` (measured), `tokens_per_second` and `speedup` (against a
    one-token target forward per token, i.e. plain decoding's forward cost). All shapes' costs are measured in the
    same interleaved rounds, so that they compare.
    """
    from tqdm.auto import tqdm

    depths = list(range(1, max_depth + 1))
    calibration = {}  # top_k -> (sizes, τ [depth, size], other seconds per cycle)
    for top_k in top_ks:
        largest = min(max_total, top_k + (max_depth - 1) * top_k * top_k)  # can't keep more than the candidates
        totals = sorted({n for n in TOTAL_TOKENS_GRID if n < largest} | {largest})
        accepted_sums = torch.zeros(len(depths), len(totals), dtype=torch.long)
        cycles, other_seconds = 0, 0.0
        for input_ids in tqdm(prompts, desc=f"tune-tree top-k {top_k}", disable=not progress):
            with recording_greedy_cycles():
                target.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=draft,
                                tree_depth=max_depth, tree_top_k=top_k, tree_total_tokens=largest)
            stats = draft.generation_stats
            for tree, path in stats.greedy_cycles:
                accepted_sums += accepted_in_smaller_trees(
                    tree.candidate_rank_keys, tree.candidate_depths, tree.candidate_ids[path[1:] - 1],
                    torch.tensor(depths, device=path.device), torch.tensor(totals, device=path.device),
                ).cpu()
            cycles += stats.num_cycles
            other_seconds += stats.other_seconds
        calibration[top_k] = (totals, 1 + accepted_sums.double() / max(cycles, 1), other_seconds / max(cycles, 1))

    sizes = sorted({1} | {total + 1 for totals, _, _ in calibration.values() for total in totals})
    verify_seconds = verification_cost(target, sizes)
    shapes = [TreeSettings(depth, top_k, calibration[top_k][0][-1]) for top_k in top_ks for depth in depths]
    draft_seconds = drafting_cost(draft, shapes)
    rows = []
    for shape in shapes:
        totals, taus, other_seconds = calibration[shape.top_k]
        for index, total in enumerate(totals):
            if total > shape.top_k + (shape.depth - 1) * shape.top_k ** 2:
                continue  # more nodes than a tree of this depth has candidates: the same tree as a smaller size
            cycle_seconds = draft_seconds[shape] + verify_seconds[total + 1] + other_seconds
            tau = float(taus[shape.depth - 1, index])
            rows.append({
                "top_k": shape.top_k, "depth": shape.depth, "total_tokens": total, "tau": tau,
                "cycle_ms": 1000 * cycle_seconds, "tokens_per_second": tau / cycle_seconds,
                "speedup": tau * verify_seconds[1] / cycle_seconds,
            })
    return sorted(rows, key=lambda row: -row["tokens_per_second"])


def markdown_table(rows: list[dict], limit: int = 15) -> str:
    lines = ["| top-k | depth | tokens | τ (estimated) | cycle ms | predicted speedup |", "|---|---|---|---|---|---|"]
    for row in rows[:limit]:
        lines.append(f"| {row['top_k']} | {row['depth']} | {row['total_tokens']} | {row['tau']:.2f} | "
                     f"{row['cycle_ms']:.1f} | {row['speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def _run(args: argparse.Namespace) -> None:
    from .bench import load_models, load_prompt_set

    target, tokenizer, draft = load_models(args)
    prompts = [p for name in args.prompts for p in load_prompt_set(name, tokenizer, target, args.limit,
                                                                    args.max_new_tokens)]
    rows = tune_tree(target, draft, prompts, args.top_k, args.max_depth, args.max_total, args.max_new_tokens)
    print(markdown_table(rows))
    best = rows[0]
    print(f"best: tree_depth={best['depth']} tree_top_k={best['top_k']} tree_total_tokens={best['total_tokens']} "
          f"(predicted {best['speedup']:.2f}x)")
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=1))
    if args.save_to:
        draft.config.tree_depth, draft.config.tree_top_k = best["depth"], best["top_k"]
        draft.config.tree_total_tokens = best["total_tokens"]
        draft.save_pretrained(args.save_to)
        print(f"saved the draft with these tree defaults to {args.save_to}")


def register_cli(subparsers) -> None:
    from .bench import add_model_arguments

    parser = subparsers.add_parser("tune-tree", help="Choose the tree shape that decodes fastest on this machine.")
    add_model_arguments(parser)
    parser.add_argument("--prompts", nargs="+", default=["mt-bench"], help="calibration prompt sets (see bench)")
    parser.add_argument("--limit", type=int, default=8, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--top-k", type=int, nargs="+", default=[4, 8, 10], help="top-k values to try")
    parser.add_argument("--max-depth", type=int, default=8)
    parser.add_argument("--max-total", type=int, default=64, help="largest number of drafted tokens to try")
    parser.add_argument("--output", help="write every shape's figures to this JSON file")
    parser.add_argument("--save-to", help="save the draft with the best shape as its tree defaults to this directory")
    parser.set_defaults(run=_run)
