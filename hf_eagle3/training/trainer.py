"""Train an EAGLE-3 draft for a target model with training-time test (`hf-eagle3 train`, or `train` from Python).

One optimizer step:

    batch of conversations (right padded)  ->  target forward, no grad  ->  features [l ; m ; h], logits
    ->  TrainingTimeTest (S unrolled draft steps, see `hf_eagle3.training.ttt`)  ->  loss
    ->  AdamW (0.9, 0.95), clip 0.5

Target features are computed online by default; `--precompute-features DIR` writes them to disk once (features and
the target's final hidden state, bf16), each process its share, batched by length (`hf_eagle3.training.features`),
and reads them back on every epoch; a run that then neither computes features nor decodes loads only the target's
embedding, final norm and LM head (`--target-weights`, `hf_eagle3.training.target_weights`).

Runs on CPU or CUDA, in one process or data-parallel under `accelerate launch` (each process reads its own share of
every round of batches, so N processes with `--batch-size B` train exactly as one process with `--batch-size B
--gradient-accumulation-steps N`; held-out metrics are summed over all processes):

    accelerate launch --multi_gpu --num_processes N -m hf_eagle3 train ...                        # N GPUs
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N -m hf_eagle3 train ...   # N CPU processes

(`accelerate launch --cpu` starts several processes only through MPI, `--mpirun_hostfile`; `--multi_gpu` without GPUs
and without `ACCELERATE_USE_CPU=1` is refused, as its processes would each train alone.) Mixed precision is `--bf16`
/ `--no-bf16` when given, else accelerate's (`accelerate launch --mixed_precision bf16`, `accelerate config`), else
bf16 where the device has bf16 units (a GPU from Ampere on, a CPU with AMX) and float32 elsewhere.

Every `save_every` steps a checkpoint (draft weights, optimizer, RNG states, data position, history) is written
atomically to `output_dir/checkpoint-XXXXXX`; `--resume` continues from the latest one exactly: the same next batch,
learning rate and optimizer state, so a resumed run ends with the weights of an uninterrupted one, on the same data:
every checkpoint records the digests of the data's shards, and a resumed run whose data was rebuilt, edited, shrunk or
grown since is refused (`--allow-data-change` continues on the new data). A resumed run may
change what no training step depends on (`RESUMABLE_CHANGES`: its length, logging, evaluation and checkpoint cadence)
and refuses the rest, saying why (`FIXED_SETTINGS`). The learning rate (linear warmup, then cosine to 0 at the last
step) is a function of the step and of the run's length: a run resumed with a larger `--max-steps` continues on the
schedule of a run of the new length from the step it resumes at (warmup not repeated; the rate steps up there, to
where the longer schedule is, and reaches 0 at the new last step), so it is not identical to a run planned that long
from the start, whose first steps decayed more slowly.
Held-out evaluation reports the per-step accuracy, chain acceptance n-α (greedy: the n-th drafted token is accepted
given the previous ones were) and the chain τ it implies, and the τ of greedy decoding with the reference tree on a
few held-out prompts; `OUTPUT_DIR/best` keeps the draft of the highest; `training.png` plots loss and n-α.
"""

import argparse
import json
import math
import os
import pickle
import random
import shutil
import time
import typing
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel, get_cosine_schedule_with_warmup

from ..configuration_eagle3 import Eagle3Config
from ..decoding.calibration import choose_tree, cpu_info
from ..decoding.compatibility import adopt_target_layers, check_compatibility, model_name, record_target_special_tokens
from ..modeling_eagle3 import Eagle3DraftModel
from ..resources.loading import save_draft
from ..resources.smollm2 import SMOLLM2_NAME
from ..resources.target_parts import is_whole
from ..utils.extras import require
from ..utils.fingerprint import weights_fingerprint
from .data import MANIFEST, Example, dataset_digests, load_dataset
from .features import TargetFeatures
from .losses import LOSSES
from .profile import PROFILE_MAX_DEPTH, PROFILE_MAX_TOTAL, PROFILE_NEW_TOKENS, PROFILE_TOP_KS, acceptance_profile
from .sharding import ignore_shared_embedding, is_sharded, whole_draft
from .target_weights import TARGET_WEIGHTS, load_run_target, target_for_features
from .ttt import TrainingTimeTest, target_distribution
from .vocab import (
    coverage,
    draft_vocabulary_for_run,
    grow_draft_vocabulary,
    load_draft_vocabulary,
    save_draft_vocabulary,
)

CHECKPOINT_PREFIX = "checkpoint-"
SAVE_DTYPES = ("float32", "bfloat16", "float16")
# Settings a resumed run may change: where the run lives, how long it runs (see `--warmup-steps` for the learning
# rate), bookkeeping, held-out evaluation and the final draft's packaging. None changes what a training step computes.
RESUMABLE_CHANGES = (
    "output_dir", "max_steps", "epochs", "log_every", "eval_every", "eval_batches", "eval_ttt_steps", "save_every",
    "keep_checkpoints", "threads", "save_dtype", "profile_prompts", "precompute_batch_tokens", "feature_workers",
    "eval_tree_prompts", "target_weights",
)
# Why every other setting is fixed for the life of a run: changed midway, the run would be neither the old one nor a
# new one (a test checks that every setting is in one of the two).
FIXED_SETTINGS = {
    "decides which conversations are trained on and how they are batched, so the checkpoint's data position would "
    "point elsewhere": ("data", "eval_data", "eval_fraction", "seed", "batch_size", "gradient_accumulation_steps",
                        "max_length"),
    "defines the draft the checkpoint holds, or the target it learns from": (
        "target", "draft_vocab_size", "draft_layers", "intermediate_size", "fc_norm", "norm_before_residual",
        "init_draft", "grow_draft_vocabulary", "init_head_from_target", "init_layer_from_target"),
    "defines the training loss": ("ttt_steps", "step_decay", "loss"),
    "defines the optimizer whose state the checkpoint holds": (
        "learning_rate", "warmup_steps", "weight_decay", "max_grad_norm"),
    "changes the arithmetic of every step (bf16 autocast; features stored in bf16)": ("bf16", "precompute_features"),
}
DRAFT_VOCABULARY_FILE = "draft_vocab.safetensors"
# The tree of the held-out τ at each evaluation: the reference tree of the project's figures (the shipped draft's card),
# decoded greedily for EVAL_TREE_NEW_TOKENS tokens from each of --eval-tree-prompts held-out prompts.
EVAL_TREE = {"tree_depth": 7, "tree_top_k": 10, "tree_total_tokens": 59}
EVAL_TREE_NEW_TOKENS = 64
BEST_DRAFT_DIR = "best"
# A run whose loss covers a smaller share of its tokens stops before training: chat answers are a third to two thirds
# of the tokens of ordinary data, and under 1 % the length cap (or a template longer than it) left nearly nothing to
# learn from, so the run would spend every target forward on prompts.
MIN_SUPERVISED_SHARE = 0.01
# The largest value of each size setting, checked before anything is allocated: far past any draft's or run's needs
# (the largest targets' MLPs are ~50k wide, their vocabularies ~256k), short of sizes that exhaust memory at start.
SIZE_BOUNDS = {"draft_layers": 64, "intermediate_size": 1 << 18, "draft_vocab_size": 1 << 20, "ttt_steps": 64,
               "eval_ttt_steps": 64, "max_length": 1 << 20, "batch_size": 1 << 12,
               "gradient_accumulation_steps": 1 << 12, "threads": 1 << 10, "precompute_batch_tokens": 1 << 24,
               "feature_workers": 1 << 8}


