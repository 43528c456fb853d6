"""The parts of a target that training on precomputed features reads: its token embedding (which the draft shares),
its final norm and its LM head (the target's distributions from stored final hidden states).

`load_target_parts` builds the target on the `meta` device (no memory) and reads from its safetensors only the
tensors outside its decoder layers, from the shards that hold them (a Hub id downloads no other shard). The decoder
layers stay on `meta`: the model holds a 70B target's parts in the memory of its embeddings, and cannot run a forward.
"""

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, cached_file

from .loading import TARGET_CHOICES, check_exists
from .smollm2 import smollm2_path

WHOLE_TARGET_FIX = "load the whole target (--target-weights whole)"


def load_target_parts(
    name_or_path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """The target `name_or_path` (as `load_target_model` names it: a folder, a Hub id or `"smollm2"`) in eval mode,
    with its embedding, final norm and LM head (tied or not) read from its safetensors in `dtype` onto `device`, and
    its decoder layers on the `meta` device. Its config, and so its fingerprints, are the whole model's."""
    source = smollm2_path() if name_or_path == "smollm2" else name_or_path
    check_exists(source, "target", TARGET_CHOICES)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=dtype)
    names = part_names(model)
    model.load_state_dict(read_tensors(source, names, dtype, device), strict=False, assign=True)
    model.tie_weights()  # a tied LM head is the embedding just read
    unread = [name for name, tensor in model.state_dict().items() if name in names and tensor.is_meta]
    if unread:
        raise ValueError(f"The checkpoint of {name_or_path} holds no tensor {', '.join(unread)} (its tensors are "
                         f"named otherwise than {type(model).__name__}'s): {WHOLE_TARGET_FIX}.")
    return model.eval()


def part_names(model: PreTrainedModel) -> list[str]:
    """The names of `model`'s state outside its decoder layers (the modules its class never splits across devices,
    `_no_split_modules`): the embedding, the final norm, the LM head."""
    layer_classes = set(model._no_split_modules or ())
    layers = [name for name, module in model.named_modules() if type(module).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (`_no_split_modules`), so its parts "
                         f"cannot be told from its layers: {WHOLE_TARGET_FIX}.")
    return [name for name in model.state_dict() if not any(name.startswith(layer + ".") for layer in layers)]


def read_tensors(source, names: list[str], dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """The tensors `names` of the safetensors checkpoint `source` (a folder or a Hub id: the sharded index's shards
    that hold them, or the single file) that it holds, in `dtype` on `device`."""
    index = cached_file(source, SAFE_WEIGHTS_INDEX_NAME, _raise_exceptions_for_missing_entries=False)
    if index:
        weight_map = json.loads(Path(index).read_text())["weight_map"]
        shards = {weight_map[name] for name in names if name in weight_map}
        files = [cached_file(source, shard) for shard in sorted(shards)]
    else:
        single = cached_file(source, SAFE_WEIGHTS_NAME, _raise_exceptions_for_missing_entries=False)
        if not single:
            raise FileNotFoundError(f"{source} holds no safetensors weights ({SAFE_WEIGHTS_NAME} or "
                                    f"{SAFE_WEIGHTS_INDEX_NAME}), from which parts of it could be read: "
                                    f"{WHOLE_TARGET_FIX}.")
        files = [single]
    tensors = {}
    for path in files:
        with safe_open(path, framework="pt") as stored:
            held = set(stored.keys())
            for name in filter(held.__contains__, names):
                tensor = stored.get_tensor(name)
                tensors[name] = tensor.to(device, dtype if tensor.is_floating_point() else tensor.dtype)
    return tensors


def is_whole(model: PreTrainedModel) -> bool:
    """Whether every weight of `model` is loaded (none left on the `meta` device by `load_target_parts`)."""
    return not any(parameter.is_meta for parameter in model.parameters())
