"""EAGLE-3 drafts as the `assistant_model` of transformers pipelines.

`pipeline("text-generation", model=target, assistant_model=draft)` prepares its assistant with
`transformers.pipelines.base.load_assistant_model`. Given a name, that function loads the model by the class names in
its config (transformers knows no EAGLE-3 class) and a tokenizer from the same folder (a draft has none: it shares
the target's); then it compares the special-token ids of both configs to decide whether the assistant needs a
tokenizer of its own. Importing hf_eagle3 wraps it: an EAGLE-3 draft, given as a model or as a path / Hub id (in
any format `Eagle3DraftModel.from_pretrained` reads), is checked against the target and given the target's
special-token ids, and a draft given by name is loaded in the target's dtype on its device, as the pipeline loads
any assistant given by name. Other assistants are left to
transformers. The pipeline is where a draft is taken on as an assistant, so this is the one place hf_eagle3 writes to
a draft's config (`generate` never does).

Why a wrapper: transformers 5.24 offers no extension point here (`Pipeline.__init__` calls this module-level function
by name, and resolves an assistant given by name through the Auto classes for causal LMs, which an EAGLE-3 draft is
not). `install` wraps it once; installing again leaves it as it is.
"""

import functools
import os

from transformers.pipelines import base

from ..configuration_eagle3 import Eagle3Config
from ..conversion.foreign import is_eagle3_draft
from ..modeling_eagle3 import Eagle3DraftModel
from .compatibility import check_compatibility, record_target_special_tokens, target_layer_ids


def _wrap_load_assistant_model(original):
    @functools.wraps(original)
    def load_assistant_model(model, assistant_model, assistant_tokenizer):
        if isinstance(assistant_model, (str, os.PathLike)) and model.can_generate():
            config, _ = Eagle3Config.get_config_dict(assistant_model)  # a damaged draft's config refused
            if is_eagle3_draft(config):  # in any format Eagle3DraftModel.from_pretrained reads
                assistant_model = Eagle3DraftModel.from_pretrained(assistant_model, dtype=model.dtype)
                assistant_model = assistant_model.to(model.device)
        if isinstance(assistant_model, Eagle3DraftModel):
            if assistant_tokenizer is not None:
                raise ValueError(
                    "An EAGLE-3 draft shares the target's tokenizer: drop assistant_tokenizer from the pipeline."
                )
            check_compatibility(assistant_model.config, model, target_layer_ids(assistant_model.config, model))
            record_target_special_tokens(assistant_model.config, model)
        return original(model, assistant_model, assistant_tokenizer)

    return load_assistant_model


def install() -> None:
    """Let pipelines take an EAGLE-3 draft, or its path / Hub id, as `assistant_model` (idempotent)."""
    original = base.load_assistant_model
    if not getattr(original, "_hf_eagle3_hook", False):
        hooked = _wrap_load_assistant_model(original)
        hooked._hf_eagle3_hook = True
        base.load_assistant_model = hooked
