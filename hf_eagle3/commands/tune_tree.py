"""`hf-eagle3 tune-tree`: a draft's acceptance profile (τ of every tree shape, `Eagle3Config.acceptance_profile`) and
the tree shape that decodes fastest for a target, a draft and a machine (the analogue of the official code's automatic
tree size; the speed model and the measured costs are `calibration`'s).

`--show-calibration` prints the cached costs `tree_shape="auto"` decides with on this machine (the record's path and
content), `--recalibrate` measures them again and replaces the record, without profiling: for the model, dtype,
thread count, batch size (`--batch-size`), compiled path (`--compiled`), static cache length (`--static-cache-length`)
and weight layout (`--cpu-layout`) given.
"""

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch

from ..configuration_eagle3 import MAX_TREE_DEPTH, MAX_TREE_TOKENS
from ..decoding.calibration import (
    MIN_PREDICTED_SPEEDUP,
    MachineCosts,
    ShapePrediction,
    calibrate,
    calibration_key,
    calibration_path,
    choose_tree,
    measure_costs,
    predict,
)
from ..decoding.cpu_layout import optimize
from ..decoding.settings import STATIC_CACHE_BLOCK
from ..modeling_eagle3 import Eagle3DraftModel
from ..resources.loading import (
    add_model_arguments,
    load_models,
    load_prompt_set,
    prompt_set_packages,
    prompt_sources,
    save_draft,
    stored_dtype,
)
from ..training.profile import (
    PROFILE_MAX_DEPTH,
    PROFILE_MAX_TOTAL,
    PROFILE_NEW_TOKENS,
    PROFILE_TOP_KS,
    acceptance_profile,
)
from ..utils.extras import require
from ..utils.options import MAX_BATCH, MAX_CONTEXT, MAX_NEW_TOKENS, MAX_PROMPTS, int_in
from .bench import compiled_kwargs


def tune_tree(
    target, draft: Eagle3DraftModel, prompts: list[torch.Tensor], top_ks: list[int], max_depth: int, max_total: int,
    max_new_tokens: int = 128, progress: bool = True, ngram_candidates: bool | None = None,
    prompt_sets: list[str] | None = None,
) -> tuple[list[dict], list[ShapePrediction], MachineCosts]:
    """The acceptance profile over `prompts`, each of the set `prompt_sets` names where given (see
    `acceptance_profile`), this machine's costs (measured now, see `calibration.measure_costs`), and every shape's
    predicted speed, fastest first."""
    if not prompts:
        raise ValueError("No prompts to measure the acceptance profile on: a tree shape cannot be chosen from none. "
                         "Give a prompt set that holds some (--prompts, --limit N >= 1).")
    if ngram_candidates is None:
        ngram_candidates = draft.config.ngram_candidates
    profile = acceptance_profile(target, draft, prompts, top_ks, max_depth, max_total, max_new_tokens, progress,
                                 ngram_candidates, prompt_sets)
    costs = measure_costs(target, draft, profile)
    return profile, predict(profile, costs, ngram_candidates), costs


def markdown_table(predictions: list[ShapePrediction], costs: MachineCosts, limit: int = 15) -> str:
    lines = ["| top-k | depth | tokens | τ (estimated) | cycle ms | predicted speedup |", "|---|---|---|---|---|---|"]
    for prediction in predictions[:limit]:
        shape = prediction.settings
        speedup = prediction.tokens_per_second * costs.plain_step_at(None)
        lines.append(f"| {shape.top_k} | {shape.depth} | {shape.total_tokens} | {prediction.tau:.2f} | "
                     f"{1000 * prediction.cycle_seconds:.1f} | {speedup:.2f}x |")
    return "\n".join(lines) + "\n"


def _check_save_to(directory: str | Path) -> None:
    if Path(directory).exists() and not Path(directory).is_dir():
        raise FileExistsError(f"--save-to {directory} is a file: the draft is saved as a folder (config.json, "
                              "model.safetensors); name a new directory, or a draft's folder to update it.")


def show_calibration(target, draft: Eagle3DraftModel, batch_size: int = 1, compile_config=None,
                     static_length: int | None = None) -> str:
    """The path and content of the calibration record `tree_shape="auto"` reads for these models here."""
    path = calibration_path(calibration_key(target, draft, batch_size, compile_config, static_length))
    try:
        content = path.read_text() if path.is_file() else None
    except OSError as error:
        content = f"(unreadable: {error})"
    return f"calibration record: {path}\n" + (
        content or "(none yet: the next tree_shape='auto' call measures it, or run tune-tree --recalibrate)")


def recalibrate(target, draft: Eagle3DraftModel, batch_size: int = 1, compile_config=None,
                static_length: int | None = None) -> str:
    """Measure this machine's costs again, replace the cached record, and say what `tree_shape="auto"` now chooses."""
    calibrate(target, draft, batch_size, compile_config, static_length, recalibrate=True)
    choice = choose_tree(target, draft, None, batch_size, compile_config, static_length)
    record = show_calibration(target, draft, batch_size, compile_config, static_length)
    return f"{record}\n\ntree_shape='auto' now: {choice.reason}"


