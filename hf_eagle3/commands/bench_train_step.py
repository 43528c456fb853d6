"""`hf-eagle3 bench-train-step`: peak memory and tokens/s of one training step of a Llama-3.1-8B-shaped draft.

The draft has one decoder layer (hidden size 4096, 32 query heads over 8 key/value heads, MLP 14336), a 32,000-token
draft vocabulary and the target's 128,256-token embedding; the target's tapped hidden states, final hidden states and
output layer are random (no target forward: its cost is the target's, not the trainer's). A step is what `hf-eagle3
train` does per batch: the target's distributions from its final hidden states (`target_distribution`), the
training-time test's forward and backward, gradient clipping and an AdamW step; every token is an answer token.

Each length runs in its own process, whose peak resident set (`ru_maxrss`, the weights and optimizer state included)
is its peak host memory; on CUDA the peak allocated device memory is reported too. The process's address space is
capped at `--cap-gib`, so a step that needs more fails there with its error, not by swapping.
"""

import argparse
import multiprocessing
import resource
import time

import torch
from torch import nn

from ..configuration_eagle3 import Eagle3Config
from ..decoding.calibration import machine_description
from ..modeling_eagle3 import Eagle3DraftModel
from ..training.losses import LOSSES
from ..training.trainer import SIZE_BOUNDS
from ..training.ttt import TrainingTimeTest, target_distribution
from ..utils.options import MAX_CONTEXT, MAX_THREADS, float_in, int_in

VOCAB, DRAFT_VOCAB, HIDDEN = 128256, 32000, 4096
LLAMA_3_1_8B_DRAFT = dict(vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, hidden_size=HIDDEN, intermediate_size=14336,
                          num_attention_heads=32, num_key_value_heads=8, target_num_hidden_layers=32,
                          max_position_embeddings=8192, rope_theta=500000.0)


def peak_host_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def train_step(length: int, ttt_steps: int, dtype: str, device: str, cap_gib: float | None, loss: str,
               shape: dict = LLAMA_3_1_8B_DRAFT) -> dict:
    """One training step at `length` tokens in this process, of a draft of `shape` (`Eagle3Config` arguments): its
    seconds, tokens/s, loss and peak memory, or the error it stopped with."""
    if cap_gib is not None:
        cap = int(cap_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    torch.manual_seed(0)
    with torch.device(device):
        config = Eagle3Config(**shape)
        vocab, hidden = config.vocab_size, config.target_hidden_size
        draft = Eagle3DraftModel(config)
        draft.attach_target_embedding(nn.Embedding(vocab, config.hidden_size).requires_grad_(False))
        draft.set_draft_vocabulary(torch.randperm(vocab)[: config.draft_vocab_size])
        lm_head = nn.Linear(hidden, vocab, bias=False).requires_grad_(False)
        input_ids = torch.randint(0, vocab, (1, length))
        features, final_hidden = torch.randn(1, length, 3 * hidden), torch.randn(1, length, hidden)
    ttt = TrainingTimeTest(draft, steps=ttt_steps, loss=loss).train()
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
    result = {"length": length, "setup_peak_host_gib": peak_host_gib()}
    started = time.perf_counter()
    try:
        with torch.autocast(torch.device(device).type, torch.bfloat16, enabled=dtype == "bfloat16"):
            target_view = target_distribution(final_hidden, lm_head, draft.draft_to_target)
            output = ttt(input_ids, features, *target_view, torch.ones_like(input_ids))
        output.loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        result["loss"] = output.loss.item()  # waits for the device
        seconds = time.perf_counter() - started
        result |= {"seconds": seconds, "tokens_per_second": length / seconds}
    except (RuntimeError, MemoryError) as error:  # out of memory: what it ran out of, and when
        result |= {"error": str(error).splitlines()[0][:160], "seconds": time.perf_counter() - started}
    result["peak_host_gib"] = peak_host_gib()
    if torch.device(device).type == "cuda":
        result["peak_device_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


TABLE_HEADER = ["| T | peak host memory (GiB) | peak device memory (GiB) | tokens/s | step (s) |",
                "|---|---|---|---|---|"]


def table_row(result: dict) -> str:
    device_memory = f"{result['peak_device_gib']:.1f}" if "peak_device_gib" in result else "-"
    speed = f"{result['tokens_per_second']:.1f}" if "error" not in result else f"failed: {result['error']}"
    return (f"| {result['length']} | {result['peak_host_gib']:.1f} | {device_memory} | {speed} | "
            f"{result['seconds']:.0f} |")


def _run(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    cap_gib = args.cap_gib if torch.device(args.device).type == "cpu" else None  # CUDA maps more than it uses
    print(f"{machine_description(args.device)}, {args.dtype}, {torch.get_num_threads()} threads, Llama-3.1-8B-shaped "
          f"draft (1 layer, draft vocabulary {DRAFT_VOCAB:,}), batch 1, {args.ttt_steps} TTT steps, --loss "
          f"{args.loss}" + (f", address space capped at {cap_gib} GiB" if cap_gib else ""))
    print("\n".join(TABLE_HEADER), flush=True)
    for length in args.lengths:  # one process per length: its own peak resident set and address-space cap
        with multiprocessing.get_context("spawn").Pool(1, initializer=torch.set_num_threads,
                                                       initargs=(torch.get_num_threads(),)) as pool:
            result = pool.apply(train_step, (length, args.ttt_steps, args.dtype, args.device, cap_gib, args.loss))
        print(table_row(result), flush=True)  # a row as soon as it is measured: a long step is minutes


def register_cli(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench-train-step", help="Peak memory and tokens/s of one training step of a Llama-3.1-8B-shaped draft.",
        description=__doc__)
    parser.add_argument("--lengths", type=int_in(1, MAX_CONTEXT), nargs="+", default=[2048, 4096],
                        help="tokens per training sequence")
    parser.add_argument("--ttt-steps", type=int_in(1, SIZE_BOUNDS["ttt_steps"]), default=7,
                        help="training-time-test steps")
    parser.add_argument("--loss", default="kl", choices=LOSSES, help="the step loss")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="float32, or bf16 autocast as `hf-eagle3 train --bf16` runs it")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--cap-gib", type=float_in(1, 1 << 20), default=18.0,
                        help="address-space cap of each step's process on CPU (GiB), so that running out fails "
                             "cleanly")
    parser.add_argument("--threads", type=int_in(1, MAX_THREADS), help="torch threads (default: torch's own choice)")
    parser.set_defaults(run=_run)