def _setting(default, help: str):
    """A `TrainConfig` field with its command-line help (`hf-eagle3 train --help` shows it and the default)."""
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    """Everything that defines a training run (saved as `train_config.json` in the output directory)."""

    data: str = field(metadata={"help": "directory written by `hf-eagle3 prepare-data`"})
    output_dir: str = field(metadata={"help": "directory for checkpoints, history, training.png and the final draft "
                                              "(OUTPUT_DIR/draft)"})
    target: str | None = _setting(None, "target path / Hub id, or 'smollm2' for the embedded SmolLM2-135M-Instruct; "
                                        "default: the target recorded in the data's manifest.json")
    eval_data: str | None = _setting(None, "prepared directory for held-out evaluation; default: a seeded split of "
                                           "--data (--eval-fraction)")
    eval_fraction: float = _setting(0.02, "held-out share of --data when --eval-data is not given")
    draft_vocab_size: int = _setting(32000, "draft vocabulary: the most frequent target tokens of the answers")
    draft_layers: int = _setting(1, "decoder layers of a fresh draft (Eagle3Config.num_hidden_layers): the first reads "
                                    "the token embedding and the fused feature, the others the feature alone")
    intermediate_size: int | None = _setting(None, "draft MLP width; default: the target's")
    fc_norm: bool = _setting(False, "EAGLE 3.1: an RMSNorm on each target feature before fc (Eagle3Config.fc_norm)")
    norm_before_residual: bool = _setting(False, "EAGLE 3.1: the residual starts from the normalised feature "
                                                 "(Eagle3Config.norm_before_residual)")
    ttt_steps: int = _setting(7, "training-time-test steps: draft steps unrolled per training position")
    eval_ttt_steps: int = _setting(7, "chained draft steps in held-out evaluation (n-α for n < this), whatever "
                                      "--ttt-steps is")
    step_decay: float = _setting(0.8, "weight of TTT step s in the loss: step_decay ** s")
    loss: str = _setting("kl", f"loss of each step ({', '.join(LOSSES)}): kl, the official soft cross-entropy; lk, "
                               "KL blended into the acceptance rate as the draft improves (LK^λ, arXiv:2602.23881); "
                               "lk-alpha, the acceptance rate's likelihood alone")
    learning_rate: float = _setting(5e-5, "peak learning rate (AdamW, betas 0.9 / 0.95)")
    warmup_steps: int = _setting(100, "linear warmup steps; then cosine decay to 0 at the last step. A resumed run "
                                      "with another --max-steps / --epochs continues on the schedule of a run of the "
                                      "new length from the step it resumes at (warmup is not repeated)")
    weight_decay: float = _setting(0.0, "AdamW weight decay")
    max_grad_norm: float = _setting(0.5, "gradient-norm clip")
    batch_size: int = _setting(4, "conversations per micro-batch and process")
    gradient_accumulation_steps: int = _setting(1, "micro-batches per optimizer step and process")
    epochs: float = _setting(1.0, "passes over the training conversations (ignored when --max-steps is given)")
    max_steps: int | None = _setting(None, "optimizer steps in all; default: from --epochs")
    max_length: int = _setting(2048, "conversations are cut to this many tokens")
    bf16: bool | None = _setting(None, "bf16 autocast, the target in bf16 (--no-bf16: float32); default: accelerate's "
                                       "launch setting (`accelerate launch --mixed_precision`, `accelerate config`), "
                                       "else bf16 on a GPU with bf16 units (Ampere and later) or a CPU with AMX, "
                                       "float32 elsewhere")
    seed: int = _setting(0, "seed of the draft's initialisation, the held-out split and the batch order")
    save_every: int = _setting(200, "checkpoint every N optimizer steps (and at the last)")
    keep_checkpoints: int = _setting(2, "checkpoints kept (the newest)")
    eval_every: int = _setting(200, "held-out evaluation every N optimizer steps (and at the last)")
    eval_batches: int | None = _setting(None, "cap on held-out batches, all processes together (0: no held-out "
                                              "evaluation); default: all")
    log_every: int = _setting(10, "record the training loss in history.json every N optimizer steps")
    init_head_from_target: bool = _setting(True, "lm_head / norm start as the target's rows for the draft vocabulary")
    init_layer_from_target: bool = _setting(False, "the decoder layer starts as the target's last (attention and MLP "
                                                   "weights, norms; q / k / v read the fused feature with the "
                                                   "target's weights) and fc passes the last tapped layer through")
    init_draft: str | None = _setting(None, "start from this trained draft (weights and draft vocabulary), e.g. to "
                                            "continue a 1-step run with TTT steps or to fine-tune a released draft on "
                                            "new data; its shape wins over the size settings")
    grow_draft_vocabulary: bool = _setting(False, "with --init-draft: grow its draft vocabulary to "
                                                  "--draft-vocab-size with the most frequent answer tokens it lacks "
                                                  "(its rows keep their weights; the new ones start as the target's "
                                                  "rows, mapped into the draft's output space)")
    precompute_features: str | None = _setting(None, "directory for the target's features, computed once (bf16) "
                                                     "and read back every epoch; default: computed online")
    precompute_batch_tokens: int = _setting(8192, "padded tokens per target forward when precomputing features "
                                                  "(conversations batched by length; a longer one goes alone)")
    feature_workers: int = _setting(2, "DataLoader worker processes reading precomputed features ahead of the step "
                                       "(0: read in the training process)")
    target_weights: str = _setting("auto", "which of the target's weights each process loads: whole; parts, only "
                                           "its embedding, final norm and LM head (what training on precomputed "
                                           "features reads; its decoder layers are never loaded); auto: parts when "
                                           "every --precompute-features file is present and no option decodes with "
                                           "the target (--eval-tree-prompts 0 --profile-prompts 0), else whole")
    threads: int | None = _setting(None, "torch CPU threads per process; default: torch's choice")
    save_dtype: str = _setting("float32", f"dtype of the final draft in OUTPUT_DIR/draft ({', '.join(SAVE_DTYPES)}; "
                                          "e.g. bfloat16 to ship it)")
    eval_tree_prompts: int = _setting(4, "held-out prompts decoded greedily at each evaluation with the reference "
                                         "tree (depth 7, top-k 10, 59 tokens) for its τ; OUTPUT_DIR/best keeps the "
                                         "draft of the highest (0: chain τ decides)")
    profile_prompts: int = _setting(8, "held-out prompts the final draft's acceptance profile is measured on (0: "
                                       "none), so that it decodes with tree_shape='auto' wherever it runs")

    def __post_init__(self):
        """Refuse settings that would silently ruin a run, naming the valid range."""
        at_least_one = ("draft_vocab_size", "draft_layers", "ttt_steps", "eval_ttt_steps", "batch_size",
                        "gradient_accumulation_steps", "save_every", "keep_checkpoints", "eval_every", "log_every",
                        "precompute_batch_tokens")
        problems = [f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                    for name in at_least_one if getattr(self, name) < 1]
        optional_at_least_one = ("max_steps", "threads", "intermediate_size")
        problems += [f"--{name.replace('_', '-')} must be >= 1 when given, got {getattr(self, name)}"
                     for name in optional_at_least_one if getattr(self, name) is not None and getattr(self, name) < 1]
        problems += [f"--{name.replace('_', '-')} must be at most {bound:,}, got {getattr(self, name):,}"
                     for name, bound in SIZE_BOUNDS.items()
                     if getattr(self, name) is not None and getattr(self, name) > bound]
        if self.feature_workers < 0:
            problems.append(f"--feature-workers must be >= 0 (0: read in the training process), got "
                            f"{self.feature_workers}")
        if self.eval_batches is not None and self.eval_batches < 0:
            problems.append(f"--eval-batches must be >= 0 when given (0: no held-out evaluation), got "
                            f"{self.eval_batches}")
        if not self.max_length >= 3:
            problems.append(f"--max-length must be >= 3 (a drafted token needs two before it), got {self.max_length}")
        if not 0 < self.step_decay <= 1:
            problems.append(f"--step-decay must be in (0, 1], got {self.step_decay}")
        if not self.max_grad_norm > 0:
            problems.append(f"--max-grad-norm must be > 0, got {self.max_grad_norm}")
        if not self.learning_rate >= 0:
            problems.append(f"--learning-rate must be >= 0, got {self.learning_rate}")
        if not self.epochs > 0:
            problems.append(f"--epochs must be > 0, got {self.epochs}")
        if not 0 <= self.eval_fraction < 1:
            problems.append(f"--eval-fraction must be in [0, 1), got {self.eval_fraction}")
        if self.eval_tree_prompts < 0:
            problems.append(f"--eval-tree-prompts must be >= 0 (0: no tree decoding), got {self.eval_tree_prompts}")
        if self.profile_prompts < 0:
            problems.append(f"--profile-prompts must be >= 0 (0: no acceptance profile), got {self.profile_prompts}")
        if self.warmup_steps < 0 or self.weight_decay < 0:
            problems.append(f"--warmup-steps and --weight-decay must be >= 0, got {self.warmup_steps} and "
                            f"{self.weight_decay}")
        if self.grow_draft_vocabulary and self.init_draft is None:
            problems.append("--grow-draft-vocabulary grows the vocabulary of --init-draft: pass the draft to grow")
        if self.init_draft is not None and self.init_layer_from_target:
            problems.append("--init-layer-from-target starts a fresh draft from the target, --init-draft from a "
                            "trained draft: pass one of them")
        if self.init_draft is not None and self.draft_layers != 1:
            problems.append("--draft-layers shapes a fresh draft, and --init-draft keeps the layers of the draft it "
                            "starts from: pass one of them")
        if self.loss not in LOSSES:
            problems.append(f"--loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.target_weights not in TARGET_WEIGHTS:
            problems.append(f"--target-weights must be one of {', '.join(TARGET_WEIGHTS)}, got {self.target_weights!r}")
        if self.save_dtype not in SAVE_DTYPES:
            problems.append(f"--save-dtype must be one of {', '.join(SAVE_DTYPES)}, got {self.save_dtype!r}")
        if problems:
            raise ValueError("Invalid training settings: " + "; ".join(problems) + ".")


# ------------------------------------------------------------------------------------------------------ batches


def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Deterministic batches of example indices for one epoch: shuffled, grouped by length to limit padding.

    Examples are shuffled, sorted by length within windows of 64 batches, cut into batches, and the batches
    shuffled again. The result depends only on `(lengths, batch_size, seed, epoch)`, which is what makes resuming exact.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=generator).tolist()
    window = 64 * batch_size
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda index: -lengths[index])
        batches.extend(chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size))
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]


