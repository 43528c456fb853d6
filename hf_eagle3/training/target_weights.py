"""Which of the target's weights a training run loads (`--target-weights`): the whole target, or only the parts that
training on precomputed features reads (its embedding, final norm and LM head; `resources.target_parts`).

The whole target computes features and decodes; its parts do neither. `auto` loads the parts where the run does
neither: its features are precomputed (`--precompute-features`, every file present) and no option decodes with the
target. `parts` refuses a run that would, naming the option and what to pass instead.
"""

import torch
from transformers import PreTrainedModel

from ..resources.loading import load_target_model
from ..resources.target_parts import is_whole, load_target_parts
from .data import Example
from .features import TargetFeatures

TARGET_WEIGHTS = ("auto", "whole", "parts")


def whole_target_uses(config) -> list[str]:
    """What the run (a `TrainConfig`) does with the whole target besides computing missing precomputed features: one
    clause each, naming the option and how to do without."""
    held_out = config.eval_data is not None or config.eval_fraction > 0
    uses = []
    if config.precompute_features is None:
        uses.append("it computes the target's features online at every step (--precompute-features DIR computes "
                    "them once)")
    if held_out and config.eval_tree_prompts and config.eval_batches != 0:
        uses.append(f"--eval-tree-prompts {config.eval_tree_prompts} decodes held-out prompts with the target at "
                    "each evaluation (--eval-tree-prompts 0: the chain τ chooses OUTPUT_DIR/best)")
    if held_out and config.profile_prompts:
        uses.append(f"--profile-prompts {config.profile_prompts} decodes held-out prompts with the target for the "
                    "final draft's acceptance profile (--profile-prompts 0: the draft is written without one)")
    if config.init_layer_from_target:
        uses.append("--init-layer-from-target copies the target's last decoder layer (start without it)")
    return uses


def load_run_target(config, dtype: torch.dtype, device) -> PreTrainedModel:
    """The run's target (`config.target`) as `--target-weights` asks: its parts where they may be enough (`parts`, or
    `auto` when `whole_target_uses` finds nothing), else the whole target. `parts` for a run that decodes is refused."""
    uses = whole_target_uses(config)
    if config.target_weights == "whole" or (config.target_weights == "auto" and uses):
        return load_target_model(config.target, dtype, device)
    if uses:
        raise ValueError(f"--target-weights parts loads only the target's embedding, final norm and LM head, but the "
                         f"run needs the whole target: {'; '.join(uses)}. Pass those options, or --target-weights "
                         "whole (or auto, which loads the whole target where the run needs it).")
    return load_target_parts(config.target, dtype, device)


def target_for_features(target: PreTrainedModel, config, layer_ids: list[int], splits: dict[str, list[Example]],
                        dtype: torch.dtype, device) -> PreTrainedModel:
    """`target`, or the whole target where `target` holds its parts and some of the `splits`' precomputed features
    (at `layer_ids`) are missing: computing them takes the whole target (`auto`); `parts` refuses, saying so."""
    if is_whole(target):
        return target
    features = TargetFeatures(target, layer_ids, config.precompute_features)
    missing = {split: len(features.missing(examples, split)) for split, examples in splits.items()}
    if not any(missing.values()):
        return target
    if config.target_weights == "parts":
        counts = ", ".join(f"{count} of {len(splits[split])} {split}" for split, count in missing.items() if count)
        raise ValueError(f"--target-weights parts: the precomputed features of {counts} conversations are missing "
                         f"under {config.precompute_features}, and computing them takes the whole target. Run with "
                         "--target-weights auto, which loads the whole target to write them (a run on complete "
                         "features loads only its parts), or whole.")
    return load_target_model(config.target, dtype, device)
