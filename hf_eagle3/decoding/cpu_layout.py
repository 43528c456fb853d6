"""`optimize(model)`: a model's linear layers made cheap to run over a few rows at once on CPU, explicitly.

Verification runs the target over a tree's 8-32 tokens, and what that costs against one decode step decides whether a
tree pays at all. With PyTorch's `[out, in]` row-major `nn.Linear` weight, MKL's float32 GEMM gets a transposed operand
and repacks it on every call from about 4 rows on. Two layouts avoid that:

- `"column-major"`: each weight stored column-major (the same values, transposed strides: `W.t().contiguous().t()`).
  It costs no memory (each weight is replaced by its re-laid copy, one matrix at a time) but leaves weights shared with
  another module (an `lm_head` tied to the input embedding, as SmolLM2's) as they are: transformers finds tied weights
  through flat views of them, which a column-major weight has not. On an Ice Lake Xeon a 12-token forward cost 2.6
  decode steps in the standard layout and 1.7 in this one.
- `"onednn"`: each `nn.Linear` multiplies by a copy of its weight packed once for oneDNN's GEMM
  (`torch.ops.mkldnn`), tied weights included: float32 weights, and bfloat16 ones where the CPU has bf16 instructions
  (avx512_bf16, AMX; oneDNN packs none without). It costs a second copy of every linear weight in memory; the
  parameters themselves are untouched. On a 2-core AVX2-only EPYC (Zen 3) it took SmolLM2-135M's float32 decode step
  from 72 to 56 ms and a 12-token forward from 161 to 101 ms, where the column-major layout changed neither; on a Zen 4
  EPYC (avx512_bf16) a bfloat16 8-token forward from 65 to 55 ms.
- `"auto"` (the default): whichever of the standard layout and the two above runs the model's own linear layers
  fastest here, measured (`fastest_layout`: the first 64 MiB of linear weights in turn over 1 row and over 16, as a
  decode step and a verification forward run them; a second or two), so that no CPU's winner is everyone's default.

The change is explicit, as `ipex.optimize` is: nothing in hf_eagle3 applies it unless asked (`optimize`, the `bench`
flag `--cpu-layout`; `demo` applies it to plain decoding and EAGLE-3 alike unless `--no-cpu-layout`). It keeps every
value, so outputs are those of the model as loaded, up to the rounding of another GEMM; `save_pretrained` writes the
same bytes (safetensors stores values, not strides, and the packed copies are no parameters). A packed layer
multiplies by its weight as it is, unpacked, wherever the packed copy cannot serve: under autograd (oneDNN's packed
GEMM has no backward) and autocast, while `torch.compile` traces it, and for inputs or weights of another dtype or
device; a weight changed since it was packed (loaded, edited in place, re-assigned) is packed again at its next
forward. Applying a layout twice changes nothing; `standard_layout` undoes any.
"""

import functools
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from ..modeling_eagle3 import Eagle3DraftModel

LAYOUTS = ("column-major", "onednn")
AUTO_ROWS = (1, 16)  # rows `fastest_layout` times every linear layer over: a decode step's and a verification's
AUTO_ROUNDS = 5  # interleaved rounds of `fastest_layout`, after one that warms every layout up
AUTO_BYTES = 64 << 20  # linear weights `fastest_layout` times
PACK_ROWS = 16  # the rows oneDNN packs a weight for (any count multiplies by it)


class PackedLinear(nn.Linear):
    """An `nn.Linear` (its parameters unchanged) that multiplies CPU inputs of its weight's dtype, without autograd,
    by a copy of that weight packed for oneDNN, packed again when the weight changed since (see the module's
    docstring)."""

    def pack(self) -> None:
        weight = self.weight.detach()
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
        self._packed_from = (weight._version, weight.data_ptr())

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (torch.compiler.is_compiling() or weight.device.type != "cpu" or not onednn_packs(weight.dtype)
                or input.dtype != weight.dtype or torch.is_autocast_enabled("cpu")
                or (torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad))):
            return F.linear(input, weight, self.bias)
        if getattr(self, "_packed_from", None) != (weight._version, weight.data_ptr()):
            self.pack()
        return torch.ops.mkldnn._linear_pointwise(input, self._packed, self.bias, "none", [], "")

    def __getstate__(self):  # a packed tensor has no storage to copy or pickle: a copy packs its own when it runs
        return {name: value for name, value in super().__getstate__().items()
                if name not in ("_packed", "_packed_from")}


def _linears(model: nn.Module, shared: bool) -> list[nn.Linear]:
    """The CPU linear layers of `model` that a layout applies to: plain `nn.Linear` modules (quantised or adapted
    subclasses keep their own forward), those of a draft's modules attached from its target left to the target, and
    with `shared=False` those whose weight another module also uses left out."""
    users: dict[int, int] = {}
    attached = set()
    if isinstance(model, Eagle3DraftModel):
        attached = {id(module) for name in model._attached_module_names() for module in getattr(model, name).modules()}
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            users[id(parameter)] = users.get(id(parameter), 0) + 1
    linears = {}
    for module in model.modules():
        if (type(module) in (nn.Linear, PackedLinear) and id(module) not in attached
                and module.weight.device.type == "cpu" and (shared or users[id(module.weight)] == 1)):
            linears[id(module)] = module
    return list(linears.values())


