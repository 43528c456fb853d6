"""EAGLE-3 drafts in transformers' `pipeline("text-generation", ...)`: passed as a model or as a path."""

import json

import pytest
import torch
from helpers import VOCAB, fit_draft, tiny_draft, tiny_target
from hf_eagle3.conversion import convert
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, pipeline

from hf_eagle3 import Eagle3DraftModel
from hf_eagle3.configuration_eagle3 import is_served_layout

PROMPT = "w5 w17 w9 w33"
GREEDY = {"max_new_tokens": 24, "do_sample": False}


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny targets' vocabulary: `<pad>`, `<eos>`, then `w2` ... `w95`."""
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


@pytest.fixture
def target():
    """A tiny Llama whose config names its special tokens, as real targets' configs do."""
    model = tiny_target("llama")
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = None, 1, 0
    return model


@pytest.fixture
def draft(target) -> Eagle3DraftModel:
    return fit_draft(tiny_draft(draft_vocab_size=VOCAB), target)


def test_text_generation_pipeline_runs_eagle3_with_the_draft_as_assistant_model(target, draft, tokenizer):
    expected = pipeline("text-generation", model=target, tokenizer=tokenizer)(PROMPT, **GREEDY)
    eagle = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=draft)
    assert eagle(PROMPT, **GREEDY) == expected
    assert draft.generation_stats.num_cycles > 0 and draft.generation_stats.mean_acceptance_length > 1
    # the target's special-token ids are recorded in the draft's config: it shares the target's tokenizer
    assert (draft.config.bos_token_id, draft.config.eos_token_id, draft.config.pad_token_id) == (None, 1, 0)
    assert eagle(PROMPT, **GREEDY, tree_depth=2, tree_top_k=1) == expected  # EAGLE-3 settings pass through
    assert draft.generation_stats.settings.top_k == 1


def test_a_draft_given_to_the_pipeline_as_a_path_is_loaded_in_the_targets_dtype(target, draft, tokenizer, tmp_path):
    draft.to(torch.bfloat16).save_pretrained(tmp_path)
    assert is_served_layout(json.loads((tmp_path / "config.json").read_text()))  # the layout the engines load
    expected = pipeline("text-generation", model=target, tokenizer=tokenizer)(PROMPT, **GREEDY)
    eagle = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=str(tmp_path))
    loaded = eagle.assistant_model
    assert isinstance(loaded, Eagle3DraftModel) and loaded.dtype == target.dtype == torch.float32
    assert eagle.assistant_tokenizer is None  # the target's tokenizer serves both
    assert eagle(PROMPT, **GREEDY) == expected
    assert loaded.generation_stats.num_cycles > 0


def test_the_pipeline_refuses_a_draft_for_another_target_or_an_assistant_tokenizer(target, tokenizer):
    with pytest.raises(ValueError, match="does not fit the target model: draft vocab_size=128"):
        pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=tiny_draft(vocab_size=128))
    with pytest.raises(ValueError, match="shares the target's tokenizer: drop assistant_tokenizer"):
        pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=tiny_draft(),
                 assistant_tokenizer=tokenizer)


def test_a_draft_in_sglang_format_given_to_the_pipeline_as_a_path_equals_plain_greedy(target, draft, tokenizer,
                                                                                       tmp_path):
    draft.save_pretrained(tmp_path / "hub", served_layout=False)
    convert(tmp_path / "hub", tmp_path / "sglang", to_format="sglang")
    expected = pipeline("text-generation", model=target, tokenizer=tokenizer)(PROMPT, **GREEDY)
    eagle = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=str(tmp_path / "sglang"))
    assert isinstance(eagle.assistant_model, Eagle3DraftModel)
    assert eagle(PROMPT, **GREEDY) == expected
    assert eagle.assistant_model.generation_stats.mean_acceptance_length > 1
