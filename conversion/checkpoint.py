"""The internal representation every checkpoint format is read into and written from.

A [`DraftCheckpoint`] is an [`Eagle3Config`] plus a flat state dict under [`Eagle3DraftModel`]'s own weight names.
[`DraftCheckpoint.build`] is the one place where a checkpoint is checked (key set, shapes, dtypes, vocabulary
mapping, target layer ids) and put in canonical form (draft vocabulary in ascending target-id order), so a format
module only renames keys and translates config fields.
"""

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError

from ..configuration_eagle3 import Eagle3Config
from ..modeling_eagle3 import Eagle3DraftModel
from ..utils.transformers_api import keys_not_saved

# Buffers mapping draft ids to target ids: `d2t[i]` is the offset of draft id i (target id = i + d2t[i]) and
# `t2d[t]` says whether target id t is in the draft vocabulary. Both may be absent from a source checkpoint.
VOCABULARY_BUFFERS = ("d2t", "t2d")

MISSING_TARGET_LAYERS_HINT = (
    "The target's layer count is needed to derive the default taps (hidden_states 2, N//2 and N-3 of an N-layer "
    "target); a draft config's own num_hidden_layers is the draft's, not the target's. Pass --target-num-layers N "
    "or --target-config path/to/target/config.json (Python: target=TargetInfo(num_hidden_layers=N))."
)


class ConversionError(ValueError):
    """A checkpoint that cannot be converted faithfully; the message names the problem and the fix."""


class UnknownFormatError(ConversionError):
    """A checkpoint whose files match no draft format: not a draft, or one whose format must be named (`--from`)."""


@dataclass(frozen=True)
class TargetInfo:
    """What the user tells the converter about the target model; every field is optional.

    Formats that do not record which target layers the draft reads need `num_hidden_layers`, unless
    `known_at_generate` says the target will be given to `generate` (which then takes the default taps from it); the
    other fields are recorded in the converted config and cross-checked against the checkpoint.
    """

    num_hidden_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    model_type: str | None = None
    name_or_path: str | None = None
    known_at_generate: bool = False

    @classmethod
    def from_config_dict(cls, config: dict[str, Any], name_or_path: str | None = None) -> "TargetInfo":
        """Read a target's `config.json` contents (the text config's sizes for a multimodal model)."""
        text_config = config.get("text_config") or config
        return cls(
            num_hidden_layers=text_config.get("num_hidden_layers"),
            hidden_size=text_config.get("hidden_size"),
            vocab_size=text_config.get("vocab_size"),
            model_type=config.get("model_type"),
            name_or_path=name_or_path,
        )


YARN_MSCALE_READINGS = ("transformers", "serving")


@dataclass(frozen=True)
class ReadOptions:
    """Choices the user makes where a source format's engines read one checkpoint in different ways.

    `yarn_mscale`: how YaRN's `mscale` / `mscale_all_dim` are read. `"transformers"` (the default) keeps them, as
    transformers and SpecForge's training read them (the attention factor is their ratio of YaRN mscales);
    `"serving"` drops them, as SGLang and vLLM serve such drafts (attention factor `0.1 ln(factor) + 1`).
    """

    yarn_mscale: str = "transformers"

    def __post_init__(self):
        if self.yarn_mscale not in YARN_MSCALE_READINGS:
            raise ConversionError(
                f"yarn_mscale must be one of {', '.join(YARN_MSCALE_READINGS)}, got {self.yarn_mscale!r}."
            )