def _run(args: argparse.Namespace) -> None:
    if not (args.show_calibration or args.recalibrate):  # those read or measure costs, no prompt set
        require("`hf-eagle3 tune-tree`", prompt_set_packages(args.prompts))
    if args.save_to:
        _check_save_to(args.save_to)  # before minutes of measuring
    if args.compiled and args.static_cache_length is None:
        raise ValueError("--compiled needs --static-cache-length N: compiled verification decodes into a static cache, "
                         "whose length its costs depend on. A call's is max_length plus its largest tree, rounded up "
                         f"to a multiple of {STATIC_CACHE_BLOCK} (or the StaticCache it passes): e.g. 512 for calls "
                         "of up to 480 tokens.")
    target, tokenizer, draft = load_models(args)
    if args.cpu_layout:
        optimize(target)
        optimize(draft)
    if args.show_calibration or args.recalibrate:
        compile_config = compiled_kwargs()["compile_config"] if args.compiled else None
        report = recalibrate if args.recalibrate else show_calibration
        print(report(target, draft, args.batch_size, compile_config, args.static_cache_length))
        return
    ngram_candidates = draft.config.ngram_candidates if args.ngram_candidates is None else args.ngram_candidates
    prompts, prompt_sets = [], []
    for name in args.prompts:
        loaded = load_prompt_set(name, tokenizer, args.limit, target, args.max_new_tokens)
        prompts += loaded
        prompt_sets += prompt_sources(name, len(loaded))
    profile, predictions, costs = tune_tree(target, draft, prompts, args.top_k, args.max_depth, args.max_total,
                                            args.max_new_tokens, ngram_candidates=ngram_candidates,
                                            prompt_sets=prompt_sets)
    print(f"measured on {costs.machine}, {args.dtype}, {torch.get_num_threads()} threads: "
          f"decode step {1000 * costs.plain_step:.1f} ms")
    print(markdown_table(predictions, costs))
    best = predictions[0]
    speedup = best.tokens_per_second * costs.plain_step_at(None)
    print(f"best: tree_depth={best.settings.depth} tree_top_k={best.settings.top_k} "
          f"tree_total_tokens={best.settings.total_tokens} (predicted {speedup:.2f}x on this machine)")
    if args.output:
        rows = [asdict(prediction.settings) | {"tau": prediction.tau, "cycle_ms": 1000 * prediction.cycle_seconds,
                                               "speedup": prediction.tokens_per_second * costs.plain_step_at(None)}
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
    _check_save_to(directory)
    other_setting = [row for row in draft.config.acceptance_profile or []
                     if row.get("ngram_candidates", False) != ngram_candidates]
    draft.config.acceptance_profile = other_setting + profile
    draft.config.ngram_candidates = ngram_candidates
    draft.config.tree_shape = "auto"
    best = predictions[0]
    speedup, shape = best.tokens_per_second * costs.plain_step_at(None), best.settings
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
    parser = subparsers.add_parser(
        "tune-tree", help="Choose the tree shape that decodes fastest on this machine.",
        description="Measure the draft's acceptance (τ) of every tree shape on calibration prompts and this machine's "
                    "draft and verification costs, print the shapes predicted fastest, and optionally save the draft "
                    "with its acceptance profile and tree_shape='auto' (--save-to).")
    add_model_arguments(parser)
    parser.add_argument("--prompts", nargs="+", default=["calibration"],
                        help="prompt sets (see bench); 'calibration' is none of the benchmark's first prompts")
    parser.add_argument("--limit", type=int_in(1, MAX_PROMPTS), help="prompts per set (default: all)")
    parser.add_argument("--max-new-tokens", type=int_in(1, MAX_NEW_TOKENS), default=PROFILE_NEW_TOKENS,
                        help="tokens generated per prompt for the acceptance profile")
    parser.add_argument("--top-k", type=int_in(1, MAX_TREE_TOKENS), nargs="+", default=list(PROFILE_TOP_KS),
                        help="top-k values to try (1: chains)")
    parser.add_argument("--max-depth", type=int_in(1, MAX_TREE_DEPTH), default=PROFILE_MAX_DEPTH,
                        help="deepest tree to try")
    parser.add_argument("--max-total", type=int_in(1, MAX_TREE_TOKENS), default=PROFILE_MAX_TOTAL,
                        help="largest number of drafted tokens to try")
    parser.add_argument("--ngram-candidates", action=argparse.BooleanOptionalAction, default=None,
                        help="profile trees with context n-gram continuations or without (`ngram_candidates`; default: "
                             "the draft's setting); --save-to then makes it the draft's default")
    parser.add_argument("--show-calibration", action="store_true",
                        help="print the cached costs tree_shape='auto' decides with here (path and content), and exit")
    parser.add_argument("--recalibrate", action="store_true",
                        help="measure this machine's costs again for the draft's acceptance profile, replace the "
                             "cached record, print it, and exit (no profiling)")
    parser.add_argument("--batch-size", type=int_in(1, MAX_BATCH), default=1,
                        help="batch size of --show-calibration / --recalibrate")
    parser.add_argument("--compiled", action="store_true",
                        help="--show-calibration / --recalibrate for the compiled path (bench's `+compiled`)")
    parser.add_argument("--static-cache-length", type=int_in(1, MAX_CONTEXT),
                        help="--show-calibration / --recalibrate for calls decoding into a static cache of this many "
                             f"entries (needed with --compiled; a call's is max_length plus its largest tree, rounded "
                             f"up to a multiple of {STATIC_CACHE_BLOCK}, or the StaticCache it passes)")
    parser.add_argument("--cpu-layout", action=argparse.BooleanOptionalAction, default=False,
                        help="lay the models' linear weights out column-major first (`hf_eagle3.optimize`)")
    parser.add_argument("--output", help="write every shape's figures to this JSON file")
    parser.add_argument("--save-to", help="save the draft, in the dtype it is stored in, with its acceptance profile "
                                          "and tree_shape='auto' (and this machine's best shape as fixed defaults, "
                                          "when it beats plain decoding) to this directory")
    parser.set_defaults(run=_run)
