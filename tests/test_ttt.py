"""Training-time test: the Figure-6 attention, its memory, and its alignment with inference-time drafting."""

import pytest
import torch
from helpers import HIDDEN, VOCAB, tiny_draft
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hf_eagle3.training.ttt import TrainingTimeTest, shift_left, ttt_attention

BATCH, LENGTH, HEADS, KV_HEADS, HEAD_DIM = 2, 12, 4, 2, 8


def explicit_figure6_attention(queries, keys, values, scaling):
    """Reference: every step's queries against all `S * T` keys, masked as in Figure 6, `[S, B, T, H * D]`."""
    steps, length = len(keys), keys[0].shape[2]
    all_keys = torch.cat(keys, dim=2).repeat_interleave(HEADS // KV_HEADS, dim=1)  # [B, H, S*T, D]
    all_values = torch.cat(values, dim=2).repeat_interleave(HEADS // KV_HEADS, dim=1)
    key_step = torch.arange(steps).repeat_interleave(length)  # [S*T]
    key_row = torch.arange(length).repeat(steps)
    outputs = []
    for step, query in enumerate(queries):
        row = torch.arange(length)[:, None]
        native = (key_step == 0) & (key_row <= row)
        own_chain = (key_step >= 1) & (key_step <= step) & (key_row == row)
        allowed = native | own_chain  # [T, S*T]
        scores = torch.matmul(query, all_keys.transpose(2, 3)) * scaling
        scores = scores.masked_fill(~allowed, float("-inf"))
        output = torch.matmul(scores.softmax(-1), all_values)  # [B, H, T, D]
        outputs.append(output.transpose(1, 2).reshape(BATCH, length, -1))
    return outputs


def test_ttt_attention_equals_explicit_attention_with_figure6_mask():
    torch.manual_seed(0)
    steps = 5
    queries = [torch.randn(BATCH, HEADS, LENGTH, HEAD_DIM) for _ in range(steps)]
    keys = [torch.randn(BATCH, KV_HEADS, LENGTH, HEAD_DIM) for _ in range(steps)]
    values = [torch.randn(BATCH, KV_HEADS, LENGTH, HEAD_DIM) for _ in range(steps)]
    causal = torch.full((LENGTH, LENGTH), torch.finfo(torch.float32).min).triu(1)
    expected = explicit_figure6_attention(queries, keys, values, HEAD_DIM**-0.5)
    for step in range(steps):
        got = ttt_attention(queries[step], keys[: step + 1], values[: step + 1], HEAD_DIM**-0.5, causal)
        assert (got - expected[step]).abs().max() <= 1e-5


def saved_tensor_bytes(steps: int, length: int) -> int:
    """Bytes autograd keeps for the backward pass of one TTT forward with `steps` steps (distinct storages)."""
    torch.manual_seed(0)
    draft = tiny_draft(draft_vocab_size=VOCAB)
    draft.attach_target_embedding(torch.nn.Embedding(VOCAB, HIDDEN))
    ttt = TrainingTimeTest(draft, steps=steps)
    input_ids = torch.randint(0, VOCAB, (1, length))
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        ttt(input_ids, torch.randn(1, length, 3 * HIDDEN), torch.randn(1, length, VOCAB), torch.ones(1, length))
    return sum(storages.values())


def test_ttt_memory_grows_linearly_in_steps():
    length = 256
    memory = {steps: saved_tensor_bytes(steps, length) for steps in (2, 4, 6, 8)}
    increments = [memory[4] - memory[2], memory[6] - memory[4], memory[8] - memory[6]]
    # Equal increments per added step (linear), within 5%: no S*T x S*T tensor anywhere.
    assert max(increments) <= 1.05 * min(increments), memory
    explicit_scores_bytes = 4 * 4 * (8 * length) ** 2  # the [H, S*T, S*T] float32 score matrix alone, S = 8
    assert memory[8] < explicit_scores_bytes, memory


DRAFT_VARIANTS = [
    {}, {"fc_norm": True}, {"norm_before_residual": True}, {"fc_norm": True, "norm_before_residual": True},
    {"fc_norm": True, "norm_output": True}, {"norm_before_fc": True}, {"qk_norm": True}, {"num_hidden_layers": 2},
    {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5},
]


@pytest.fixture(params=DRAFT_VARIANTS, ids=lambda options: "+".join(options) or "eagle3")
def draft_and_batch(request):
    torch.manual_seed(0)
    draft = tiny_draft(draft_vocab_size=48, **request.param).eval()
    for norm in draft.modules():  # random norm weights, so that a norm applied in the wrong place shows
        if isinstance(norm, LlamaRMSNorm):
            torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    draft.attach_target_embedding(torch.nn.Embedding(VOCAB, HIDDEN))
    input_ids = torch.randint(0, VOCAB, (BATCH, LENGTH))
    target_features = torch.randn(BATCH, LENGTH, 3 * HIDDEN)
    return draft, input_ids, target_features


def test_unrolled_steps_equal_inference_time_chain_drafting(draft_and_batch):
    """Step s of row i is what the draft computes at inference after accepting t_0 .. t_{i+1}: the prefix from
    target features, then one cached step per drafted token, fed its own feature `a`."""
    draft, input_ids, target_features = draft_and_batch
    steps = 4
    unrolled = list(TrainingTimeTest(draft, steps=steps).unroll(input_ids, target_features))
    row = 5
    with torch.no_grad():
        output = draft(input_ids[:, 1 : row + 2], target_features[:, : row + 1])  # positions 0 .. row
        feature = output.hidden_states[:, -1:]
        assert (feature[:, 0] - unrolled[0][:, row]).abs().max() <= 1e-5
        for step in range(1, steps):
            output = draft(input_ids[:, row + step + 1 : row + step + 2], feature, cache=output.cache)
            feature = output.hidden_states
            assert (feature[:, 0] - unrolled[step][:, row]).abs().max() <= 1e-5


def test_one_step_loss_is_soft_cross_entropy_of_the_next_next_token(draft_and_batch):
    draft, input_ids, target_features = draft_and_batch
    target_logits = torch.randn(BATCH, LENGTH, VOCAB)
    loss_mask = (torch.rand(BATCH, LENGTH) < 0.7).long()
    output = TrainingTimeTest(draft, steps=1)(input_ids, target_features, target_logits, loss_mask)

    # Row i reads t_{i+1} and g_i, predicts t_{i+2}: target distribution L_{i+1}, mask of token i+2.
    logits = draft(input_ids[:, 1:-1], target_features[:, :-2], use_cache=False).logits  # rows 0 .. T-3
    target = target_logits[:, 1:-1]
    target_probs = target[..., draft.draft_to_target].softmax(-1)
    kept = loss_mask[:, 2:].bool() & draft.t2d[target.argmax(-1)]
    cross_entropy = -(target_probs * logits.log_softmax(-1)).sum(-1)
    expected = cross_entropy[kept].mean()
    assert torch.allclose(output.loss, expected, atol=1e-5)
    assert output.step_counts[0] == kept.sum()


def test_positions_whose_target_top1_is_outside_the_draft_vocabulary_are_masked(draft_and_batch):
    draft, input_ids, target_features = draft_and_batch
    outside = (~draft.t2d).nonzero()[0, 0]
    target_logits = torch.zeros(BATCH, LENGTH, VOCAB)
    target_logits[..., outside] = 10.0  # the target's top-1 is never draftable
    output = TrainingTimeTest(draft, steps=3)(input_ids, target_features, target_logits, torch.ones(BATCH, LENGTH))
    assert output.step_counts.sum() == 0 and output.loss == 0
    assert output.chain_accepted.sum() == 0 and output.chain_attempted[0] == BATCH * (LENGTH - 2)


def test_loss_weights_steps_by_decay_and_trains(draft_and_batch):
    draft, input_ids, target_features = draft_and_batch
    target_logits = torch.randn(BATCH, LENGTH, VOCAB)
    loss_mask = torch.ones(BATCH, LENGTH)
    output = TrainingTimeTest(draft, steps=3, decay=0.5)(input_ids, target_features, target_logits, loss_mask)
    assert torch.allclose(output.loss, (output.step_losses * torch.tensor([1.0, 0.5, 0.25])).sum())
    output.loss.backward()
    assert draft.fc.weight.grad is not None and draft.embed_tokens.weight.grad is not None


def test_shift_left():
    assert shift_left(torch.tensor([[1, 2, 3]])).tolist() == [[2, 3, 0]]
    assert shift_left(torch.tensor([[True, True]]), fill=False).tolist() == [[True, False]]


def test_at_least_one_step():
    with pytest.raises(ValueError, match="steps must be >= 1"):
        TrainingTimeTest(tiny_draft(), steps=0)