@dataclass(frozen=True)
class DraftCheckpoint:
    """An EAGLE-3 draft in our terms. Create it with [`DraftCheckpoint.build`], which validates everything."""

    config: Eagle3Config
    tensors: dict[str, torch.Tensor]
    # The target's input embedding, for formats whose loaders need a shared embedding written (speculators).
    target_embedding: torch.Tensor | None = None

    @classmethod
    def build(
        cls, fields: dict[str, Any], tensors: dict[str, torch.Tensor], target: TargetInfo | None = None
    ) -> "DraftCheckpoint":
        """Validate a draft given as `Eagle3Config` fields and a state dict under our weight names.

        `d2t` / `t2d` may be missing (identity vocabulary when `draft_vocab_size == vocab_size`; `t2d` is rebuilt
        from `d2t`). A `d2t` listed in any order (ModelOpt lists it by frequency) is sorted into ascending target
        ids together with the rows of `lm_head`, which leaves the draft's predictions unchanged. Unless `fields`
        says otherwise, the draft shares the target's embedding exactly when `tensors` has no `embed_tokens.weight`.
        `target` fills in, and is checked against, what the checkpoint records about the target.

        Raises:
            ConversionError: a missing, unknown or misshapen tensor, a buffer of the wrong dtype, an inconsistent
                vocabulary mapping, or target layer ids that are absent or outside the target.
        """
        fields = {"share_target_embedding": "embed_tokens.weight" not in tensors, **fields}
        config = _build_config(fields, target or TargetInfo())
        _check_embedding_width(config)
        tensors = dict(tensors)
        _check_tensors(config, tensors)
        tensors.update(_canonical_vocabulary(config, tensors))
        return cls(config, tensors)

    @classmethod
    def from_model(
        cls, model: Eagle3DraftModel, state_dict: dict[str, torch.Tensor] | None = None
    ) -> "DraftCheckpoint":
        """The draft `model` as `save_pretrained` saves it (its config, and `state_dict` or its own weights without
        the target's modules), validated by [`DraftCheckpoint.build`]."""
        ignored = keys_not_saved(model)
        tensors = {name: tensor.detach().cpu() for name, tensor in (state_dict or model.state_dict()).items()
                   if name not in ignored}
        fields = copy.deepcopy({name: getattr(model.config, name) for name in Eagle3Config.__annotations__})
        return cls.build(fields, tensors, TargetInfo(known_at_generate=True))

    def sharing_target_embedding(self) -> "DraftCheckpoint":
        """This draft without its own `embed_tokens`, sharing the target's input embedding at run time instead."""
        config = copy.deepcopy(self.config)
        config.share_target_embedding = True
        _check_embedding_width(config)
        tensors = {name: tensor for name, tensor in self.tensors.items() if name != "embed_tokens.weight"}
        return DraftCheckpoint(config, tensors, self.tensors.get("embed_tokens.weight"))

    def with_target_embedding(self, embedding: torch.Tensor) -> "DraftCheckpoint":
        """This draft together with its target's input embedding `[vocab_size, hidden_size]`, which exports to
        formats whose loaders need it write as the draft's own `embed_tokens` (the config still says it is shared)."""
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(embedding.shape) != expected:
            raise ConversionError(
                f"The target's input embedding has shape {tuple(embedding.shape)}, the draft expects {expected} "
                "(vocab_size, hidden_size): it is not the embedding of this draft's target."
            )
        return dataclasses.replace(self, target_embedding=embedding.to(self.dtype).contiguous())

    @property
    def dtype(self) -> torch.dtype:
        """The floating-point dtype shared by every weight."""
        return self.tensors["fc.weight"].dtype


@dataclass(frozen=True)
class SourceFiles:
    """A checkpoint folder as found on disk: its `config.json` and every tensor of its weight files."""

    path: Path
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    def has_weights_under(self, prefix: str) -> bool:
        return any(name.startswith(prefix) for name in self.tensors)


@dataclass(frozen=True)
class CheckpointFormat:
    """One checkpoint format: how to recognise it, read it into a `DraftCheckpoint` and (if exportable) write it."""

    name: str
    description: str
    detect: Callable[[SourceFiles], bool]
    read: Callable[[SourceFiles, TargetInfo, ReadOptions], DraftCheckpoint]
    write: Callable[[DraftCheckpoint, Path], None] | None = None


def rename_prefix(tensors: dict[str, torch.Tensor], old: str, new: str) -> dict[str, torch.Tensor]:
    """`tensors` with the leading `old` of every name that has one replaced by `new`."""
    return {new + name.removeprefix(old) if name.startswith(old) else name: tensor for name, tensor in tensors.items()}


def meta_model(config: Eagle3Config) -> Eagle3DraftModel:
    """An `Eagle3DraftModel` without storage: the authority on weight names, shapes and buffer dtypes."""
    with torch.device("meta"):
        return Eagle3DraftModel(copy.deepcopy(config))


def _saved_tensor_specs(config: Eagle3Config) -> dict[str, torch.Tensor]:
    """The (meta) tensors `Eagle3DraftModel.save_pretrained` writes for `config`, by name."""
    model = meta_model(config)
    ignored = keys_not_saved(model)
    return {name: tensor for name, tensor in model.state_dict().items() if name not in ignored}


def _build_config(fields: dict[str, Any], target: TargetInfo) -> Eagle3Config:
    fields = dict(fields)
    for field, told in (
        ("target_num_hidden_layers", target.num_hidden_layers),
        ("target_model_type", target.model_type),
        ("target_name_or_path", target.name_or_path),
    ):
        recorded = fields.get(field)
        if told is not None and recorded not in (None, told):
            raise ConversionError(f"The checkpoint records {field}={recorded!r} but the target given has {told!r}.")
        if told is not None:
            fields[field] = told
    if fields.get("target_layer_ids") is None and fields.get("target_num_hidden_layers") is None and not (
        target.known_at_generate
    ):
        raise ConversionError(
            "The checkpoint does not record which target hidden states the draft reads. " + MISSING_TARGET_LAYERS_HINT
        )
    try:
        config = Eagle3Config(**fields)
    except StrictDataclassError as error:
        raise ConversionError(f"The checkpoint's config does not describe a valid EAGLE-3 draft: {error}") from error

    for field, told, recorded in (
        ("hidden_size", target.hidden_size, config.target_hidden_size),
        ("vocab_size", target.vocab_size, config.vocab_size),
    ):
        if told is not None and told != recorded:
            raise ConversionError(
                f"The draft was made for a target with {field} {recorded}, the target given has {told}."
            )
    num_layers = config.target_num_hidden_layers
    if num_layers is not None and not all(0 <= i <= num_layers for i in config.target_layer_ids):
        raise ConversionError(
            f"Target layer ids {config.target_layer_ids} (transformers hidden_states indices) lie outside a target "
            f"with {num_layers} layers (valid: 0..{num_layers}). Check the layer-id convention of the source format "
            "and the target's layer count."
        )
    return config