# -------------------------------------------------------------------------------------------------------- draft


def draft_config_for(target: PreTrainedModel, run: TrainConfig) -> Eagle3Config:
    """An `Eagle3Config` whose decoder layers are shaped like `target`'s (a Llama-style causal LM), with the run's
    number of layers, vocabulary size, MLP width and EAGLE 3.1 options, and the target's special-token ids."""
    config = target.config
    draft_config = Eagle3Config(
        vocab_size=config.vocab_size,
        draft_vocab_size=run.draft_vocab_size,
        hidden_size=config.hidden_size,
        target_hidden_size=config.hidden_size,
        intermediate_size=run.intermediate_size or config.intermediate_size,
        num_hidden_layers=run.draft_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        target_num_hidden_layers=config.num_hidden_layers,
        target_model_type=config.model_type,
        target_name_or_path=SMOLLM2_NAME if run.target == "smollm2" else run.target,
        target_fingerprint=weights_fingerprint(target),
        fc_norm=run.fc_norm,
        norm_before_residual=run.norm_before_residual,
    )
    record_target_special_tokens(draft_config, target)
    return draft_config


def build_draft(config: Eagle3Config, target: PreTrainedModel, draft_token_ids: torch.Tensor, init_head: bool,
                init_layer: bool = False):
    """A fresh draft on the target's embedding (frozen), with its vocabulary set; optionally its `lm_head` / `norm`
    copied from the target's rows for the draft vocabulary, so its output space starts as the target's, and its
    decoder layer from the target's last (`init_layer_from_target`)."""
    draft = Eagle3DraftModel(config)
    draft.attach_target_embedding(target.get_input_embeddings())
    draft.embed_tokens.weight.requires_grad_(False)
    draft.set_draft_vocabulary(draft_token_ids)
    with torch.no_grad():
        if init_head:
            draft.lm_head.weight.copy_(target.get_output_embeddings().weight[draft.draft_to_target])
            draft.norm.weight.copy_(target.model.norm.weight)
        if init_layer:
            init_layer_from_target(draft, target)
    return draft


@torch.no_grad()
def init_layer_from_target(draft: Eagle3DraftModel, target: PreTrainedModel) -> None:
    """Start `draft` as the target's last decoder layer run on the target's last tapped layer: `fc` passes that
    layer's hidden states through (`[l ; m ; h] -> h`); the decoder layer takes the target layer's attention and MLP
    weights and norms, its q / k / v projections reading the fused feature with the target's weights (the columns
    reading the token embedding keep their fresh initialisation, and the embedding's norm starts at ones)."""
    config, layers = draft.config, getattr(getattr(target, "model", None), "layers", None)
    problem = None
    if layers is None or not hasattr(layers[-1], "self_attn") or not hasattr(layers[-1], "mlp"):
        problem = "the target has no Llama-style decoder layers (model.layers[i].self_attn / .mlp)"
    elif config.num_hidden_layers != 1 or config.target_hidden_size != config.hidden_size:
        problem = "the draft is not one decoder layer as wide as the target"
    elif config.intermediate_size != getattr(target.config.get_text_config(), "intermediate_size", None):
        problem = "the draft's MLP is not as wide as the target's (--intermediate-size)"
    if problem:
        raise ValueError(f"--init-layer-from-target copies the target's last decoder layer, but {problem}: train "
                         "without --init-layer-from-target, or with the target's layer shape.")
    source, layer, width = layers[-1], draft.midlayer, config.hidden_size
    draft.fc.weight.zero_()
    draft.fc.weight[:, 2 * width:].copy_(torch.eye(width))
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(layer.self_attn, name).weight[:, width:].copy_(getattr(source.self_attn, name).weight)
    layer.self_attn.o_proj.load_state_dict(source.self_attn.o_proj.state_dict())
    layer.mlp.load_state_dict(source.mlp.state_dict())
    layer.hidden_norm.weight.copy_(source.input_layernorm.weight)
    layer.post_attention_layernorm.weight.copy_(source.post_attention_layernorm.weight)


def load_initial_draft(config: TrainConfig, target: PreTrainedModel) -> Eagle3DraftModel:
    """The trained draft `config.init_draft` (float32), checked against the target and the run's vocabulary size."""
    initial = Eagle3DraftModel.from_pretrained(config.init_draft, dtype=torch.float32)
    adopt_target_layers(initial.config, target)  # a foreign checkpoint that does not record its taps
    check_compatibility(initial.config, target)
    size, wanted = initial.config.draft_vocab_size, config.draft_vocab_size
    if wanted < size or (wanted > size and not config.grow_draft_vocabulary):
        grow = f", or --grow-draft-vocabulary to grow it to {wanted}" if wanted > size else " (a vocabulary only grows)"
        raise ValueError(f"--init-draft {config.init_draft} has a draft vocabulary of {size} tokens, the run asks for "
                         f"{wanted}: pass --draft-vocab-size {size}{grow}.")
    return initial