def _is_column_major(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.t().is_contiguous() and not weight.is_contiguous()


@functools.cache  # asked at every packed forward
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether `"onednn"` can serve weights of `dtype` here: float32 wherever PyTorch was built with oneDNN, bfloat16
    where the CPU also has bf16 instructions."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@torch.no_grad()
def standard_layout(model: nn.Module) -> nn.Module:
    """Undo `optimize`: every linear layer of `model` a plain `nn.Linear` over a contiguous weight, in place; returns
    `model`."""
    for module in _linears(model, shared=True):
        if type(module) is PackedLinear:
            module.__dict__.pop("_packed", None)
            module.__dict__.pop("_packed_from", None)
            module.__class__ = nn.Linear
        module.weight.data = module.weight.data.contiguous()
    return model


@torch.no_grad()
def _apply(model: nn.Module, layout: str) -> None:
    standard_layout(model)
    if layout == "column-major":
        for module in _linears(model, shared=False):
            module.weight.data = module.weight.data.t().contiguous().t()
    elif layout == "onednn":
        for module in _linears(model, shared=True):
            if onednn_packs(module.weight.dtype):
                module.__class__ = PackedLinear
                module.pack()


def _laid_out(weight: torch.Tensor, layout: str) -> torch.Tensor:
    """`weight` as `layout` multiplies by it: itself, a column-major copy or a copy packed for oneDNN."""
    if layout == "column-major":
        return weight.t().contiguous().t()
    if layout == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
    return weight


def _multiply(x: torch.Tensor, weight: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return F.linear(x, weight)


@torch.no_grad()
def fastest_layout(model: nn.Module, rounds: int = AUTO_ROUNDS) -> str:
    """`"standard"` or the layout of `LAYOUTS` that multiplies by `model`'s linear weights fastest here: the first
    `AUTO_BYTES` of them (more than a last-level cache, so that they stream from memory as in a forward), each in turn
    over `AUTO_ROWS` rows, in interleaved rounds after one that warms every layout up (a layout twice as slow as the
    fastest there is timed no further); medians summed over the row counts. It times copies of those weights (at
    most `AUTO_BYTES` a layout) and leaves `model` as it is."""
    weights, size = [], 0
    for module in _linears(model, shared=True):
        if size >= AUTO_BYTES:
            break
        weights.append(module.weight.detach())
        size += module.weight.numel() * module.weight.element_size()
    if not weights:
        return "standard"
    candidates = ["standard", "column-major"] + (["onednn"] if onednn_packs(weights[0].dtype) else [])
    laid_out = {layout: [_laid_out(weight, layout) for weight in weights] for layout in candidates}
    inputs = {rows: [torch.randn(rows, weight.shape[1], dtype=weight.dtype) for weight in weights]
              for rows in AUTO_ROWS}
    samples = {layout: {rows: [] for rows in AUTO_ROWS} for layout in candidates}
    for _ in range(rounds + 1):
        for layout in candidates:
            for rows in AUTO_ROWS:
                start = time.perf_counter()
                for weight, x in zip(laid_out[layout], inputs[rows]):
                    _multiply(x, weight, layout)
                samples[layout][rows].append(time.perf_counter() - start)
        if len(samples[candidates[0]][AUTO_ROWS[0]]) == 1:  # after the warm-up: clear losers are timed no further
            warm_up = {layout: sum(times[0] for times in samples[layout].values()) for layout in candidates}
            candidates = [layout for layout in candidates if warm_up[layout] <= 2 * min(warm_up.values())]
    return min(candidates, key=lambda layout: sum(statistics.median(times[1:]) for times in samples[layout].values()))


def optimize(model: nn.Module, layout: str = "auto") -> nn.Module:
    """Lay out `model`'s CPU linear layers for cheap multi-row forwards, in place, and return `model`: `"auto"`
    (measured here, `fastest_layout`), `"column-major"` or `"onednn"` (see the module's docstring for what each
    costs and keeps). Outputs stay those of the model as loaded, up to the rounding of another GEMM."""
    if layout not in ("auto", *LAYOUTS):
        raise ValueError(f"Unknown layout {layout!r}: pick 'auto' (measured here) or one of {', '.join(LAYOUTS)}.")
    if layout == "auto":
        layout = fastest_layout(model)
    unpackable = sorted({str(module.weight.dtype) for module in _linears(model, shared=True)
                         if not onednn_packs(module.weight.dtype)})
    if layout == "onednn" and unpackable:
        raise ValueError(f"The 'onednn' layout packs float32 weights (with a PyTorch built with oneDNN), and bfloat16 "
                         f"ones on CPUs with bf16 instructions; this model's linear layers hold "
                         f"{', '.join(unpackable)} here. Use layout='auto' (measured here) or 'column-major', or cast "
                         "the model to float32 first.")
    if weight_layout(model) != layout:
        _apply(model, layout)
    return model


def weight_layout(model: nn.Module) -> str:
    """`"onednn"` or `"column-major"` when every linear layer that layout applies to has it, `"standard"` when none
    has either, else `"mixed"` (a measured cost depends on it)."""
    linears = _linears(model, shared=True)
    packed = [type(module) is PackedLinear for module in linears]
    column_major = [_is_column_major(module.weight) for module in _linears(model, shared=False)]
    if not any(packed) and not any(column_major):
        return "standard"
    if all(packed) and not any(column_major):
        return "onednn"
    if all(column_major) and not any(packed):
        return "column-major"
    return "mixed"
