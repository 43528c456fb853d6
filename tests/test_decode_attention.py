"""The grouped attention of batched decode steps (answer regeneration): the same logits and greedy tokens as sdpa in
float32, on left-padded batches, sliding windows and static caches, and the model's own attention restored after."""

import pytest
import torch
from helpers import sliding_target, tiny_target
from transformers import DynamicCache

from hf_eagle3.training import decode_attention as module
from hf_eagle3.training.decode_attention import ATTENTION_NAME, decode_attention
from hf_eagle3.utils.transformers_api import CACHE


def left_padded_batch(vocab_size: int, lengths=(9, 4, 7), seed: int = 1):
    """Token ids `[B, max(lengths)]`, each row left-padded with 0 to the longest, and the attention mask."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length:] = torch.randint(1, vocab_size, (length,), generator=generator)
        attention_mask[row, width - length:] = 1
    return input_ids, attention_mask


def decode_logits(model, input_ids, attention_mask, steps: int = 6) -> torch.Tensor:
    """The logits of a prefill and `steps` greedy single-token steps over a dynamic cache, `[steps + 1, B, V]`."""
    cache, logits = DynamicCache(config=model.config), []
    with torch.no_grad():
        output = model(input_ids, attention_mask=attention_mask, **{CACHE: cache})
        for _ in range(steps):
            logits.append(output.logits[:, -1])
            next_ids = logits[-1].argmax(-1, keepdim=True)
            attention_mask = torch.cat([attention_mask, torch.ones_like(next_ids)], dim=1)
            output = model(next_ids, attention_mask=attention_mask, **{CACHE: cache})
    logits.append(output.logits[:, -1])
    return torch.stack(logits)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_decode_steps_of_a_left_padded_batch_give_sdpa_logits_in_float32(family, monkeypatch):
    model = tiny_target(family)
    batch = left_padded_batch(model.config.vocab_size)
    expected = decode_logits(model, *batch)
    handed_to_sdpa = []  # the query lengths of the calls handed on to sdpa: the prefill's only
    sdpa = module.sdpa_attention_forward

    def counted_sdpa(attention_module, query, *args, **kwargs):
        handed_to_sdpa.append(query.shape[2])
        return sdpa(attention_module, query, *args, **kwargs)

    monkeypatch.setattr(module, "sdpa_attention_forward", counted_sdpa)
    with decode_attention(model):
        assert model.config._attn_implementation == ATTENTION_NAME
        logits = decode_logits(model, *batch)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert handed_to_sdpa == [batch[0].shape[1]] * model.config.num_hidden_layers


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_decode_steps_past_a_sliding_window_give_sdpa_logits_in_float32(family):
    model = sliding_target(family)  # a 5-token window, passed by the 9-token prompt and the steps
    batch = left_padded_batch(model.config.vocab_size)
    expected = decode_logits(model, *batch, steps=8)
    with decode_attention(model):
        logits = decode_logits(model, *batch, steps=8)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_greedy_generate_of_a_padded_batch_gives_the_tokens_of_sdpa_in_float32(cache_implementation):
    model = tiny_target("llama")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, lengths=(12, 3, 8, 5))
    settings = dict(max_new_tokens=20, do_sample=False, pad_token_id=0, cache_implementation=cache_implementation)
    expected = model.generate(input_ids=input_ids, attention_mask=attention_mask, **settings)
    with decode_attention(model):
        generated = model.generate(input_ids=input_ids, attention_mask=attention_mask, **settings)
    assert torch.equal(generated, expected)


def test_the_models_own_attention_is_restored_after_the_block_and_after_an_error():
    model = tiny_target("llama")
    with pytest.raises(RuntimeError, match="inside"):
        with decode_attention(model):
            raise RuntimeError("inside")
    assert model.config._attn_implementation == "sdpa"
    assert all(getattr(module.config, "_attn_implementation", "sdpa") == "sdpa" for module in model.modules()
               if hasattr(module, "config"))


def test_a_model_loaded_with_another_attention_keeps_it():
    model = tiny_target("llama", attn_implementation="eager")
    with decode_attention(model):
        assert model.config._attn_implementation == "eager"
    assert model.config._attn_implementation == "eager"
