"""`hf-eagle3 tune-tree`: a draft's acceptance profile (τ of every tree shape, `Eagle3Config.acceptance_profile`) and
the tree shape that decodes fastest for a target, a draft and a machine (the analogue of the official code's automatic
tree size; the speed model and the measured costs are `calibration`'s).

τ for every `D <= D_max` and `N <= N_max` of one `K` comes from a single
greedy run with the largest tree. Frontiers do not depend on `D` or `N`, so a smaller tree holds the `N` best of the
largest tree's candidates of depth <= `D`. Greedy verification accepts the one path of the target's argmax tokens,
so the smaller tree accepts that path up to the first node it lacks. The smaller trees are evaluated at the largest
tree's cycle starts, which makes their τ an estimate (a close one) rather than what their own run would measure.
"""

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch

from ..decoding.calibration import MIN_PREDICTED_SPEEDUP, MachineCosts, ShapePrediction, measure_costs, predict
from ..decoding.drafter import max_candidates
from ..resources.loading import add_model_arguments, load_models, load_prompt_set, save_draft, stored_dtype
from ..modeling_eagle3 import Eagle3DraftModel

# The shapes an acceptance profile covers by default (`tune-tree`, and the trainer's final draft)
PROFILE_TOP_KS, PROFILE_MAX_DEPTH, PROFILE_MAX_TOTAL, PROFILE_NEW_TOKENS = (1, 2, 4, 8), 4, 32, 96
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
        candidate_depths: `[C]` the draft depth that holds every candidate: its depth, or 0 for a context
            continuation's own candidates, which trees of every depth hold (`ngram`).
        accepted: `[L]` candidate indices of the drafted tokens the largest tree accepted, root's child first.
        depths: `[A]` depths to evaluate, each <= the largest tree's.
        totals: `[B]` tree sizes to evaluate, each <= the largest tree's.
    Returns:
        `[A, B]` accepted drafted tokens (the bonus token not counted).
    """
    outranked_by = rank_keys[None, :] > rank_keys[accepted][:, None]  # [L, C]
    within_depth = candidate_depths[None, :] <= depths[:, None]  # [A, C]
    rank = (outranked_by[None] & within_depth[:, None]).sum(-1)  # [A, L]: rank among candidates of depth <= D
    path_within_depth = candidate_depths[accepted][None, :, None] <= depths[:, None, None]  # [A, L, 1]
    kept = (rank[:, :, None] < totals[None, None, :]) & path_within_depth
    return kept.long().cumprod(dim=1).sum(dim=1)  # the path is accepted up to its first missing node


def acceptance_profile(
    target, draft: Eagle3DraftModel, prompts: list[torch.Tensor], top_ks: list[int], max_depth: int, max_total: int,
    max_new_tokens: int = 128, progress: bool = True, ngram_candidates: bool | None = None,
) -> list[dict]:
    """τ of every tree shape up to `max_depth` x `max_total` for each top-k in `top_ks`, from one greedy run per
    top-k with its largest tree over `prompts`: rows `{"tree_depth", "tree_top_k", "tree_total_tokens", "tau"}`
    (`Eagle3Config.acceptance_profile`), with `"ngram_candidates": True` for trees holding context continuations
    (`ngram_candidates`, by default the draft's setting; the smaller trees take the continuations' acceptance rates
    from the largest tree's run). Shapes with more nodes than their
    depth has candidates are left out (the same tree as a smaller size)."""
    from tqdm.auto import tqdm

    if ngram_candidates is None:
        ngram_candidates = draft.config.ngram_candidates
    depths = list(range(1, max_depth + 1))
    rows = []
    for top_k in top_ks:
        largest = min(max_total, max_candidates(max_depth, top_k))  # can't keep more than the candidates
        totals = sorted({n for n in TOTAL_TOKENS_GRID if n < largest} | {largest})
        accepted_sums = torch.zeros(len(depths), len(totals), dtype=torch.long)
        cycles = 0
        for input_ids in tqdm(prompts, desc=f"acceptance profile, top-k {top_k}", disable=not progress):
            stats = target.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=draft,
                                    tree_depth=max_depth, tree_top_k=top_k, tree_total_tokens=largest,
                                    ngram_candidates=ngram_candidates, record_greedy_cycles=True,
                                    return_dict_in_generate=True).eagle3_stats
            drafted = max_candidates(max_depth, top_k)  # candidates after these are a continuation's own
            for (tree, path), emitted in zip(stats.greedy_cycles, stats.acceptance_lengths):
                holding_depths = tree.candidate_depths.clone()
                holding_depths[drafted:] = 0
                accepted_sums += accepted_in_smaller_trees(
                    tree.candidate_rank_keys, holding_depths, tree.candidate_ids[path[1:] - 1],
                    torch.tensor(depths, device=path.device), torch.tensor(totals, device=path.device),
                ).cpu().clamp_max(emitted - 1)  # a cycle cut by max_new_tokens or a stop emits fewer
            cycles += stats.num_cycles
        taus = 1 + accepted_sums.double() / max(cycles, 1)
        for depth in depths:
            for index, total in enumerate(totals):
                if total <= max_candidates(depth, top_k):
                    rows.append({"tree_depth": depth, "tree_top_k": top_k, "tree_total_tokens": total,
                                 "tau": round(float(taus[depth - 1, index]), 4)}
                                | ({"ngram_candidates": True} if ngram_candidates else {}))
    return rows


def tune_tree(
    target, draft: Eagle3DraftModel, prompts: list[torch.Tensor], top_ks: list[int], max_depth: int, max_total: int,
    max_new_tokens: int = 128, progress: bool = True, ngram_candidates: bool | None = None,
) -> tuple[list[dict], list[ShapePrediction], MachineCosts]:
    """The acceptance profile over `prompts` (see `acceptance_profile`), this machine's costs (measured now, see
    `calibration.measure_costs`), and every shape's predicted speed, fastest first."""
    if ngram_candidates is None:
        ngram_candidates = draft.config.ngram_candidates
    profile = acceptance_profile(target, draft, prompts, top_ks, max_depth, max_total, max_new_tokens, progress,
                                 ngram_candidates)
    costs = measure_costs(target, draft, profile)
    return profile, predict(profile, costs, ngram_candidates), costs