@torch.no_grad()
def load_initial_weights(draft: Eagle3DraftModel, initial: Eagle3DraftModel) -> None:
    """`draft` takes the weights of `initial`, whose draft vocabulary it holds, grown or not: each of `initial`'s
    `lm_head` rows goes to its token's row. The rows of tokens it lacks start from the target's rows (see
    `build_draft`) mapped by the least-squares linear map that takes the target's rows of `initial`'s tokens to
    `initial`'s trained rows: the target's rows as they are would out-score every trained row (their logits start
    several nats higher, and the grown draft would propose them everywhere), the mapped ones start below."""
    rows = torch.searchsorted(draft.draft_to_target, initial.draft_to_target)
    if rows.max() >= draft.draft_to_target.numel() or not torch.equal(draft.draft_to_target[rows],
                                                                       initial.draft_to_target):
        raise ValueError("the run's draft vocabulary does not hold every token of --init-draft's: start a new "
                         "--output-dir (its draft_vocab.safetensors was written for another draft).")
    head, trained = draft.lm_head.weight, initial.lm_head.weight.to(draft.lm_head.weight.dtype)
    if rows.numel() < head.shape[0]:
        mapping = torch.linalg.lstsq(head[rows].float(), trained.float()).solution
        head.copy_((head.float() @ mapping).to(head.dtype))
    head[rows] = trained
    weights = {name: tensor for name, tensor in trainable_state_dict(initial).items()
               if name not in ("lm_head.weight", "d2t", "t2d")}
    draft.load_state_dict(weights, strict=False)


def held_out_prompts(examples: list[Example], device) -> list[torch.Tensor]:
    """The prompts of `examples` (everything before their first answer token), `[1, T]` each."""
    return [torch.tensor([e.input_ids[: e.loss_mask.index(1)]], device=device)
            for e in examples if 1 in e.loss_mask[1:]]


@torch.no_grad()
def tree_tau(draft: Eagle3DraftModel, target, prompts: list[torch.Tensor], accelerator) -> float | None:
    """τ at `EVAL_TREE`: tokens emitted per target forward in greedy decoding of `prompts` (this process's share),
    over all processes; `None` when no process decoded a cycle."""
    was_training = draft.training
    draft.eval()
    totals = torch.zeros(2, dtype=torch.float64)
    for input_ids in prompts:
        stats = target.generate(input_ids, max_new_tokens=EVAL_TREE_NEW_TOKENS, do_sample=False, assistant_model=draft,
                                attention_mask=torch.ones_like(input_ids), return_dict_in_generate=True,
                                **EVAL_TREE).eagle3_stats
        totals += torch.tensor([sum(stats.acceptance_lengths), len(stats.acceptance_lengths)], dtype=torch.float64)
    draft.train(was_training)
    emitted, cycles = accelerator.reduce(totals.to(accelerator.device), "sum").tolist()
    return emitted / cycles if cycles else None


def selection_tau(summary: dict) -> float:
    """What `OUTPUT_DIR/best` is chosen by: an evaluation's held-out τ at the reference tree, else its chain τ."""
    return summary.get("tree_tau") or summary["chain_tau"]


def save_best_draft(output_dir: Path, draft: Eagle3DraftModel) -> None:
    """`save_pretrained` the draft to `output_dir/best`, through a temporary directory renamed over the old one."""
    partial, final = output_dir / f".{BEST_DRAFT_DIR}.partial", output_dir / BEST_DRAFT_DIR
    shutil.rmtree(partial, ignore_errors=True)
    save_draft(draft, partial, torch.float32)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)


def record_acceptance_profile(draft: Eagle3DraftModel, target, examples: list[Example], progress: bool) -> None:
    """Measure the draft's acceptance profile by greedy decoding of the prompts of `examples` (everything before
    their first answer token) and record it in its config with `tree_shape="auto"`; nothing without examples."""
    prompts = held_out_prompts(examples, target.device)
    if not prompts:
        return
    draft.eval()
    draft.config.acceptance_profile = acceptance_profile(target, draft, prompts, PROFILE_TOP_KS, PROFILE_MAX_DEPTH,
                                                         PROFILE_MAX_TOTAL, PROFILE_NEW_TOKENS, progress)
    draft.config.tree_shape = "auto"


def trainable_state_dict(draft: Eagle3DraftModel) -> dict[str, torch.Tensor]:
    """The draft's own tensors: everything but the shared target embedding."""
    return {name: tensor for name, tensor in draft.state_dict().items() if name != "embed_tokens.weight"}


# --------------------------------------------------------------------------------------------------- evaluation


def acceptance_summary(chain_accepted: torch.Tensor, chain_attempted: torch.Tensor) -> dict:
    """n-α for n = 0 .. S-1 and the chain τ they imply (tokens per target forward with a chain of S drafts).

    τ = 1 + Σ_n Π_{m<=n} α_m: the target always contributes one token, and the n-th draft counts when it and all
    before it are accepted.
    """
    alphas = (chain_accepted.double() / chain_attempted.double().clamp(min=1)).tolist()
    tau = 1.0 + sum(math.prod(alphas[: n + 1]) for n in range(len(alphas)))
    return {"alpha": alphas, "chain_tau": tau}


@torch.no_grad()
def evaluate(ttt: TrainingTimeTest, features: TargetFeatures, examples, batches, split, accelerator) -> dict:
    """Held-out loss, per-step top-1 accuracy and expected acceptance rate, n-α and chain τ over `batches` (this
    process's share), summed over all processes; `{}` when no process had a batch.

    Every process joins the one reduction, also one with no batch (a held-out set of fewer batches than processes):
    a process that skipped it would leave the others waiting in it for ever."""
    was_training = ttt.training
    ttt.eval()
    totals = torch.zeros((6, ttt.steps), dtype=torch.float64, device=accelerator.device)
    for batch in features.batches(examples, batches, split):
        target_view = target_distribution(batch["final_hidden"], features.target.lm_head, ttt.draft.draft_to_target)
        device = batch["features"].device
        with accelerator.autocast():
            output = ttt(batch["input_ids"].to(device), batch["features"], *target_view,
                         batch["loss_mask"].to(device))
        totals += torch.stack(
            [output.step_losses * output.step_counts, output.step_correct, output.step_counts,
             output.step_acceptance, output.chain_accepted, output.chain_attempted]
        ).double().to(totals.device)
    ttt.train(was_training)
    loss_sum, correct, counts, acceptance, accepted, attempted = accelerator.reduce(totals, "sum")
    if not counts.any():
        return {}
    return {
        "loss": (loss_sum / counts.clamp(min=1)).tolist(),
        "accuracy": (correct / counts.clamp(min=1)).tolist(),
        "acceptance": (acceptance / counts.clamp(min=1)).tolist(),
        **acceptance_summary(accepted, attempted),
    }


def plot_history(history: list[dict], path: str | Path, step_decay: float) -> None:
    """Training loss and held-out n-α against the optimizer step, as a PNG (losses weighted `step_decay ** s`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_axis, alpha_axis) = plt.subplots(1, 2, figsize=(11, 4))
    train = [entry for entry in history if "train_loss" in entry]
    loss_axis.plot([entry["step"] for entry in train], [entry["train_loss"] for entry in train], label="train")
    evals = [entry for entry in history if "eval" in entry]
    held_out = [sum(step_decay**s * loss for s, loss in enumerate(e["eval"]["loss"])) for e in evals]
    loss_axis.plot([e["step"] for e in evals], held_out, "o-", label="held-out")
    loss_axis.set(xlabel="optimizer step", ylabel="TTT loss (weighted sum of steps)", title="loss")
    loss_axis.legend()
    for n in range(len(evals[0]["eval"]["alpha"]) if evals else 0):
        alpha_axis.plot([e["step"] for e in evals], [e["eval"]["alpha"][n] for e in evals], "o-", label=f"{n}-α")
    alpha_axis.set(xlabel="optimizer step", ylabel="acceptance", title="held-out chain acceptance n-α", ylim=(0, 1))
    if evals:
        alpha_axis.legend(ncol=2, fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# -------------------------------------------------------------------------------------------------- checkpoints


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step in `output_dir` (partial ones are never renamed into place)."""
    checkpoints = sorted(Path(output_dir).glob(f"{CHECKPOINT_PREFIX}[0-9]*[0-9]"))
    return checkpoints[-1] if checkpoints else None


