"""Verification attention with each key/value head's query heads folded into the query dimension: sdpa's outputs and
logits over the keys as cached (no repeated copies), and only in forwards that ask for it.

Equal up to rounding, at torch.testing's tolerances for the dtype: the CPU's matrix products may round a row
differently with the number of rows they multiply, and the fold multiplies `G` times as many (float32 outputs part by
1-2 units in the last place, up to 2e-7, in some rows; bfloat16 ones were equal bit for bit on a Zen 2 EPYC)."""


import pytest
import torch
from helpers import sliding_target, tiny_draft, tiny_target
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_eagle3.commands import bench_attention
from hf_eagle3.decoding import grouped_attention
from hf_eagle3.decoding.grouped_attention import KEYWORD
from hf_eagle3.decoding.target_attention import TargetAttention
from hf_eagle3.decoding.tree import DraftTree, build_tree

HEAD_DIM, PREFIX = 16, 37


class _Attention:  # what transformers' sdpa function reads from the attention module
    def __init__(self, heads: int, kv_heads: int):
        self.num_key_value_groups = heads // kv_heads
        self.is_causal = True


class _AttentionShapes(TorchDispatchMode):
    """The query and key head counts of every sdpa kernel call run inside it."""

    def __init__(self):
        super().__init__()
        self.heads = []  # (query heads, key heads) per call
        self.queries = []  # query rows per call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.__name__:
            self.heads.append((args[0].shape[1], args[1].shape[1]))
            self.queries.append(args[0].shape[2])
        return func(*args, **(kwargs or {}))


def _random_mask(batch: int, queries: int, keys: int, dtype: torch.dtype, boolean: bool) -> torch.Tensor:
    visible = torch.rand(batch, 1, queries, keys) > 0.3
    visible[..., 0] = True  # every query sees a key
    return visible if boolean else torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("boolean", [False, True], ids=["additive", "boolean"])
def test_folded_attention_is_sdpa_with_repeated_keys(dtype, heads, kv_heads, boolean):
    torch.manual_seed(0)
    batch, queries = 2, 11
    # as the layers hand them over: the query heads a view of the projection's [B, n, H, D]
    query = torch.randn(batch, queries, heads, HEAD_DIM, dtype=dtype).transpose(1, 2)
    key, value = (torch.randn(batch, kv_heads, PREFIX + queries, HEAD_DIM, dtype=dtype) for _ in range(2))
    mask = _random_mask(batch, queries, PREFIX + queries, dtype, boolean)
    grouped_attention.install()  # what the first verification forward does
    module, attention = _Attention(heads, kv_heads), ALL_ATTENTION_FUNCTIONS["sdpa"]
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=HEAD_DIM**-0.5)
    shapes = _AttentionShapes()
    with shapes:
        folded, _ = attention(module, query, key, value, mask, dropout=0.0, scaling=HEAD_DIM**-0.5, **{KEYWORD: True})
    assert folded.shape == (batch, queries, heads, HEAD_DIM) and folded.is_contiguous()
    torch.testing.assert_close(folded, expected)
    assert shapes.heads == [(kv_heads, kv_heads)]  # the keys as given, not repeated per query head


@pytest.mark.parametrize(("queries", "heads", "kv_heads", "masked"), [(1, 4, 2, True), (5, 4, 4, True),
                                                                      (5, 4, 2, False)],
                         ids=["one-query", "one-key-head-each", "no-mask"])
def test_calls_the_fold_does_not_fit_go_to_sdpa_unchanged(queries, heads, kv_heads, masked):
    torch.manual_seed(0)
    query = torch.randn(1, heads, queries, HEAD_DIM)
    key, value = (torch.randn(1, kv_heads, PREFIX + queries, HEAD_DIM) for _ in range(2))
    mask = _random_mask(1, queries, PREFIX + queries, torch.float32, boolean=False) if masked else None
    module = _Attention(heads, kv_heads)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    registered, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, mask, scaling=0.25, **{KEYWORD: True})
    assert torch.equal(registered, expected)


def _tree(root: int, vocab_size: int):
    """A root, three children, two grandchildren under the first child and one node below the first of those."""
    generator = torch.Generator().manual_seed(root)
    return build_tree(torch.tensor(root), candidate_tokens=torch.randint(0, vocab_size, (6,), generator=generator),
                      candidate_scores=torch.tensor([-0.1, -0.5, -0.9, -0.2, -0.3, -0.4]),
                      candidate_parents=torch.tensor([-1, -1, -1, 0, 0, 3]),
                      candidate_depths=torch.tensor([1, 1, 1, 2, 2, 3]), total_tokens=6)