def markdown_table(predictions: list[ShapePrediction], costs: MachineCosts, limit: int = 15) -> str:
    lines = ["| top-k | depth | tokens | τ (estimated) | cycle ms | predicted speedup |", "|---|---|---|---|---|---|"]
    for prediction in predictions[:limit]:
        shape = prediction.settings
        speedup = prediction.tokens_per_second * costs.plain_step
        lines.append(f"| {shape.top_k} | {shape.depth} | {shape.total_tokens} | {prediction.tau:.2f} | "
                     f"{1000 * prediction.cycle_seconds:.1f} | {speedup:.2f}x |")
    return "\n".join(lines) + "\n"


def _run(args: argparse.Namespace) -> None:
    target, tokenizer, draft = load_models(args)
    ngram_candidates = draft.config.ngram_candidates if args.ngram_candidates is None else args.ngram_candidates
    prompts = [p for name in args.prompts
               for p in load_prompt_set(name, tokenizer, args.limit, target, args.max_new_tokens)]
    profile, predictions, costs = tune_tree(target, draft, prompts, args.top_k, args.max_depth, args.max_total,
                                            args.max_new_tokens, ngram_candidates=ngram_candidates)
    print(f"measured on {costs.machine}, {args.dtype}, {torch.get_num_threads()} threads: "
          f"decode step {1000 * costs.plain_step:.1f} ms")
    print(markdown_table(predictions, costs))
    best = predictions[0]
    print(f"best: tree_depth={best.settings.depth} tree_top_k={best.settings.top_k} "
          f"tree_total_tokens={best.settings.total_tokens} (predicted {best.tokens_per_second * costs.plain_step:.2f}x "
          "on this machine)")
    if args.output:
        rows = [asdict(prediction.settings) | {"tau": prediction.tau, "cycle_ms": 1000 * prediction.cycle_seconds,
                                               "speedup": prediction.tokens_per_second * costs.plain_step}
                for prediction in predictions]
        Path(args.output).write_text(json.dumps({"machine": costs.machine, "shapes": rows}, indent=1))
    if args.save_to:
        print(save_tuned_draft(draft, profile, predictions, costs, args.save_to, stored_dtype(args.draft),
                               ngram_candidates))