def save_checkpoint(output_dir: Path, draft, optimizer, state: dict, keep: int) -> Path:
    """Write weights, optimizer, RNG states and `state` to a temporary directory, then rename it; a failed write (a
    full disk, say) leaves the previous checkpoints as they were and says so. (The learning rate schedule is a
    function of the step and the run's settings: it is rebuilt on resume, not saved.)"""
    try:
        return _write_checkpoint(output_dir, draft, optimizer, state, keep)
    except (OSError, RuntimeError, SafetensorError) as error:
        raise OSError(
            f"Cannot write the step-{state['step']} checkpoint in {output_dir} ({error}): free disk space, then "
            "continue from the last complete checkpoint with --resume."
        ) from error


def _write_checkpoint(output_dir: Path, draft, optimizer, state: dict, keep: int) -> Path:
    final = output_dir / f"{CHECKPOINT_PREFIX}{state['step']:06d}"
    partial = output_dir / f".{final.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    # config.json + model.safetensors: every checkpoint also loads with `Eagle3DraftModel.from_pretrained`.
    draft.config.save_pretrained(partial)
    tensors = {name: tensor.contiguous() for name, tensor in trainable_state_dict(draft).items()}
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save({"optimizer": optimizer.state_dict(), "rng": rng}, partial / "training_state.pt")
    (partial / "trainer_state.json").write_text(json.dumps(state))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    for old in sorted(output_dir.glob(f"{CHECKPOINT_PREFIX}[0-9]*[0-9]"))[:-keep]:
        shutil.rmtree(old)
    return final


def load_checkpoint(checkpoint: Path, draft, optimizer) -> dict:
    """Restore what `save_checkpoint` wrote into the given objects; returns the trainer state.

    The weights must be exactly the draft's trainable tensors, all finite; the training state is read without
    unpickling anything but tensors and plain containers (a crafted file cannot run code)."""
    trainer_state = json.loads((checkpoint / "trainer_state.json").read_text())
    if trainer_state.get("sharded"):
        raise ValueError(f"{checkpoint} was written under FSDP: it holds the whole draft but only process 0's shard "
                         "of the optimizer state, so it cannot continue the run exactly. Start a new run from its "
                         f"weights with --init-draft {checkpoint}.")
    weights = load_file(str(checkpoint / "model.safetensors"))
    expected = trainable_state_dict(draft)
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{checkpoint} does not hold this run's draft: missing {missing}, unexpected {unexpected}.")
    not_finite = sorted(name for name, tensor in weights.items() if not torch.isfinite(tensor).all())
    if not_finite:
        raise ValueError(f"{checkpoint} has NaN or infinite weights in {', '.join(not_finite)}.")
    try:
        training_state = torch.load(checkpoint / "training_state.pt", weights_only=True)
    except pickle.UnpicklingError as error:
        raise ValueError(
            f"{checkpoint / 'training_state.pt'} is not a training state written by `hf-eagle3 train`: it is damaged, "
            "or holds objects other than tensors and plain containers, and refusing to unpickle those keeps a crafted "
            f"file from running code ({error})."
        ) from error
    draft.load_state_dict(weights, strict=False)  # the keys were checked above; the target's embedding is not saved
    optimizer.load_state_dict(training_state["optimizer"])
    random.setstate(training_state["rng"]["python"])
    torch.set_rng_state(training_state["rng"]["torch"])
    if "cuda" in training_state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(training_state["rng"]["cuda"])
    return trainer_state


def resume_from_latest(output_dir: Path, draft, optimizer) -> tuple[Path, dict]:
    """Load the newest complete checkpoint that loads; a corrupt newer one is reported and passed over."""
    checkpoints = sorted(output_dir.glob(f"{CHECKPOINT_PREFIX}[0-9]*[0-9]"), reverse=True)
    failures = []
    for checkpoint in checkpoints:
        try:
            return checkpoint, load_checkpoint(checkpoint, draft, optimizer)
        except (ValueError, RuntimeError, OSError, KeyError, json.JSONDecodeError) as error:
            failures.append(f"{checkpoint.name}: {error}")
            print(f"warning: cannot resume from {checkpoint} ({error}); trying the previous checkpoint")
    raise ValueError(f"--resume: no checkpoint in {output_dir} loads ({'; '.join(failures) or 'none found'}): "
                     "drop --resume and use a new --output-dir to start anew.")


# ------------------------------------------------------------------------------------------------------ training


def _check_data_fits(config: TrainConfig, target: PreTrainedModel, examples: list[Example]) -> None:
    """Refuse data tokenized for another vocabulary; warn about answers another model regenerated."""
    vocab_size = target.config.get_text_config().vocab_size
    largest = max((max(example.input_ids) for example in examples if example.input_ids), default=-1)
    if largest >= vocab_size:
        raise ValueError(
            f"{config.data} holds token id {largest}, outside the target's vocabulary of {vocab_size}: it was "
            f"tokenized for another model. Prepare it again with `hf-eagle3 prepare-data --target {config.target}`."
        )
    for directory in filter(None, (config.data, config.eval_data)):
        manifest = Path(directory) / MANIFEST
        if not manifest.is_file():
            continue
        regenerated_by = json.loads(manifest.read_text())["settings"].get("regenerated_by")
        if regenerated_by and model_name(regenerated_by) != model_name(target.config.name_or_path):
            print(f"warning: the answers in {directory} were regenerated by {regenerated_by}, not by the target "
                  f"{target.config.name_or_path}: the draft learns that model's distribution, not this target's.")


def _check_same_data(checkpoint: Path, recorded: dict | None, current: dict, config: TrainConfig,
                     allow_change: bool) -> None:
    """Refuse to resume on data other than the checkpoint's (its shards' digests), naming the shards that changed,
    unless `allow_change`, which says so and continues on the new data."""
    if recorded is None:
        print(f"warning: {checkpoint} does not record the digests of its data (written by an older hf-eagle3): "
              "whether the data changed since cannot be checked.")
        return
    changes = []
    for split, directory in (("data", config.data), ("eval_data", config.eval_data)):
        before, now = recorded.get(split) or {}, current[split] or {}
        for name in sorted(before.keys() | now.keys()):
            if before.get(name) != now.get(name):
                change = "removed" if name not in now else "added" if name not in before else "changed"
                changes.append(f"{Path(directory) / name} {change}")
    if not changes:
        return
    if allow_change:
        print(f"warning: the data changed since {checkpoint.name} ({', '.join(changes)}): continuing on the new data "
              "(--allow-data-change), from the old data's position.")
        return
    raise ValueError(
        f"--resume: the data changed since {checkpoint.name} ({', '.join(changes)}): the resumed run would train on "
        "other conversations than the run it continues. Restore the data, start a new run in a new --output-dir, or "
        "pass --allow-data-change to continue on the new data."
    )


def _check_answers_fit(directory: str, examples: list[Example], cap: int) -> None:
    """Refuse data whose answers the length cap leaves (nearly) out of the loss: under `MIN_SUPERVISED_SHARE` of the
    kept tokens supervised."""
    kept = sum(min(len(example.input_ids), cap) for example in examples)
    supervised = sum(sum(example.loss_mask[:cap]) for example in examples)
    if supervised >= MIN_SUPERVISED_SHARE * kept:
        return
    starts = sorted(example.loss_mask.index(1) for example in examples if 1 in example.loss_mask)
    where = (f" (their answers start at token {starts[len(starts) // 2]} on median, after the chat template and the "
             "prompt)") if starts else ""
    raise ValueError(
        f"Only {supervised} of the {kept} tokens of {directory} within --max-length {cap} are answer tokens the loss "
        f"covers ({supervised / max(kept, 1):.2%}, under {MIN_SUPERVISED_SHARE:.0%}): the length cap cuts the "
        f"conversations before their answers{where}, and the draft would learn nearly nothing. Raise --max-length."
    )