def _verification_logits(model, folded: bool) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The logits of one verification forward of a tree per row (two rows, the second's prompt left-padded by 4),
    as the decoding loop runs it, and the head counts of its attention kernels."""
    vocab_size = model.config.vocab_size
    prompt = torch.randint(1, vocab_size, (2, PREFIX), generator=torch.Generator().manual_seed(0))
    prompt_mask = torch.ones(2, PREFIX, dtype=torch.long)
    prompt_mask[1, :4] = 0
    cache = DynamicCache()  # every entry kept, as the decoding loop's cache keeps them (the masks apply the window)
    attention = TargetAttention(model, exact=False, prompt_mask=prompt_mask, batch_size=2)
    trees = [_tree(3, vocab_size), _tree(5, vocab_size)]
    visible = prompt_mask.bool()
    prefix_positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    node_positions = prefix_positions[:, -1:] + 1 + torch.stack([tree.depths for tree in trees])
    tree = DraftTree(*(torch.stack([getattr(row, name) for row in trees]) for name in (
        "tokens", "parents", "depths", "ancestors", "candidate_ids", "candidate_rank_keys", "candidate_depths")),
        max_depth=trees[0].max_depth)
    kwargs = attention.verification_kwargs(tree, PREFIX) if folded else {}
    assert (KEYWORD in kwargs) == folded
    shapes = _AttentionShapes()
    with torch.no_grad():
        model(prompt, attention_mask=prompt_mask, position_ids=prefix_positions, cache=cache)
        with shapes:
            logits = model(
                torch.stack([tree.tokens for tree in trees]), position_ids=node_positions, cache=cache,
                attention_mask=attention.verification_mask(tree.ancestors, visible,
                                                           torch.cat([prefix_positions, node_positions], dim=1),
                                                           model.dtype),
                **kwargs,
            ).logits
    return logits, shapes.heads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("target", ["grouped", "one-key-head-each", "sliding-and-full"])
def test_verification_logits_are_the_same_with_the_fold(target, dtype):
    model = {"grouped": lambda: tiny_target("llama"),
             "one-key-head-each": lambda: tiny_target("llama", key_value_heads=4),
             "sliding-and-full": lambda: sliding_target("qwen2")}[target]().to(dtype)  # qwen2: a mask per layer kind
    expected, repeated = _verification_logits(model, folded=False)
    logits, heads = _verification_logits(model, folded=True)
    torch.testing.assert_close(logits, expected)
    kv_heads = model.config.num_key_value_heads
    assert repeated == [(4, 4)] * model.config.num_hidden_layers  # sdpa as transformers calls it: keys repeated
    assert heads == [(kv_heads, kv_heads)] * model.config.num_hidden_layers


def test_eagle3_generate_verifies_over_the_keys_as_cached_and_decodes_plain_greedy_tokens():
    target, draft = tiny_target("llama"), tiny_draft()  # 4 query heads over 2 key/value heads
    prompt = torch.randint(1, target.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    expected = target.generate(prompt, do_sample=False, max_new_tokens=20)
    shapes = _AttentionShapes()
    with shapes:
        output = target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=draft, tree_depth=3,
                                 tree_top_k=2, tree_total_tokens=6, ngram_candidates=False)
    assert torch.equal(output, expected)
    # every layer of every verification forward: 2 key/value heads, each with its 2 query heads folded into its rows
    # (the draft's own calls, over a few queries each, are transformers' sdpa as it is)
    folded = sum(heads == (2, 2) and queries == 2 * 7 for heads, queries in zip(shapes.heads, shapes.queries))
    assert folded == target.config.num_hidden_layers * draft.generation_stats.num_cycles


def test_the_fold_is_registered_once():
    grouped_attention.install()
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    grouped_attention.install()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa


def test_bench_attention_times_both_ways_and_finds_their_logits_equal_to_rounding():
    config = tiny_target("llama").config  # the Llama-3.1-8B shapes would not fit a test: the same code at 4 / 2 heads
    target = bench_attention.random_target(config, torch.float32)
    rows = bench_attention.time_verification(target, contexts=[20, 40], tokens=5, repetitions=2)
    assert [row["context"] for row in rows] == [20, 40]
    assert all(row["repeated_ms"] > 0 and row["folded_ms"] > 0 and row["logits_max_difference"] < 1e-5
               for row in rows)
    assert "| 40 |" in bench_attention.markdown_table(rows, layers=config.num_hidden_layers)