def _check_embedding_width(config: Eagle3Config) -> None:
    if config.share_target_embedding and config.target_hidden_size != config.hidden_size:
        raise ConversionError(
            f"The draft would share the target's token embedding (it has no embed_tokens.weight of its own, or "
            f"--share-target-embedding was given), but the target's embedding is target_hidden_size="
            f"{config.target_hidden_size} wide and the draft's hidden_size is {config.hidden_size}: the target's "
            "embedding cannot feed this draft. Convert a checkpoint that includes the draft's embed_tokens.weight."
        )


def _check_tensors(config: Eagle3Config, tensors: dict[str, torch.Tensor]) -> None:
    expected = _saved_tensor_specs(config)
    missing = sorted(expected.keys() - tensors.keys() - set(VOCABULARY_BUFFERS))
    unknown = sorted(tensors.keys() - expected.keys())
    if missing or unknown:
        raise ConversionError(
            f"The checkpoint's weights do not match an Eagle3DraftModel (names after translation to ours): "
            f"missing {missing}, unknown {unknown}. Nothing was converted; check the source format (--from)."
        )
    wrong_shapes = [
        f"{name} {tuple(tensor.shape)} (expected {tuple(expected[name].shape)})"
        for name, tensor in sorted(tensors.items())
        if tensor.shape != expected[name].shape
    ]
    if wrong_shapes:
        raise ConversionError(f"Weights with the wrong shape for the config: {', '.join(wrong_shapes)}.")
    for name in VOCABULARY_BUFFERS:
        if name in tensors and tensors[name].dtype != expected[name].dtype:
            raise ConversionError(
                f"Buffer {name} has dtype {tensors[name].dtype}; EAGLE-3 checkpoints store it as "
                f"{expected[name].dtype}."
            )
    not_finite = sorted(name for name, tensor in tensors.items()
                        if tensor.is_floating_point() and not torch.isfinite(tensor).all())
    if not_finite:
        raise ConversionError(f"The checkpoint has NaN or infinite values in {', '.join(not_finite)}: it would draft "
                              "garbage. Convert a checkpoint saved before training diverged.")
    weight_dtypes = {tensor.dtype for name, tensor in tensors.items() if name not in VOCABULARY_BUFFERS}
    if len(weight_dtypes) != 1 or not next(iter(weight_dtypes)).is_floating_point:
        raise ConversionError(
            f"Weights must share one floating-point dtype, found {sorted(map(str, weight_dtypes))}. "
            "Cast the checkpoint to one dtype before converting."
        )


def _canonical_vocabulary(config: Eagle3Config, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`d2t`, `t2d` and `lm_head.weight` (unless the target's is used) with the draft vocabulary in ascending
    target-id order."""
    vocab_size, draft_vocab_size = config.vocab_size, config.draft_vocab_size
    draft_ids = torch.arange(draft_vocab_size)
    d2t = tensors.get("d2t")
    if d2t is None:
        if draft_vocab_size != vocab_size:
            raise ConversionError(
                f"The checkpoint has no d2t but a reduced draft vocabulary ({draft_vocab_size} of {vocab_size} "
                "tokens): without the mapping, engines fall back to target ids 0..draft_vocab_size-1 and acceptance "
                "collapses. Convert the checkpoint the trainer saved together with its d2t."
            )
        d2t = torch.zeros(draft_vocab_size, dtype=torch.long)
    target_ids = draft_ids + d2t
    if target_ids.min() < 0 or target_ids.max() >= vocab_size:
        raise ConversionError(
            f"d2t maps draft ids to target ids in [{target_ids.min()}, {target_ids.max()}], outside the target "
            f"vocabulary [0, {vocab_size}). The checkpoint's vocab_size or d2t is wrong."
        )
    if target_ids.unique().numel() != draft_vocab_size:
        raise ConversionError("d2t maps two draft ids to the same target id; the vocabulary mapping is corrupt.")

    order = torch.argsort(target_ids)
    target_ids = target_ids[order]
    head = {} if config.share_target_lm_head else {"lm_head.weight": tensors["lm_head.weight"]}
    if head and not torch.equal(order, draft_ids):
        head["lm_head.weight"] = head["lm_head.weight"][order].contiguous()

    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    recorded_t2d = tensors.get("t2d")
    if recorded_t2d is not None and int(recorded_t2d.sum()) != draft_vocab_size:
        raise ConversionError(
            f"t2d marks {int(recorded_t2d.sum())} target tokens but the draft vocabulary has {draft_vocab_size}."
        )
    if recorded_t2d is not None and not torch.equal(recorded_t2d, t2d):
        raise ConversionError("t2d and d2t disagree about which target tokens the draft predicts.")
    return {"d2t": target_ids - draft_ids, "t2d": t2d, **head}
