"""The draft under FSDP (`accelerate launch --use_fsdp`): its shared target embedding kept out of the shards, and the
whole draft gathered where one is needed (held-out decoding, saving).

Under DDP every process holds the whole draft, and `accelerator.unwrap_model(ttt).draft` is it. FSDP shards the
parameters of the module it wraps over the processes. The draft's token embedding is the target's (frozen, shared,
never saved with the draft): sharded, it would become a copy apart from the target's. Listed among the modules FSDP
ignores, it stays the target's tensor, whole on every process, with no gradient and no optimizer state. The draft's
own weights are gathered from all processes into a plain draft on that embedding: every process takes part.
"""

import re

import torch

from ..modeling_eagle3 import Eagle3DraftModel
from ..utils.transformers_api import keys_not_saved


def is_sharded(accelerator) -> bool:
    """Whether the run's draft is sharded over its processes (FSDP)."""
    return accelerator.distributed_type == "FSDP"  # accelerate's DistributedType.FSDP (a string enum)


def ignore_shared_embedding(accelerator, ttt: torch.nn.Module) -> None:
    """Before `accelerator.prepare(ttt, ...)`: add the draft's token embedding (the target's) to the modules FSDP
    ignores, beside any the launch configuration names (`FSDP_IGNORED_MODULES`, a pattern of module names)."""
    if not is_sharded(accelerator):
        return
    plugin = accelerator.state.fsdp_plugin
    ignored = plugin.ignored_modules
    if isinstance(ignored, str):
        ignored = [module for name, module in ttt.named_modules() if re.fullmatch(ignored, name)]
    plugin.ignored_modules = [*(ignored or []), ttt.draft.embed_tokens]


def whole_draft(accelerator, ttt: torch.nn.Module) -> Eagle3DraftModel:
    """The trained draft, whole, on every process: under DDP the wrapped draft itself; under FSDP a plain copy of
    its gathered weights on the target's embedding (all processes must call this together)."""
    draft = accelerator.unwrap_model(ttt).draft
    if not is_sharded(accelerator):
        return draft
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    gathered = get_model_state_dict(accelerator.unwrap_model(ttt), options=StateDictOptions(full_state_dict=True))
    shared = keys_not_saved(draft)
    whole = Eagle3DraftModel(draft.config)
    whole.load_state_dict({name: tensor for name, tensor in
                           ((name.removeprefix("draft."), tensor) for name, tensor in gathered.items())
                           if name not in shared})
    whole.attach_target_embedding(draft.embed_tokens)  # the target's: FSDP ignored it
    return whole.to(accelerator.device).train(draft.training)
