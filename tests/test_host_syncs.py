"""A decoding cycle waits on the device at most once greedy and twice sampling, for one sequence and for a batch.

On CUDA an operation whose result the host needs (a Python number, a shape that depends on values, a copy to the
host, a blocking copy of host data) drains the stream: the hundreds of kernels a cycle launches then add to the
GPU's time instead of hiding behind it. These tests make those operations visible on the CPU: a dispatch mode and a
function mode count them while `generate` decodes, outside its prefill and finish, per verification cycle.

Counted: `aten._local_scalar_dense` (`item`, `int`, `float`, `bool`), `nonzero`, `masked_select`, indexing with a
boolean mask, `repeat_interleave` with tensor repeats, `tolist`, `numpy`, `cpu`, and tensors built from Python data
on a device (`torch.tensor(..., device=...)`). Not counted: the stopping criteria, which the loop hands a host copy of
the tokens (`Row._kept_until_stop`: a CPU tensor whatever the model's device), and host tensors sent on without
waiting (`proposer.to_device`).
"""

import sys
from contextlib import contextmanager

import pytest
import torch
from helpers import VOCAB
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from hf_eagle3.decoding import loop
from hf_eagle3.decoding.batch_state import Row

PAD = 0
NEW_TOKENS = 48
TREE = dict(tree_depth=6, tree_top_k=8, tree_total_tokens=60)  # a public draft's default shape
SAMPLING = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)  # warpers that do not read the sequence

_SYNCING_OPS = {
    torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default,
    torch.ops.aten.repeat_interleave.Tensor, torch.ops.aten.repeat_interleave.self_Tensor,
}
_SYNCING_METHODS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}
_HOST_SIDE = {Row._kept_until_stop.__code__}  # code that only ever sees host copies


def _on_host() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in _HOST_SIDE:
            return True
        frame = frame.f_back
    return False


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        boolean_index = func is torch.ops.aten.index.Tensor and any(
            isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in args[1])
        if (func in _SYNCING_OPS or boolean_index) and self.counter.active and not _on_host():
            self.counter.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class _Functions(TorchFunctionMode):
    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        built_on_device = func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None
        if (func in _SYNCING_METHODS or built_on_device) and self.counter.active and not _on_host():
            self.counter.ops.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


class SyncCounter:
    """Counts what would wait on a CUDA device while it is `active`."""

    def __init__(self, active: bool = True):
        self.ops: list[str] = []
        self.active = active

    @contextmanager
    def counting(self):
        with _Functions(self), _Dispatch(self):
            yield self


@pytest.fixture
def counted(monkeypatch):
    """Runs a call under a `SyncCounter` active from the end of the loop's prefill to the start of its finish: the
    cycles' operations (not `generate`'s preparation, which plain decoding shares)."""
    counter = SyncCounter(active=False)
    prefill, finish = loop.prefill, loop._finish

    def counted_after(*args, **kwargs):
        prepared = prefill(*args, **kwargs)
        counter.active = True
        return prepared

    def uncounted(*args, **kwargs):
        counter.active = False
        return finish(*args, **kwargs)

    monkeypatch.setattr(loop, "prefill", counted_after)
    monkeypatch.setattr(loop, "_finish", uncounted)

    def run(target, draft, **kwargs):
        with counter.counting():
            output = target.generate(assistant_model=draft, max_new_tokens=NEW_TOKENS, pad_token_id=PAD,
                                     return_dict_in_generate=True, **TREE, **kwargs)
        return counter.ops, output.eagle3_stats.num_cycles

    return run


def _prompts(batch_size: int) -> dict:
    generator = torch.Generator().manual_seed(batch_size)
    lengths = [12, 7, 15, 9][:batch_size]
    input_ids = torch.full((batch_size, max(lengths)), PAD)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        repeated = torch.randint(1, VOCAB, (length // 2,), generator=generator).repeat(2)  # the n-gram search matches
        input_ids[row, -repeated.numel() :] = repeated
        attention_mask[row, -repeated.numel() :] = 1
    return dict(input_ids=input_ids, attention_mask=attention_mask)


# A processor that reads the sequence: every node is scored along its path, still without a read
PENALTY = dict(repetition_penalty=1.2)


@pytest.mark.parametrize("processors", [{}, PENALTY], ids=["", "repetition-penalty"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_a_greedy_cycle_reads_the_device_once(counted, llama_target, fitted_draft, batch_size, processors):
    ops, cycles = counted(llama_target, fitted_draft, **_prompts(batch_size), do_sample=False, **processors)
    assert cycles > 5
    assert len(ops) <= cycles, f"{len(ops) / cycles:.2f} syncs per cycle: {sorted(set(ops))}"


@pytest.mark.parametrize("processors", [{}, PENALTY], ids=["", "repetition-penalty"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_a_sampling_cycle_reads_the_device_at_most_twice(counted, llama_target, fitted_draft, batch_size, processors):
    torch.manual_seed(0)
    ops, cycles = counted(llama_target, fitted_draft, **_prompts(batch_size), **SAMPLING, **processors)
    assert cycles > 5
    assert len(ops) <= 2 * cycles, f"{len(ops) / cycles:.2f} syncs per cycle: {sorted(set(ops))}"


def test_the_counter_sees_what_would_wait_on_the_device():
    counter = SyncCounter()
    with counter.counting():
        values = torch.arange(6)
        int(values[2])
        values[values > 2].sum()
        values.nonzero()
        values.tolist()
        torch.tensor([1, 2], device="cpu")
        torch.tensor([1, 2])  # host data kept on the host: no wait
    assert len(counter.ops) == 5
