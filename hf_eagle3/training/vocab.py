"""The draft vocabulary: the `draft_vocab_size` target tokens the draft's `lm_head` predicts.

EAGLE-3 shrinks the draft's output layer to the most frequent tokens of the training responses: on a 128k-token
target most of the `lm_head` cost goes, and the tokens that remain cover almost every position the draft is scored
on. The selection is computed once per training run, saved next to the checkpoints, and loaded (never recomputed)
when the run resumes, so a resumed run keeps the exact `d2t` / `t2d` of its weights.
"""

from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .data import Example


def count_response_tokens(examples: Iterable[Example], vocab_size: int) -> torch.Tensor:
    """How often each target token id occurs in the assistant tokens (`loss_mask == 1`) of `examples`,
    `[vocab_size]`."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for example in examples:
        ids = torch.tensor(example.input_ids, dtype=torch.long)[torch.tensor(example.loss_mask, dtype=torch.bool)]
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def select_draft_vocabulary(examples: Iterable[Example], draft_vocab_size: int, vocab_size: int) -> torch.Tensor:
    """The `draft_vocab_size` most frequent response tokens, sorted by id, `[draft_vocab_size]` (long).

    Ties, and the rest of the vocabulary when the responses hold fewer distinct tokens, go to the lowest ids.
    """
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}], got {draft_vocab_size}.")
    counts = count_response_tokens(examples, vocab_size)
    # Stable sort on -count: equal counts keep ascending id order.
    by_frequency = torch.sort(-counts, stable=True).indices
    return by_frequency[:draft_vocab_size].sort().values


def grow_draft_vocabulary(token_ids: torch.Tensor, examples: Iterable[Example], draft_vocab_size: int,
                          vocab_size: int) -> torch.Tensor:
    """`token_ids` (a trained draft's vocabulary) and the most frequent response tokens it lacks, up to
    `draft_vocab_size`, sorted by id (ties as `select_draft_vocabulary`)."""
    if not token_ids.numel() <= draft_vocab_size <= vocab_size:
        raise ValueError(f"a draft vocabulary of {token_ids.numel()} tokens grows to at most {vocab_size}, got "
                         f"{draft_vocab_size}.")
    counts = count_response_tokens(examples, vocab_size)
    counts[token_ids] = -1  # held already: ranked after every other token, never picked twice
    by_frequency = torch.sort(-counts, stable=True).indices
    return torch.cat([token_ids, by_frequency[: draft_vocab_size - token_ids.numel()]]).sort().values


def save_draft_vocabulary(path: str | Path, token_ids: torch.Tensor) -> None:
    save_file({"token_ids": token_ids.contiguous()}, str(path))


def load_draft_vocabulary(path: str | Path) -> torch.Tensor:
    return load_file(str(path))["token_ids"]


def draft_vocabulary_for_run(
    path: str | Path, examples: list[Example], draft_vocab_size: int, vocab_size: int
) -> torch.Tensor:
    """The run's draft vocabulary: loaded from `path` when it exists (resume), else selected and saved there."""
    path = Path(path)
    if path.exists():
        token_ids = load_draft_vocabulary(path)
        if token_ids.numel() != draft_vocab_size:
            raise ValueError(
                f"{path} holds a draft vocabulary of {token_ids.numel()} tokens, the run asks for {draft_vocab_size}. "
                "Resume with the same --draft-vocab-size, or start a new output directory."
            )
        return token_ids
    token_ids = select_draft_vocabulary(examples, draft_vocab_size, vocab_size)
    save_draft_vocabulary(path, token_ids)
    return token_ids


def coverage(examples: Iterable[Example], token_ids: torch.Tensor, vocab_size: int) -> float:
    """Fraction of the assistant tokens of `examples` that lie in the draft vocabulary `token_ids`."""
    counts = count_response_tokens(examples, vocab_size)
    return float(counts[token_ids].sum() / counts.sum().clamp(min=1))


__all__ = [
    "count_response_tokens",
    "coverage",
    "draft_vocabulary_for_run",
    "grow_draft_vocabulary",
    "load_draft_vocabulary",
    "save_draft_vocabulary",
    "select_draft_vocabulary",
]
