"""Checks that a draft fits a target before anything runs (the transformers releases supported:
`utils.transformers_api`)."""

import os
from pathlib import Path

from transformers import PreTrainedModel
from transformers.utils import logging

from ..configuration_eagle3 import Eagle3Config, default_target_layer_ids
from ..utils.fingerprint import weights_fingerprint

logger = logging.get_logger(__name__)
SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


def target_layer_ids(draft_config: Eagle3Config, target: PreTrainedModel) -> list[int] | None:
    """The target `hidden_states` the draft reads: those its config records, else (official EAGLE-3 and AngelSlim
    drafts loaded directly do not record them) the default taps of `target`, as the official code and vLLM choose."""
    num_layers = getattr(target.config.get_text_config(), "num_hidden_layers", None)
    if draft_config.target_layer_ids is not None or num_layers is None:
        return draft_config.target_layer_ids
    layer_ids = default_target_layer_ids(num_layers)
    logger.warning_once(
        f"The draft does not record which target layers it reads: using hidden_states {layer_ids} of this "
        f"{num_layers}-layer target, the official choice."
    )
    return layer_ids


def adopt_target_layers(draft_config: Eagle3Config, target: PreTrainedModel) -> None:
    """Record in `draft_config` the target layers it reads (`target_layer_ids`), where it does not say."""
    if draft_config.target_layer_ids is None and (layer_ids := target_layer_ids(draft_config, target)) is not None:
        draft_config.target_num_hidden_layers = target.config.get_text_config().num_hidden_layers
        draft_config.target_layer_ids = layer_ids


def check_compatibility(draft_config: Eagle3Config, target: PreTrainedModel, layer_ids: list[int] | None = None
                        ) -> None:
    """Raise one `ValueError` naming every way `draft_config` does not fit `target`; return silently if it fits.
    `layer_ids`: the target layers the draft reads, where they are not its config's (`target_layer_ids`)."""
    target_config = target.config.get_text_config()
    problems = []
    for field in ("hidden_size", "vocab_size", "num_hidden_layers"):
        if getattr(target_config, field, None) is None:
            problems.append(f"the target config has no `{field}`")
    if problems:
        raise ValueError("The draft cannot be checked against this target: " + "; ".join(problems) + ".")

    if draft_config.target_hidden_size != target_config.hidden_size:
        problems.append(
            f"draft target_hidden_size={draft_config.target_hidden_size} but the target's hidden_size is "
            f"{target_config.hidden_size}"
        )
    if draft_config.vocab_size != target_config.vocab_size:
        problems.append(
            f"draft vocab_size={draft_config.vocab_size} but the target's vocab_size is {target_config.vocab_size}"
        )
    problems += _layer_problems(draft_config, draft_config.target_layer_ids if layer_ids is None else layer_ids,
                                target_config.num_hidden_layers)
    embedding = target.get_input_embeddings()
    expected = (draft_config.vocab_size, draft_config.hidden_size)
    if draft_config.share_target_embedding and tuple(embedding.weight.shape) != expected:
        problems.append(
            f"the target's input embedding has shape {tuple(embedding.weight.shape)}, the draft shares it and "
            f"needs {expected}"
        )
    head = target.get_output_embeddings()
    if draft_config.share_target_lm_head and (head is None or tuple(head.weight.shape) != expected):
        problems.append(
            f"the target's lm_head has shape {None if head is None else tuple(head.weight.shape)}, the draft shares "
            f"it and needs {expected}"
        )
    if problems:
        raise ValueError(
            "This EAGLE-3 draft does not fit the target model: " + "; ".join(problems) + ". Use a draft trained "
            "for this target (its config records `target_name_or_path`), or train one with `hf-eagle3 train`."
        )
    if trained_for_another_model(draft_config, target):
        logger.warning_once(
            f"This EAGLE-3 draft was trained for {draft_config.target_name_or_path!r}, and the target "
            f"{target.config.name_or_path!r} is another model (its config or weights differ from what the draft "
            "records): its shapes fit, so decoding stays lossless, but a draft trained for another model accepts few "
            "tokens. Use the draft made for this target."
        )


def trained_for_another_model(draft_config: Eagle3Config, target: PreTrainedModel) -> bool:
    """Whether `target` is another model than the one the draft was trained for, by what identifies a model rather
    than its path: the weights' fingerprint when the draft records one (`target_fingerprint`), else the recorded
    architecture (model type, layers), else the names when the target's is a Hub id rather than a local folder."""
    trained_for, target_name = model_name(draft_config.target_name_or_path), model_name(target.config.name_or_path)
    if not trained_for or not target_name or trained_for == target_name:
        return False
    if draft_config.target_fingerprint is not None:
        return weights_fingerprint(target) != draft_config.target_fingerprint
    target_config = target.config.get_text_config()
    if draft_config.target_model_type not in (None, target_config.model_type) or \
            draft_config.target_num_hidden_layers not in (None, target_config.num_hidden_layers):
        return True
    name = str(target.config.name_or_path)
    return not (os.path.isabs(name) or name.startswith(".") or Path(name).exists())


def _layer_problems(draft_config: Eagle3Config, layer_ids: list[int] | None, num_layers: int) -> list[str]:
    if layer_ids is None:
        return ["the draft config has no `target_layer_ids` (set it, or `target_num_hidden_layers`)"]
    if not all(0 <= i <= num_layers for i in layer_ids):
        return [f"draft target_layer_ids={layer_ids} are outside the target's hidden_states indices 0..{num_layers}"]
    if draft_config.converted_from is not None and num_layers in layer_ids:
        return [(
            f"the draft, converted from {draft_config.converted_from['format']}, reads the output of the target's "
            f"last layer, which its engines take before the target's final norm, but transformers' "
            f"hidden_states[{num_layers}] is taken after it"
        )]
    return []


def record_target_special_tokens(draft_config: Eagle3Config, target: PreTrainedModel) -> None:
    """Give `draft_config` the target's special-token ids (`bos_token_id`, `eos_token_id`, `pad_token_id`): the draft
    shares the target's tokenizer, and pipelines read these ids to tell that an assistant does."""
    target_config = target.config.get_text_config()
    for name in SPECIAL_TOKENS:
        setattr(draft_config, name, getattr(target_config, name, None))


def model_name(name_or_path: str | None) -> str | None:
    """`org/Model-Name` or `/path/to/Model-Name` -> `model-name`, to compare a Hub id with a local copy's path."""
    return str(name_or_path).rstrip("/").rsplit("/", 1)[-1].lower() if name_or_path else None
