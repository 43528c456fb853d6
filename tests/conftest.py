"""Shared fixtures: tiny random transformers targets and EAGLE-3 drafts that fit them."""

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import hf_eagle3  # noqa: F401  (installs the generate hooks)
from hf_eagle3 import Eagle3Config, Eagle3DraftModel

torch.set_num_threads(1)  # tiny models gain nothing from threads; on a shared 2-core box threads oversubscribe

VOCAB = 96
HIDDEN = 32
LAYERS = 8
_TINY = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)
TARGET_FAMILIES = {
    "llama": lambda fields: LlamaForCausalLM(LlamaConfig(**fields)),
    "qwen2": lambda fields: Qwen2ForCausalLM(Qwen2Config(**fields, use_sliding_window=False)),
    "qwen3": lambda fields: Qwen3ForCausalLM(Qwen3Config(**fields, head_dim=8, use_sliding_window=False)),
    "mistral": lambda fields: MistralForCausalLM(MistralConfig(**fields, sliding_window=None)),
}
# Sliding-window targets, with a window far shorter than the test sequences so that it matters
WINDOW = 5
SLIDING_TARGETS = {
    "mistral": lambda: MistralForCausalLM(MistralConfig(**_TINY, sliding_window=WINDOW)),
    # Qwen: layers 0-3 full attention, 4-7 sliding (the model takes one mask per kind of layer)
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**_TINY, use_sliding_window=True, sliding_window=WINDOW,
                                                  max_window_layers=4)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**_TINY, head_dim=8, use_sliding_window=True,
                                                  sliding_window=WINDOW, max_window_layers=4)),
}


def tiny_target(family: str = "llama", seed: int = 0, attn_implementation: str = "sdpa", vocab_size: int = VOCAB):
    torch.manual_seed(seed)
    model = TARGET_FAMILIES[family](_TINY | {"vocab_size": vocab_size})
    model.config._attn_implementation = attn_implementation
    return model.eval()


def tiny_draft(seed: int = 0, draft_vocab_size: int = 64, vocab_size: int = VOCAB, **overrides) -> Eagle3DraftModel:
    torch.manual_seed(seed)
    config = Eagle3Config(
        vocab_size=vocab_size,
        draft_vocab_size=draft_vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        target_num_hidden_layers=LAYERS,
        max_position_embeddings=512,
        **({"tree_depth": 4, "tree_top_k": 3, "tree_total_tokens": 12} | overrides),
    )
    draft = Eagle3DraftModel(config).eval()
    draft.set_draft_vocabulary(torch.randperm(vocab_size)[:draft_vocab_size])
    return draft


def fit_draft(draft: Eagle3DraftModel, target, steps: int = 200, seed: int = 0) -> Eagle3DraftModel:
    """A few hundred steps of plain next-token fitting on the target's own greedy continuations, so that the draft
    accepts tokens (a random draft accepts none). Test scaffolding only; `hf_eagle3.training.trainer` is the real
    trainer."""
    torch.manual_seed(seed)
    draft.attach_target_embedding(target.get_input_embeddings())
    draft.set_draft_vocabulary(torch.arange(draft.config.draft_vocab_size))
    prompts = torch.randint(1, draft.config.draft_vocab_size, (16, 6))
    with torch.no_grad():
        sequences = target.generate(prompts, max_new_tokens=40, do_sample=False,
                                    attention_mask=torch.ones_like(prompts))
        hidden = target(sequences, output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i] for i in draft.config.target_layer_ids], dim=-1)
    labels = sequences[:, 2:]
    in_vocab = labels < draft.config.draft_vocab_size
    trainable = [p for name, p in draft.named_parameters() if not name.startswith("embed_tokens")]
    optimizer = torch.optim.AdamW(trainable, lr=3e-3)
    draft.train()
    for _ in range(steps):
        logits = draft(sequences[:, 1:-1], features[:, :-2], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[in_vocab], labels[in_vocab])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return draft.eval()


@pytest.fixture(scope="session")
def llama_target():
    return tiny_target("llama")


@pytest.fixture(scope="session")
def fitted_draft(llama_target):
    return fit_draft(tiny_draft(draft_vocab_size=VOCAB), llama_target)