def _split_examples(config: TrainConfig) -> tuple[list[Example], list[Example]]:
    def capped(directory: str) -> list[Example]:
        cap = config.max_length
        examples = load_dataset(directory)
        _check_answers_fit(directory, examples, cap)
        return [Example(e.messages, e.input_ids[:cap], e.loss_mask[:cap]) for e in examples]

    examples = capped(config.data)
    if config.eval_data is not None:
        return examples, capped(config.eval_data)
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(config.seed)).tolist()
    held_out = max(1, round(config.eval_fraction * len(examples))) if config.eval_fraction > 0 else 0
    if held_out >= len(examples):
        raise ValueError(f"{config.data} has {len(examples)} conversations: too few to hold out {held_out}.")
    return [examples[i] for i in order[held_out:]], [examples[i] for i in order[:held_out]]


LAUNCHED_PROCESSES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
CPU_LAUNCH = "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N -m hf_eagle3 train ..."


def has_bf16_units(use_cpu: bool) -> bool:
    """Whether the device a run trains on does bf16 arithmetic in hardware: a CUDA GPU that supports bf16 (Ampere and
    later), or a CPU with AMX (`amx_bf16`). Elsewhere bf16 autocast is emulated or converted, slower than float32."""
    if torch.cuda.is_available() and not use_cpu:
        return torch.cuda.is_bf16_supported()
    flags = cpu_info()[1]
    return flags is not None and "amx_bf16" in flags


def mixed_precision(bf16: bool | None) -> str | None:
    """The run's mixed precision for `Accelerator` (`None`: accelerate's launch setting). `--bf16` / `--no-bf16` when
    given, else accelerate's launch setting (`accelerate launch --mixed_precision bf16`, or its `accelerate config`),
    else bf16 where the device has bf16 units (`has_bf16_units`) and float32 elsewhere."""
    if bf16 is not None:
        return "bf16" if bf16 else "no"
    # `accelerate launch` passes "no" when neither its command nor its config names a precision: not a choice
    if os.environ.get("ACCELERATE_MIXED_PRECISION", "no") != "no":
        return None
    return "bf16" if has_bf16_units(os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")) else "no"


def make_accelerator(bf16: bool | None):
    """The run's `Accelerator`, in `mixed_precision(bf16)`. Refuses a launch whose processes would each run alone
    (and race on the output directory), and says when a CPU launch started one process only."""
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision=mixed_precision(bf16))
    # how many processes the launcher started (torchrun: WORLD_SIZE; MPI: its own variables), as accelerate reads them
    launched = max(int(os.environ.get(name, 1)) for name in LAUNCHED_PROCESSES)
    if launched > accelerator.num_processes:
        raise RuntimeError(
            f"This process is one of {launched} launched, but accelerate found no device to run them together on "
            f"(distributed type {accelerator.distributed_type.value}): each would train alone and write the same "
            f"checkpoints. Without GPUs, launch CPU processes with `{CPU_LAUNCH}`."
        )
    if accelerator.num_processes == 1 and os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true") \
            and "MASTER_ADDR" in os.environ:
        # what `accelerate launch --cpu --num_processes N` (N > 1, no MPI host file) leaves: one plain process
        print(f"warning: training in 1 process: `accelerate launch --cpu` starts several only through MPI "
              f"(--mpirun_hostfile). For N CPU processes on this machine: `{CPU_LAUNCH}`.")
    if accelerator.mixed_precision not in ("no", "bf16"):
        raise ValueError(
            f"Mixed precision {accelerator.mixed_precision!r} (from accelerate's configuration) is not supported by "
            "`hf-eagle3 train`: use bf16 (`--bf16`, or `accelerate launch --mixed_precision bf16`) or none "
            "(`--no-bf16`)."
        )
    return accelerator


def _same_target(first: str, second: str) -> bool:
    """Whether two target names (paths, Hub ids, "smollm2") name the same model, as `model_name` compares them."""
    return model_name(SMOLLM2_NAME if first == "smollm2" else first) == model_name(
        SMOLLM2_NAME if second == "smollm2" else second)


def check_prepared_data(directory: str | Path, option: str = "--data") -> None:
    """Refuse a data directory that does not exist or holds no `prepare-data` output, before anything loads."""
    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"{option} {directory}: the directory {path.absolute()} does not exist. Pass the "
                                "--output directory of `hf-eagle3 prepare-data`.")
    if not any(path.glob("shard-*.jsonl")):
        raise FileNotFoundError(f"{option} {directory} holds no shard-*.jsonl: it is not an output of `hf-eagle3 "
                                f"prepare-data`. Prepare it first (`hf-eagle3 prepare-data --output {directory} ...`).")


def resolve_target(config: TrainConfig, target: PreTrainedModel | None = None, run_target: str | None = None) -> str:
    """The run's target: `--target`, else the one the data's `manifest.json` records (`prepare-data --target`), else
    `run_target` (a resumed run's own), else the name of the `target` model given to `train`. A `--target` other
    than the data's, or data and held-out data prepared for different targets, is refused naming both."""
    recorded = {}
    for directory, option in ((config.data, "--data"), (config.eval_data, "--eval-data")):
        if directory is not None:
            check_prepared_data(directory, option)
    for directory in filter(None, (config.data, config.eval_data)):
        manifest = Path(directory) / MANIFEST
        name = json.loads(manifest.read_text())["settings"].get("target_name_or_path") if manifest.is_file() else None
        if name:
            recorded[directory] = name
    wanted = config.target or next(iter(recorded.values()), None) or run_target
    for directory, name in recorded.items():
        if not _same_target(name, wanted):
            flag = f"--target {config.target}" if config.target else f"the target of {config.data} ({wanted})"
            raise ValueError(
                f"{directory} was prepared for the target {name} (its {MANIFEST}), not for {flag}: its token ids mean "
                f"other tokens to another tokenizer. Pass --target {name}, or prepare the data again with "
                f"`hf-eagle3 prepare-data --target {wanted}`."
            )
    if wanted is None and target is None:
        raise ValueError(
            f"{config.data} does not record the target it was prepared for (prepared by an older hf-eagle3, or by "
            "hand): pass --target (a path, a Hub id, or 'smollm2')."
        )
    return wanted if wanted is not None else str(target.config.name_or_path)


def _check_resumable(saved: dict, config: TrainConfig) -> None:
    """Refuse to resume a run under settings that change what it computes (see `FIXED_SETTINGS`), with the reason."""
    reasons = {name: reason for reason, names in FIXED_SETTINGS.items() for name in names}
    problems = []
    for name, value in asdict(config).items():
        if name in RESUMABLE_CHANGES or name not in saved:
            continue
        same = _same_target(saved[name], value) if name == "target" else saved[name] == value
        if not same:
            problems.append(f"--{name.replace('_', '-')} {saved[name]} -> {value} ({reasons[name]})")
    if problems:
        raise ValueError(
            f"--resume cannot change {'; '.join(problems)}. Resume with the run's settings ({config.output_dir}/"
            f"train_config.json), or start a new run in a new --output-dir (`--init-draft "
            f"{config.output_dir}/{CHECKPOINT_PREFIX}NNNNNN` starts from a checkpoint's weights). May change: "
            f"{', '.join('--' + name.replace('_', '-') for name in RESUMABLE_CHANGES)}."
        )



