"""Draft vocabulary: the most frequent response tokens, sorted by id, computed once per run."""

import pytest
import torch

from hf_eagle3.training.data import Example
from hf_eagle3.training.vocab import coverage, draft_vocabulary_for_run, select_draft_vocabulary


def example(input_ids, loss_mask):
    return Example(messages=[], input_ids=input_ids, loss_mask=loss_mask)


EXAMPLES = [
    # Prompt tokens (mask 0) never count: 9 is frequent in prompts only.
    example([9, 9, 9, 5, 5, 7, 3], [0, 0, 0, 1, 1, 1, 1]),
    example([9, 9, 5, 7, 7, 1], [0, 0, 1, 1, 1, 1]),
]


def test_most_frequent_response_tokens_sorted_by_id():
    # Response counts: 5 -> 3, 7 -> 3, 3 -> 1, 1 -> 1.
    assert select_draft_vocabulary(EXAMPLES, 2, vocab_size=10).tolist() == [5, 7]
    # Ties (3 and 1 both once) go to the lower id.
    assert select_draft_vocabulary(EXAMPLES, 3, vocab_size=10).tolist() == [1, 5, 7]


def test_fewer_distinct_tokens_than_requested_fills_with_lowest_ids():
    assert select_draft_vocabulary(EXAMPLES, 6, vocab_size=10).tolist() == [0, 1, 2, 3, 5, 7]


def test_invalid_size_is_refused():
    with pytest.raises(ValueError, match="draft_vocab_size must be in"):
        select_draft_vocabulary(EXAMPLES, 11, vocab_size=10)


def test_run_vocabulary_is_computed_once_and_loaded_on_resume(tmp_path):
    path = tmp_path / "draft_vocab.safetensors"
    first = draft_vocabulary_for_run(path, EXAMPLES, 2, vocab_size=10)
    # Different data on resume: the saved vocabulary wins, nothing is recomputed.
    resumed = draft_vocabulary_for_run(path, [example([1, 2, 2, 2], [1, 1, 1, 1])], 2, vocab_size=10)
    assert torch.equal(first, resumed) and first.tolist() == [5, 7]
    with pytest.raises(ValueError, match="same --draft-vocab-size"):
        draft_vocabulary_for_run(path, EXAMPLES, 3, vocab_size=10)


def test_coverage_of_response_tokens():
    assert coverage(EXAMPLES, torch.tensor([5, 7]), vocab_size=10) == pytest.approx(6 / 8)
