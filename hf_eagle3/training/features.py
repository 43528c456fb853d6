"""The target's features for training: computed online for each batch, or precomputed to disk once and read back.

Precompute (`--precompute-features DIR`) cuts the conversations into batches of similar length (sorted by length,
at most `batch_tokens` padded tokens a batch) and gives batch i to process i mod N, so every process computes a
disjoint share. A batch's members do not depend on N, and every conversation has its own file named by its index
(`DIR/SPLIT-FINGERPRINT/NNNNNNN.safetensors`), so the files are the same whatever the number of processes: a run
resumed with another number of processes finds them all. Each process writes its files on one background thread
behind a bounded queue while the target computes its next batch.
"""

import os
import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from ..utils.fingerprint import digest, model_fingerprint
from .data import Example, collate

# Files queued for the writer at most: a few batches' worth, so that writing overlaps the next forward without
# holding a dataset's features in host memory when the disk is slower than the target.
PENDING_WRITES = 64


@torch.no_grad()
def target_forward(target: PreTrainedModel, input_ids: torch.Tensor, layer_ids: list[int]):
    """(features `[B, T, 3 k_t]` at `layer_ids` of `outputs.hidden_states`, final hidden state `[B, T, k_t]`). Only
    the hidden states at `layer_ids` are kept."""
    outputs = target.model(input_ids=input_ids, output_hidden_states=layer_ids, use_cache=False)
    features = torch.cat([outputs.hidden_states[i] for i in layer_ids], dim=-1)
    return features, outputs.last_hidden_state


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices sorted by length (longest first, ties by index) and cut into batches of at most `batch_tokens` padded
    tokens (a conversation longer than that is a batch alone). Depends only on `lengths` and `batch_tokens`."""
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    batches: list[list[int]] = []
    for index in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


def batched_target_forward(target: PreTrainedModel, sequences: list[list[int]], layer_ids: list[int]):
    """`target_forward` of the sequences right padded into one batch, cut back into (features `[T_i, 3 k_t]`, final
    hidden state `[T_i, k_t]`) per sequence. The target is causal, so padding never changes a real position."""
    input_ids = torch.zeros((len(sequences), max(map(len, sequences))), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, : len(sequence)] = torch.tensor(sequence)
    features, final_hidden = target_forward(target, input_ids.to(target.device), layer_ids)
    return [(features[row, : len(sequence)], final_hidden[row, : len(sequence)])
            for row, sequence in enumerate(sequences)]


class FeatureWriter:
    """Writes safetensors files atomically on one background thread, behind a queue of `PENDING_WRITES` files.

    A failed write stops the writing; its error is raised in the caller at the next `put` or on leaving the `with`
    block. Files written before it are complete and are kept."""

    def __init__(self):
        self.pending: queue.Queue = queue.Queue(maxsize=PENDING_WRITES)
        self.error: tuple[Path, BaseException] | None = None
        self.thread = threading.Thread(target=self._write_all, name="feature-writer", daemon=True)

    def __enter__(self) -> "FeatureWriter":
        self.thread.start()
        return self

    def __exit__(self, *exception) -> None:
        self.pending.put(None)
        self.thread.join()
        if exception[0] is None:
            self._raise_error()

    def put(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        self._raise_error()
        self.pending.put((path, tensors))

    def _write_all(self) -> None:
        while (item := self.pending.get()) is not None:
            if self.error is None:  # after a failure, the queue is drained so that `put` never blocks
                path, tensors = item
                try:
                    partial = path.with_name(path.name + ".partial")
                    save_file(tensors, str(partial))
                    os.replace(partial, path)
                except Exception as error:  # raised in the caller's thread
                    self.error = (path, error)

    def _raise_error(self) -> None:
        if self.error is not None:
            path, error = self.error
            raise OSError(f"Writing the precomputed features {path} failed ({error}): free space there or pass another "
                          "--precompute-features; the files written so far are kept and reused.") from error


def feature_path(directory: Path, index: int) -> Path:
    return directory / f"{index:07d}.safetensors"


class PrecomputedBatches(torch.utils.data.Dataset):
    """Batches of conversations with their precomputed features, for a `DataLoader`: item i is `collate(examples,
    batches[i])` with `features` `[B, T, 3 k_t]` and `final_hidden` `[B, T, k_t]` as stored (bf16, zero past each
    conversation's end)."""

    def __init__(self, examples: list[Example], batches: list[list[int]], directory: Path, pad_token_id: int,
                 hidden_size: int):
        self.examples, self.batches, self.directory = examples, batches, directory
        self.pad_token_id, self.hidden_size = pad_token_id, hidden_size

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, position: int) -> dict[str, torch.Tensor]:
        batch = collate(self.examples, self.batches[position], self.pad_token_id)
        features = torch.zeros((*batch["input_ids"].shape, 3 * self.hidden_size), dtype=torch.bfloat16)
        final_hidden = torch.zeros((*batch["input_ids"].shape, self.hidden_size), dtype=torch.bfloat16)
        for row, index in enumerate(self.batches[position]):
            stored = load_file(str(feature_path(self.directory, index)))
            length = stored["features"].shape[0]
            features[row, :length] = stored["features"]
            final_hidden[row, :length] = stored["final_hidden"]
        return batch | {"features": features, "final_hidden": final_hidden}


