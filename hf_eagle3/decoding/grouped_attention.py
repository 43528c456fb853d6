"""Tree verification attention that reads each key/value head once: its query heads folded into the query dimension.

With a mask and more than one query, transformers' sdpa attention (5.24) does not hand grouped-query attention to
PyTorch (`enable_gqa` goes with no mask only) and repeats every key/value head for each query head that reads it
(`repeat_kv`): each verification forward copies every layer's whole cache, 4 times over for Llama-3.1-8B (32 query
heads, 8 key/value heads), where a plain decoding step (one query, packed by transformers' `pack_gqa`) copies nothing.

`grouped_tree_sdpa` folds the queries instead. The `G` query heads of a key/value head become `G * n` query rows of
it (`[B, H, n, D]` to `[B, H_kv, G * n, D]`), the mask `[B, 1, n, K]` is repeated along those rows (`G * n * K`
entries: under 1 % of what `repeat_kv` copies for Llama-3.1-8B verifying 16 tokens), and one sdpa call attends over
the keys and values as cached, on any device. Each query row meets the same keys, mask row and scale as before, so
the outputs are sdpa's with repeated keys up to rounding: the matrix products may round a row differently with the
number of rows they multiply (float32 outputs parted by 1-2 units in the last place in some rows on a Zen 2 EPYC;
bfloat16 ones were equal bit for bit there).

How a forward asks for it, as for `exact_attention`: transformers passes a forward's extra keyword arguments on to
the layers' attention function, and `install` registers, once, an "sdpa" entry that is the sdpa function registered
before it unless a forward passes `grouped_tree_queries=True`. Every other forward (prefill, plain decoding, any
model that never meets an EAGLE-3 draft) runs the plain function unchanged, and so does every call the fold does not
fit: one query (transformers packs it already), as many key/value heads as query heads, no mask or a mask per head,
or an argument sdpa folds into the mask itself (position bias, soft-capping, attention sinks).
"""


import torch

from ..utils.transformers_api import wrap_sdpa

KEYWORD = "grouped_tree_queries"  # the forward keyword argument that asks for the fold


def grouped_tree_sdpa(sdpa, module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, grouped_tree_queries: bool = False, **kwargs):
    """`sdpa` (transformers' sdpa attention function), or with `grouped_tree_queries` the same attention over the keys
    and values as cached. `query` `[B, H, n, D]`; `key` / `value` `[B, H_kv, K, D]`; `attention_mask` `[B, 1, n, K]`
    (additive or boolean). Returns `([B, n, H, D], None)`, as transformers' attention functions do."""
    batch, heads, query_length, head_dim = query.shape
    kv_heads = key.shape[1]
    unusual = any(kwargs.get(name) is not None for name in ("position_bias", "softcap", "s_aux", "sinks"))
    if (not grouped_tree_queries or query_length == 1 or heads == kv_heads or heads % kv_heads or unusual
            or attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[1] != 1):
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    groups = heads // kv_heads
    folded_query = query.reshape(batch, kv_heads, groups * query_length, head_dim)  # head h = j * G + g: row g * n + i
    folded_mask = attention_mask[:, :, None].expand(-1, -1, groups, -1, -1).flatten(2, 3)  # [B, 1, G * n, K]
    output = torch.nn.functional.scaled_dot_product_attention(
        folded_query, key, value, attn_mask=folded_mask, dropout_p=dropout, scale=scaling
    )
    return output.reshape(batch, heads, query_length, head_dim).transpose(1, 2).contiguous(), None


def forward_kwargs(attn_implementation: str) -> dict:
    """The keyword arguments that fold the query groups of a verification forward, for a target attending with
    `attn_implementation` (sdpa only: the fold is sdpa's); the first such forward registers the function (`install`)."""
    if attn_implementation != "sdpa":
        return {}
    install()
    return {KEYWORD: True}


def install() -> None:
    """Register the "sdpa" attention function that takes `grouped_tree_queries` (idempotent)."""
    wrap_sdpa(grouped_tree_sdpa, "_hf_eagle3_grouped")
