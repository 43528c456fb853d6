"""The layout `Eagle3DraftModel.save_pretrained` writes once hf_eagle3 is imported: SpecForge / SGLang's
`LlamaForCausalLMEagle3`, which vLLM and SGLang load by repository id and `Eagle3DraftModel.from_pretrained` reads back
exactly (hf-eagle3's own settings kept under the `hf_eagle3` key, which the engines ignore).

Its weights are hf-eagle3's own (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`), so transformers writes them
(shards, `state_dict`, `is_main_process` as it always does) and the `sglang` export's config then replaces hf-eagle3's
in one rename: the folder holds a complete draft in one layout or the other at every moment. A draft the layout
cannot express (`sglang.refusal`) is saved in hf-eagle3's own layout, with a warning that says why and what serves it.
"""

from pathlib import Path

from transformers.utils import logging

from ..modeling_eagle3 import Eagle3DraftModel
from . import sglang
from .checkpoint import DraftCheckpoint
from .files import replace_config

logger = logging.get_logger(__name__)


def save_served(model: Eagle3DraftModel, save_directory: str | Path, *args, **kwargs) -> None:
    """`model.save_pretrained(save_directory, *args, **kwargs)` in the served layout; `import hf_eagle3` registers it
    with `Eagle3DraftModel.register_checkpoint_writer`."""
    if kwargs.get("push_to_hub"):
        raise ValueError(
            "save_pretrained(push_to_hub=True) would upload the folder before its config is written in the served "
            "layout: call draft.push_to_hub(repo_id) instead, which saves the draft in that layout and adds a model "
            "card."
        )
    checkpoint = DraftCheckpoint.from_model(model, kwargs.get("state_dict"))
    reason = sglang.refusal(checkpoint.config)
    model.save_pretrained(save_directory, *args, served_layout=False, **kwargs)
    if reason is not None:
        logger.warning(
            f"{save_directory} is saved in hf-eagle3's own layout (model_type eagle3), which vLLM and SGLang cannot "
            f"load by id: {reason}"
        )
    elif kwargs.get("is_main_process", True):
        replace_config(Path(save_directory), sglang.served_config(checkpoint))
