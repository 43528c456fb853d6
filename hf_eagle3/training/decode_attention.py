"""Attention for the target's batched single-token decode steps, as answer regeneration runs them on CPUs.

A decode step has one query per row. transformers' sdpa path hands it to PyTorch's CPU flash-attention kernel (with
`enable_gqa`, or with the query heads of each key/value head packed as rows when there is a padding mask), which is
slow in bfloat16: on a 2-core Zen 4 EPYC (avx512_bf16) one layer's attention for 64 rows over 200 keys took 8.6 ms
that way and 0.6 ms as two grouped matrix products, so that at batch 64 attention was two thirds of a decode step.
`grouped_decode_attention` computes such steps as those products: the query heads that share a key/value head
multiply its keys in one product (no repeated keys and values), the softmax runs in float32. Every other call (a
prefill, a multi-token or per-head mask, dropout, attention sinks) goes to transformers' sdpa as before. The math is
sdpa's; only the order of the sums differs, so float32 logits agree to rounding and greedy answers can part at
near-ties only, as between any two kernels.

`decode_attention(model)` switches a model to it for a `with` block (registered, on first use, with transformers'
`AttentionInterface` as `ATTENTION_NAME`, with sdpa's masks) and restores the model's own implementation after.
"""

from contextlib import contextmanager

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..utils.transformers_api import attention_implementation

ATTENTION_NAME = "hf_eagle3_grouped_decode"


def grouped_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: `query` `[B, H, q, D]`, `key` / `value` `[B, KV, T, D]`, an sdpa
    mask (boolean, True where a key is seen, or additive) `[B, 1, q, T]` or None; returns `([B, q, H, D], None)`."""
    batch, heads, query_length, head_dim = query.shape
    kv_heads = key.shape[1]
    unusual = (dropout > 0.0 and module.training) or any(kwargs.get(name) is not None
                                                         for name in ("position_bias", "softcap", "s_aux", "sinks"))
    per_head_mask = attention_mask is not None and attention_mask.shape[1] != 1
    if query_length != 1 or unusual or per_head_mask or heads % kv_heads:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    grouped_query = query.reshape(batch, kv_heads, heads // kv_heads, head_dim)  # [B, KV, G, D]: one row per head
    scores = torch.matmul(grouped_query, key.transpose(-1, -2)).float()  # [B, KV, G, T]
    scores = scores * (head_dim**-0.5 if scaling is None else scaling)
    if attention_mask is not None:  # [B, 1, 1, T], the same keys for every head
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask.float()
    probabilities = torch.softmax(scores, dim=-1).to(value.dtype)
    output = torch.matmul(probabilities, value)  # [B, KV, G, D]
    return output.reshape(batch, 1, heads, head_dim), None


@contextmanager
def decode_attention(model: PreTrainedModel):
    """Within the block, `model` attends with `grouped_decode_attention` where its implementation is sdpa (other
    implementations, eager or flash-attention say, are the user's choice and stay); restored after, also on error.
    The function is registered on first use: importing hf-eagle3 leaves transformers' registries as they were."""
    implementation = attention_implementation(model.config)
    if implementation != "sdpa":
        yield model
        return
    AttentionInterface.register(ATTENTION_NAME, grouped_decode_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield model
    finally:
        model.set_attn_implementation(implementation)