def train(
    config: TrainConfig, resume: bool = False, target: PreTrainedModel | None = None, progress: bool = True,
    allow_data_change: bool = False,
) -> Eagle3DraftModel:
    """Run (or resume) the training described by `config`; returns the trained draft (also saved under
    `output_dir/draft`). `target` overrides loading `config.target` (it must then be that model). A resumed run
    refuses data whose shards changed since its checkpoint, unless `allow_data_change`."""
    from tqdm.auto import tqdm

    if config.threads:
        torch.set_num_threads(config.threads)
    accelerator = make_accelerator(config.bf16)
    output_dir = Path(config.output_dir)
    checkpoint = latest_checkpoint(output_dir) if resume else None
    if resume and checkpoint is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {output_dir}; drop --resume to start a new run.")
    if resume and is_sharded(accelerator):
        raise ValueError(f"--resume under FSDP: restoring a sharded optimizer state is not supported. Resume a run "
                         f"started without FSDP without --use_fsdp, or start a new run from {checkpoint}'s weights "
                         f"with --init-draft {checkpoint}.")
    if not resume and latest_checkpoint(output_dir) is not None:
        raise FileExistsError(f"{output_dir} already holds checkpoints: pass --resume, or use a new --output-dir.")
    saved = json.loads((output_dir / "train_config.json").read_text()) if resume else {}
    # what the run is, resolved: saved in train_config.json, and what a resumed run is checked against
    config = replace(config, target=resolve_target(config, target, saved.get("target")),
                     bf16=accelerator.mixed_precision == "bf16")
    if resume:
        _check_resumable(saved, config)
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
    random.seed(config.seed)
    torch.manual_seed(config.seed)

    dtype = torch.bfloat16 if config.bf16 else torch.float32
    if target is None:
        target = load_run_target(config, dtype, accelerator.device)
    train_examples, eval_examples = _split_examples(config)
    _check_data_fits(config, target, train_examples + eval_examples)
    vocabulary_path = output_dir / DRAFT_VOCABULARY_FILE
    initial_draft = load_initial_draft(config, target) if config.init_draft is not None else None
    if initial_draft is None:
        draft_config = draft_config_for(target, config)
    else:
        draft_config = initial_draft.config
        grows = config.draft_vocab_size != draft_config.draft_vocab_size  # --grow-draft-vocabulary (checked)
        if grows:
            draft_config = Eagle3Config.from_dict(draft_config.to_dict()
                                                  | {"draft_vocab_size": config.draft_vocab_size})
        if accelerator.is_main_process and not vocabulary_path.exists():
            token_ids = initial_draft.draft_to_target
            save_draft_vocabulary(vocabulary_path, grow_draft_vocabulary(
                token_ids, train_examples, config.draft_vocab_size, draft_config.vocab_size) if grows else token_ids)
    if accelerator.is_main_process:
        draft_vocabulary_for_run(vocabulary_path, train_examples, config.draft_vocab_size, draft_config.vocab_size)
    accelerator.wait_for_everyone()
    draft_token_ids = load_draft_vocabulary(vocabulary_path)
    # the target's parts are enough once every feature file is there; else the whole target computes the missing
    target = target_for_features(target, config, draft_config.target_layer_ids,
                                 {"train": train_examples, "eval": eval_examples}, dtype, accelerator.device)
    target.requires_grad_(False)
    # a fresh draft's head starts as the target's rows where asked; a grown one's new rows always do (mapped)
    init_head = config.init_head_from_target if initial_draft is None else grows
    draft = build_draft(draft_config, target, draft_token_ids, init_head, config.init_layer_from_target)
    if initial_draft is not None:
        load_initial_weights(draft, initial_draft)
    draft.to(accelerator.device)
    ttt = TrainingTimeTest(draft, steps=config.ttt_steps, decay=config.step_decay, loss=config.loss)
    held_out_ttt = TrainingTimeTest(draft, steps=config.eval_ttt_steps, decay=config.step_decay,  # same draft
                                    loss=config.loss)

    world_size, rank = accelerator.num_processes, accelerator.process_index
    lengths = [len(example.input_ids) for example in train_examples]
    rounds_per_epoch = len(epoch_batches(lengths, config.batch_size, config.seed, 0)) // world_size
    if rounds_per_epoch < config.gradient_accumulation_steps:
        raise ValueError(
            f"{len(train_examples)} training conversations make {rounds_per_epoch} batch rounds per epoch, fewer than "
            f"--gradient-accumulation-steps {config.gradient_accumulation_steps}: use more data or smaller batches."
        )
    accumulation = config.gradient_accumulation_steps
    total_steps = config.max_steps or max(1, int(config.epochs * rounds_per_epoch) // accumulation)
    optimizer = torch.optim.AdamW(
        [p for p in draft.parameters() if p.requires_grad],
        lr=config.learning_rate,
        betas=(0.9, 0.95),
        weight_decay=config.weight_decay,
    )
    data_digests = {"data": dataset_digests(config.data),
                    "eval_data": None if config.eval_data is None else dataset_digests(config.eval_data)}
    state = {"step": 0, "epoch": 0, "round": 0, "history": [], "tokens": 0, "train_seconds": 0.0}
    if checkpoint is not None:
        checkpoint, state = resume_from_latest(output_dir, draft, optimizer)
        if state["step"] > total_steps:
            raise ValueError(f"--resume: {checkpoint.name} is past the run's end at step {total_steps}: pass a "
                             f"--max-steps of at least {state['step']}.")
        _check_same_data(checkpoint, state.get("data_digests"), data_digests, config, allow_data_change)
    state["data_digests"] = data_digests
    state["sharded"] = is_sharded(accelerator)  # its checkpoints hold process 0's shard of the optimizer state
    if accelerator.is_main_process:
        (output_dir / "train_config.json").write_text(json.dumps(asdict(config), indent=2))
    # The learning rate is a function of the step and the run's length: at step `state["step"]` of a run of
    # `total_steps` (on resume, of its new length when --max-steps / --epochs changed). The scheduler stays
    # unwrapped: total_steps already counts optimizer steps across processes, and accelerate's wrapper would step it
    # once per process.
    scheduler = get_cosine_schedule_with_warmup(optimizer, config.warmup_steps, total_steps,
                                                last_epoch=state["step"] - 1)
    ignore_shared_embedding(accelerator, ttt)
    ttt, optimizer = accelerator.prepare(ttt, optimizer)

    features = TargetFeatures(target, draft_config.target_layer_ids, config.precompute_features)
    if config.precompute_features is not None:  # each process writes its share, then all read every file
        for split, examples in (("train", train_examples), ("eval", eval_examples)):
            features.precompute(examples, split, config.precompute_batch_tokens, rank, world_size,
                                progress and accelerator.is_main_process)
        accelerator.wait_for_everyone()
    # The cap holds for all processes together, so the held-out batches (and their metrics) do not depend on how many
    # processes there are; a process may get none (see `evaluate`).
    eval_batches = epoch_batches([len(e.input_ids) for e in eval_examples], config.batch_size, config.seed, 0)
    eval_batches = eval_batches[: config.eval_batches][rank :: world_size]
    if accelerator.is_main_process:
        share = coverage(train_examples, draft_token_ids, draft_config.vocab_size)
        accelerator.print(f"draft vocabulary: {config.draft_vocab_size} tokens cover {share:.1%} of the responses")

    tree_prompts = held_out_prompts(eval_examples[: config.eval_tree_prompts], target.device)[rank::world_size]

    def run_evaluation(current: Eagle3DraftModel):
        summary = evaluate(held_out_ttt, features, eval_examples, eval_batches, "eval", accelerator)
        if summary and config.eval_tree_prompts:
            summary["tree"] = EVAL_TREE
            summary["tree_tau"] = tree_tau(current, target, tree_prompts, accelerator)
        return summary

    def training_batches():  # this process's batches from the data position on, epoch after epoch
        epoch, start = state["epoch"], state["round"]
        while True:
            ours = epoch_batches(lengths, config.batch_size, config.seed, epoch)[rank : rounds_per_epoch * world_size
                                                                                 : world_size]
            yield from features.batches(train_examples, ours[start:], "train", config.feature_workers)
            epoch, start = epoch + 1, 0

    stream = training_batches()
    show_progress = progress and accelerator.is_main_process
    bar = tqdm(total=total_steps, initial=state["step"], desc="training", disable=not show_progress)
    ttt.train()
    while state["step"] < total_steps:
        started = time.perf_counter()
        step_tokens = torch.zeros((), dtype=torch.long)
        step_metrics = None
        for micro_step in range(accumulation):
            if state["round"] >= rounds_per_epoch:
                state["epoch"], state["round"] = state["epoch"] + 1, 0
            batch = next(stream)
            state["round"] += 1
            target_features = batch["features"]
            target_view = target_distribution(batch["final_hidden"], target.lm_head, draft.draft_to_target)
            device = target_features.device
            last_micro_step = micro_step == accumulation - 1
            with accelerator.no_sync(ttt) if not last_micro_step else nullcontext(), accelerator.autocast():
                input_ids, loss_mask = batch["input_ids"].to(device), batch["loss_mask"].to(device)
                output = ttt(input_ids, target_features, *target_view, loss_mask)
                if not torch.isfinite(output.loss):
                    raise FloatingPointError(
                        f"The training loss became {output.loss.item()} at step {state['step'] + 1}: lower "
                        "--learning-rate or --max-grad-norm, or train in float32 (--no-bf16); resume from the last "
                        "checkpoint with --resume."
                    )
                accelerator.backward(output.loss / accumulation)
            step_tokens += batch["num_tokens"]
            accuracies = output.step_correct / output.step_counts.clamp(min=1)
            metrics = torch.stack([output.loss.detach().float(), *accuracies])
            step_metrics = metrics if step_metrics is None else step_metrics + metrics
        accelerator.clip_grad_norm_(ttt.parameters(), config.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        state["step"] += 1
        state["tokens"] += int(accelerator.reduce(step_tokens.to(accelerator.device), "sum"))
        state["train_seconds"] += time.perf_counter() - started

        step_metrics = accelerator.reduce(step_metrics.to(accelerator.device), "mean") / accumulation
        loss, accuracies = step_metrics[0].item(), step_metrics[1:].tolist()
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", acc="/".join(f"{a:.2f}" for a in accuracies),
                        tok_s=f"{state['tokens'] / state['train_seconds']:.0f}")
        if state["step"] % config.log_every == 0 or state["step"] == total_steps:
            state["history"].append({"step": state["step"], "train_loss": loss, "train_accuracy": accuracies,
                                     "lr": scheduler.get_last_lr()[0], "tokens": state["tokens"],
                                     "tokens_per_second": state["tokens"] / state["train_seconds"]})
        evaluating = state["step"] % config.eval_every == 0 or state["step"] == total_steps
        saving = state["step"] % config.save_every == 0 or state["step"] == total_steps
        current = whole_draft(accelerator, ttt) if evaluating or saving else None  # all processes, under FSDP
        if evaluating:
            summary = run_evaluation(current)
            if summary:
                best = selection_tau(summary) > max((selection_tau(entry["eval"]) for entry in state["history"]
                                                     if "eval" in entry), default=0.0)
                state["history"].append({"step": state["step"], "eval": summary | {"best": best}})
                if best and accelerator.is_main_process:
                    save_best_draft(output_dir, current)
                if accelerator.is_main_process:  # above the progress bar, not onto it
                    tqdm.write(f"step {state['step']}: held-out n-α {' '.join(f'{a:.2f}' for a in summary['alpha'])}, "
                               f"chain τ {summary['chain_tau']:.2f}"
                               + (f", τ at the reference tree {summary['tree_tau']:.2f}"
                                  if summary.get("tree_tau") else ""))
        if accelerator.is_main_process and saving:
            save_checkpoint(output_dir, current, optimizer, state, config.keep_checkpoints)
            (output_dir / "history.json").write_text(json.dumps(state["history"], indent=1))
            plot_history(state["history"], output_dir / "training.png", config.step_decay)
        accelerator.wait_for_everyone()
    bar.close()

    draft = whole_draft(accelerator, ttt)
    if accelerator.is_main_process:
        record_acceptance_profile(draft, target, eval_examples[: config.profile_prompts], show_progress)
        save_draft(draft, output_dir / "draft", getattr(torch, config.save_dtype))
        print(speed_verdict(draft, target, output_dir / "draft", config.target))
    return draft


def speed_verdict(draft: Eagle3DraftModel, target, folder: Path, target_name: str | None = None) -> str:
    """A run's last line: whether the draft it wrote decodes faster than plain decoding on this machine, as
    `tree_shape="auto"` predicts from its acceptance profile and this machine's costs (measured once and cached), and
    the command that measures it against `target_name` (the run's `--target`)."""
    bench = f"hf-eagle3 bench {f'--target {target_name} ' if target_name else ''}--draft {folder}"
    if not draft.config.acceptance_profile:
        return (f"Wrote {folder}, without an acceptance profile (--profile-prompts 0 or no held-out prompt), so "
                f"whether it decodes faster than plain decoding is not known: measure it with `{bench}`.")
    if not is_whole(target):
        return (f"Wrote {folder}; the run loaded only the target's embedding, final norm and LM head "
                f"(--target-weights), so whether the draft decodes faster than plain decoding is not known: measure "
                f"it with `{bench}`.")
    choice = choose_tree(target, draft)
    if choice.settings is None:
        return (f"Wrote {folder}, which is not predicted to decode faster than plain decoding on this machine "
                f"(generate decodes plainly with it): {choice.reason}")
    return (f"Wrote {folder}, predicted at {choice.predicted_speedup:.2f}x plain decoding on this machine: "
            f"{choice.reason}. `{bench}` measures it.")


# ------------------------------------------------------------------------------------------------------------ CLI


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="Train an EAGLE-3 draft with training-time test on data from `hf-eagle3 prepare-data`.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = TrainConfig(data="", output_dir="")
    for setting in fields(TrainConfig):
        flag, help_text = "--" + setting.name.replace("_", "-"), setting.metadata["help"]
        default = getattr(defaults, setting.name)
        if setting.name in ("data", "output_dir"):
            parser.add_argument(flag, required=True, help=help_text)
            continue
        kind = next(kind for kind in typing.get_args(setting.type) or (setting.type,) if kind is not type(None))
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            parser.add_argument(flag, type=kind, default=default, help=help_text)
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in --output-dir; may change only "
                             + ", ".join("--" + name.replace("_", "-") for name in RESUMABLE_CHANGES
                                         if name != "output_dir")
                             + " (and --output-dir, to a moved run); refuses data that changed since the checkpoint")
    parser.add_argument("--allow-data-change", action="store_true",
                        help="with --resume: continue on data whose shards changed since the checkpoint (rebuilt, "
                             "edited, shrunk or grown), from the old data's position, instead of refusing")
    parser.set_defaults(run=_run_cli)


def _run_cli(args: argparse.Namespace) -> Eagle3DraftModel:
    require("`hf-eagle3 train`", {"accelerate": "train", "matplotlib": "train"})  # matplotlib: at each checkpoint
    config = TrainConfig(**{setting.name: getattr(args, setting.name) for setting in fields(TrainConfig)})
    return train(config, resume=args.resume, allow_data_change=args.allow_data_change)


__all__ = [
    "TrainConfig",
    "acceptance_summary",
    "build_draft",
    "draft_config_for",
    "epoch_batches",
    "evaluate",
    "latest_checkpoint",
    "plot_history",
    "train",
    "trainable_state_dict",
]
