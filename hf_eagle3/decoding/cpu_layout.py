"""`optimize(model)`: linear weights stored column-major, so that a CPU multiplies a few rows by them without
repacking them on every call.

PyTorch stores an `nn.Linear` weight as `[out, in]`, row-major; `x @ W.T` then hands MKL's float32 GEMM a transposed
operand, which it repacks on each call from about 4 rows of `x` on: a verification forward of 12 tokens cost 2.6
decode steps on an Ice Lake Xeon, 1.7 with the weights column-major (the same values, transposed strides:
`W.t().contiguous().t()`). One-token decoding is a matrix-vector product either way.

The change is explicit (as `ipex.optimize`): nothing in hf_eagle3 applies it unless asked (`optimize`, the `demo` /
`bench` flag `--cpu-layout`). It keeps every value, so outputs are those of the model as loaded, and
`save_pretrained` writes the same bytes (safetensors stores values, not strides). It costs no memory once done: each
weight is replaced by its re-laid copy, one matrix at a time (the largest one, briefly, twice). A weight shared with
another module (an `lm_head` tied to the input embedding, as SmolLM2's) keeps its layout: transformers finds tied
weights through flat views of them, which a column-major weight has not. Applying it twice changes nothing;
`standard_layout` undoes it.
"""

import torch
from torch import nn

from ..modeling_eagle3 import Eagle3DraftModel


def _own_linear_weights(model: nn.Module) -> list[nn.Parameter]:
    """The weights of the CPU `nn.Linear` modules of `model` that no other module shares: tied weights, and a draft's
    modules attached from its target (the target's to lay out), are left out."""
    users: dict[int, int] = {}
    if isinstance(model, Eagle3DraftModel):
        for name in model._attached_module_names():
            users[id(getattr(model, name).weight)] = 2
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            users[id(parameter)] = users.get(id(parameter), 0) + 1
    weights = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        own = isinstance(module, nn.Linear) and weight is not None and users[id(weight)] == 1
        if own and weight.device.type == "cpu":
            weights[id(weight)] = weight
    return list(weights.values())


def _is_column_major(weight: torch.Tensor) -> bool:
    return weight.t().is_contiguous()


@torch.no_grad()
def optimize(model: nn.Module) -> nn.Module:
    """Store the CPU linear weights of `model` column-major, in place (idempotent), and return `model`: same values,
    multi-row forwards without a weight repack per call. Untied weights only; see the module's docstring."""
    for weight in _own_linear_weights(model):
        if not _is_column_major(weight):
            weight.data = weight.data.t().contiguous().t()
    return model


@torch.no_grad()
def standard_layout(model: nn.Module) -> nn.Module:
    """Undo `optimize`: every linear weight of `model` contiguous again, in place; returns `model`."""
    for weight in _own_linear_weights(model):
        weight.data = weight.data.contiguous()
    return model


def weight_layout(model: nn.Module) -> str:
    """`"column-major"` when `optimize` laid out every weight it can, `"standard"` when none, else `"mixed"` (a
    measured cost depends on it)."""
    laid_out = [_is_column_major(weight) for weight in _own_linear_weights(model)]
    if laid_out and all(laid_out):
        return "column-major"
    return "mixed" if any(laid_out) else "standard"
