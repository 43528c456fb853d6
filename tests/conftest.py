"""Shared fixtures: fresh objects for every test (built from cached state where building is slow), so that what a test
or `generate` changes on them cannot reach another test. The helpers that build them are in helpers.py."""

import copy

import pytest
import torch
from helpers import SAMPLING_VOCAB, VOCAB, fit_draft, peaked_target, tiny_draft, tiny_target

torch.set_num_threads(1)  # tiny models gain nothing from threads; on a shared 2-core box threads oversubscribe


@pytest.fixture(scope="session")
def _llama_target():
    return tiny_target("llama")


@pytest.fixture
def llama_target(_llama_target):
    return copy.deepcopy(_llama_target)


@pytest.fixture
def fitted_draft(llama_target):
    return fit_draft(tiny_draft(draft_vocab_size=VOCAB), llama_target)


@pytest.fixture(scope="session")
def _peaked_target():
    return peaked_target()


@pytest.fixture
def sampling_target(_peaked_target):
    """`helpers.peaked_target`: a target whose sampling distribution `helpers.exact_joint` enumerates."""
    return copy.deepcopy(_peaked_target)


@pytest.fixture
def sampling_draft(sampling_target):
    return fit_draft(tiny_draft(vocab_size=SAMPLING_VOCAB, draft_vocab_size=SAMPLING_VOCAB), sampling_target, steps=60)