class TargetFeatures:
    """Batches of conversations with the target's features: computed online, or read from precomputed files."""

    def __init__(self, target: PreTrainedModel, layer_ids: list[int], precomputed_dir: str | Path | None = None):
        self.target = target
        self.layer_ids = layer_ids
        self.precomputed_dir = None if precomputed_dir is None else Path(precomputed_dir)
        self.split_dirs: dict[str, Path] = {}
        self.pad_token_id = target.config.pad_token_id or 0

    def precompute(self, examples: list[Example], split: str, batch_tokens: int, rank: int = 0, world_size: int = 1,
                   progress: bool = True) -> None:
        """Write this process's share of the examples' features (bf16) to `precomputed_dir/SPLIT-FINGERPRINT/`,
        skipping batches already there; the caller waits for all processes before reading. The fingerprint covers
        the target (config and weights), the tapped layers and the examples' tokens, so features made by another
        target or for other data are never read back."""
        from tqdm.auto import tqdm

        directory = self.split_directory(examples, split)
        self.split_dirs[split] = directory
        directory.mkdir(parents=True, exist_ok=True)
        batches = length_batches([len(example.input_ids) for example in examples], batch_tokens)[rank::world_size]
        missing = [batch for batch in batches if not all(feature_path(directory, i).exists() for i in batch)]
        with FeatureWriter() as writer:
            for batch in tqdm(missing, desc=f"precomputing {split} features", disable=not progress):
                outputs = batched_target_forward(self.target, [examples[i].input_ids for i in batch], self.layer_ids)
                for index, (features, final_hidden) in zip(batch, outputs):
                    path = feature_path(directory, index)
                    if not path.exists():
                        writer.put(path, {"features": features.bfloat16().cpu(),
                                          "final_hidden": final_hidden.bfloat16().cpu()})

    def split_directory(self, examples: list[Example], split: str) -> Path:
        """Where the examples' features are stored: `precomputed_dir/SPLIT-FINGERPRINT/`, the fingerprint covering the
        target (config and weights), the tapped layers and the examples' tokens."""
        fingerprint = digest([model_fingerprint(self.target), self.layer_ids,
                              digest([example.input_ids for example in examples])])
        return self.precomputed_dir / f"{split}-{fingerprint}"

    def missing(self, examples: list[Example], split: str) -> list[Path]:
        """The examples' feature files not yet precomputed (all processes' shares)."""
        directory = self.split_directory(examples, split)
        return [path for index in range(len(examples)) if not (path := feature_path(directory, index)).exists()]

    def batches(self, examples: list[Example], batches: list[list[int]], split: str,
                workers: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """`collate(examples, indices)` for each of `batches`, with the target's `features` `[B, T, 3 k_t]` and
        `final_hidden` `[B, T, k_t]` on its device in its dtype (`target_distribution` turns the second into the
        target's distributions). Precomputed features are read ahead by a `DataLoader` with `workers` processes (0:
        in this one), into pinned memory on CUDA."""
        device, dtype = self.target.device, self.target.dtype
        if self.precomputed_dir is None:
            for indices in batches:
                batch = collate(examples, indices, self.pad_token_id)
                features, final_hidden = target_forward(self.target, batch["input_ids"].to(device), self.layer_ids)
                yield batch | {"features": features, "final_hidden": final_hidden}
            return
        stored = PrecomputedBatches(examples, batches, self.split_dirs[split], self.pad_token_id,
                                    self.target.config.hidden_size)
        loader = torch.utils.data.DataLoader(stored, batch_size=None, num_workers=workers,
                                             pin_memory=device.type == "cuda", prefetch_factor=2 if workers else None)
        for batch in loader:
            for name in ("features", "final_hidden"):
                batch[name] = batch[name].to(device, dtype, non_blocking=True)
            yield batch
