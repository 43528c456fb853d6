"""Foreign checkpoints as `Eagle3DraftModel.from_pretrained` loads them: detected and converted in memory.

`import hf_eagle3` registers [`read_foreign`] with `Eagle3DraftModel.register_checkpoint_reader`, so a folder or Hub
repo in another project's format loads as `hf-eagle3 convert` would convert it. Target layers such a checkpoint does
not record are taken from the target when `generate` first sees the draft.
"""

from pathlib import Path

import torch
from transformers.utils import logging

from ..configuration_eagle3 import Eagle3Config, is_served_layout
from .checkpoint import TargetInfo
from .convert import read_checkpoint

logger = logging.get_logger(__name__)


def read_foreign(
    source: str | Path, from_format: str | None, hub_kwargs: dict
) -> tuple[Eagle3Config, dict[str, torch.Tensor]] | None:
    """The draft at `source` converted in memory, as `(config, state_dict)`, when it is in another project's format
    (or `from_format` names one); `None` for our own layouts (hf-eagle3's and the served one `save_pretrained` writes),
    and for a `source` without a readable config (the regular loader names that problem)."""
    if from_format in (None, "hub") and not _is_foreign(source, hub_kwargs):
        return None
    download = {name: value for name, value in hub_kwargs.items() if name != "subfolder"}
    checkpoint, format_name = read_checkpoint(source, from_format, TargetInfo(known_at_generate=True), None, download)
    notes = (checkpoint.config.converted_from or {}).get("notes", [])
    logger.warning(
        f"{source} is a {format_name} checkpoint: converted in memory (`hf-eagle3 convert` writes the conversion "
        "to disk)" + (": " + " ".join(notes) if notes else ".")
    )
    return checkpoint.config, checkpoint.tensors


# `architectures` of EAGLE-3 drafts in the SpecForge / SGLang layout (SpecForge's and vLLM's names).
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def is_eagle3_draft(config: dict) -> bool:
    """Whether the `config.json` contents `config` describe an EAGLE-3 draft, in our format or another project's
    (SpecForge / SGLang / AngelSlim / ModelOpt architectures, speculators' `speculators_model_type`, or the official
    drafts' `draft_vocab_size`), as opposed to a causal LM."""
    return (
        config.get("model_type") == Eagle3Config.model_type
        or config.get("speculators_model_type") == "eagle3"
        or any(name in EAGLE3_ARCHITECTURES for name in config.get("architectures") or [])
        or "draft_vocab_size" in config
    )


def _is_foreign(source: str | Path, hub_kwargs: dict) -> bool:
    try:
        config, _ = Eagle3Config.get_config_dict(source, **hub_kwargs)
    except (OSError, ValueError):  # no config, or a damaged one: the regular loader names the problem
        return False
    return config.get("model_type") != Eagle3Config.model_type and not is_served_layout(config)
