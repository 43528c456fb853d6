"""Shared fixtures: fresh objects for every test (built from cached state where building is slow), so that what a test
or `generate` changes on them cannot reach another test. The helpers that build them are in helpers.py."""

import copy

import pytest
import torch
from helpers import SAMPLING_VOCAB, VOCAB, fit_draft, peaked_target, tiny_draft, tiny_target

from hf_eagle3.resources.smollm2 import smollm2_path

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


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A cache directory of the test's own (`HF_EAGLE3_CACHE`), holding the embedded target (linked, not rebuilt: its
    first-use build has tests of its own) and nothing else: no calibration record yet."""
    target_dir = smollm2_path()
    monkeypatch.setenv("HF_EAGLE3_CACHE", str(tmp_path))
    (tmp_path / target_dir.name).symlink_to(target_dir, target_is_directory=True)
    return tmp_path


# The compatibility subset (marker `compat`): CI runs it also under the oldest and the newest tested transformers
# (.ci/compat), so each feature whose transformers surface differs between releases has a test here, by column of
# docs/compatibility.md's table.
COMPAT_TESTS = {
    "greedy, fixed tree": ["test_generation.py::test_greedy_equals_plain_decoding_with_a_draft_that_accepts[tree]",
                           "test_generation.py::test_greedy_equals_plain_decoding_with_a_draft_that_accepts[exact-tree]",
                           "test_generation.py::test_streamer_receives_the_same_tokens",
                           "test_generation.py::test_return_dict_outputs_match_plain_decoding"],
    "auto": ["test_calibration.py::test_auto_decodes_with_the_predicted_fastest_shape"],
    # runs sampling end to end (its distribution is held exact by test_sampling.py in the full suite: 100 s a version)
    "sampling": ["test_generation.py::test_exact_attention_samples_too"],
    "batch": ["test_batches.py::test_batched_greedy_equals_plain_batched_greedy_row_for_row[llama-4]"],
    "pipeline": ["test_pipelines.py::test_text_generation_pipeline_runs_eagle3_with_the_draft_as_assistant_model",
                 "test_pipelines.py::test_a_draft_in_sglang_format_given_to_the_pipeline_as_a_path_equals_plain_greedy"],
    "custom_generate": ["test_batches.py::test_custom_generate_callable_equals_assistant_model",
                        "test_batches.py::test_custom_generate_directory_of_a_draft_repository_equals_assistant_model"],
    "static cache": ["test_generation.py::test_static_cache_is_lossless[tree]",
                     "test_prefilled_cache.py::test_a_cache_holding_a_prefix_continues_exactly_as_plain_generate"
                     "[tree-static]"],
    "compiled draft": ["test_compiled_draft.py::test_greedy_decoding_with_the_compiled_draft_equals_plain_decoding"
                       "[tree]"],
    "train step": ["test_trainer.py::test_a_draft_of_two_decoder_layers_trains_saves_them_and_decodes_as_plain_greedy"],
    "convert": ["test_conversion_cli.py::test_cli_reads_the_target_config",
                "test_served_layout.py::test_from_pretrained_reads_back_the_same_draft[variant0-dtype0]"],
    "import": ["test_import_effects.py::test_importing_hf_eagle3_leaves_generate_pipelines_and_the_attention_registries"
               "_as_they_were"],
}


def pytest_collection_modifyitems(items):
    subset = {f"tests/{test}" for tests in COMPAT_TESTS.values() for test in tests}
    for item in items:
        if item.nodeid in subset:
            item.add_marker(pytest.mark.compat)