def save_tuned_draft(draft: Eagle3DraftModel, profile: list[dict], predictions: list[ShapePrediction],
                     costs: MachineCosts, directory: str | Path, dtype: torch.dtype,
                     ngram_candidates: bool = True) -> str:
    """Save `draft` as `dtype` (the dtype it is stored in, whatever dtype it was measured in) with its acceptance
    `profile` (measured with `ngram_candidates`, which becomes its default; the rows of the other setting are kept)
    and `tree_shape="auto"`, so that every machine picks its own shape. This machine's fastest shape becomes
    the fixed tree defaults only when it is predicted to beat plain decoding as `tree_shape="auto"` asks
    (`MIN_PREDICTED_SPEEDUP`); otherwise the defaults stay as they were, and a warning says so. Returns what was
    saved, in a sentence."""
    other_setting = [row for row in draft.config.acceptance_profile or []
                     if row.get("ngram_candidates", False) != ngram_candidates]
    draft.config.acceptance_profile = other_setting + profile
    draft.config.ngram_candidates = ngram_candidates
    draft.config.tree_shape = "auto"
    best = predictions[0]
    speedup, shape = best.tokens_per_second * costs.plain_step, best.settings
    config = draft.config
    if speedup >= MIN_PREDICTED_SPEEDUP:
        config.tree_depth, config.tree_top_k, config.tree_total_tokens = shape.depth, shape.top_k, shape.total_tokens
        defaults = "the fixed tree defaults are this machine's best"
    else:
        print(f"warning: no tree shape is predicted to beat plain decoding on this machine by "
              f"{MIN_PREDICTED_SPEEDUP - 1:.0%} (the fastest, {shape.depth}x{shape.top_k}x{shape.total_tokens}, at "
              f"{speedup:.2f}x): with tree_shape='auto' the saved draft decodes plainly here.")
        defaults = (f"the fixed tree defaults stay {config.tree_depth}x{config.tree_top_k}x{config.tree_total_tokens}, "
                    "not a shape slower than plain decoding")
    save_draft(draft, directory, dtype)
    return (f"saved the draft ({str(dtype).removeprefix('torch.')}) to {directory} with its acceptance profile and "
            f"tree_shape='auto' (each machine picks its own shape); {defaults}")


def register_cli(subparsers) -> None:
    parser = subparsers.add_parser("tune-tree", help="Choose the tree shape that decodes fastest on this machine.")
    add_model_arguments(parser)
    parser.add_argument("--prompts", nargs="+", default=["calibration"],
                        help="prompt sets (see bench); 'calibration' is none of the benchmark's first prompts")
    parser.add_argument("--limit", type=int, help="prompts per set (default: all)")
    parser.add_argument("--max-new-tokens", type=int, default=PROFILE_NEW_TOKENS,
                        help="tokens generated per prompt for the acceptance profile")
    parser.add_argument("--top-k", type=int, nargs="+", default=list(PROFILE_TOP_KS),
                        help="top-k values to try (1: chains)")
    parser.add_argument("--max-depth", type=int, default=PROFILE_MAX_DEPTH, help="deepest tree to try")
    parser.add_argument("--max-total", type=int, default=PROFILE_MAX_TOTAL,
                        help="largest number of drafted tokens to try")
    parser.add_argument("--ngram-candidates", action=argparse.BooleanOptionalAction, default=None,
                        help="profile trees with context n-gram continuations or without (`ngram_candidates`; default: "
                             "the draft's setting); --save-to then makes it the draft's default")
    parser.add_argument("--output", help="write every shape's figures to this JSON file")
    parser.add_argument("--save-to", help="save the draft, in the dtype it is stored in, with its acceptance profile "
                                          "and tree_shape='auto' (and this machine's best shape as fixed defaults, "
                                          "when it beats plain decoding) to this directory")
    parser.set_defaults(run=_run)
