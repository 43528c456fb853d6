"""Training-time test: the Figure-6 attention, its memory, and its alignment with inference-time drafting."""

import math

import pytest
import torch
from helpers import HIDDEN, VOCAB, tiny_draft
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hf_eagle3.commands import bench_train_step
from hf_eagle3.training.losses import row_terms
from hf_eagle3.training.ttt import TrainingTimeTest, shift_left, target_distribution, ttt_attention

BATCH, LENGTH, HEADS, KV_HEADS, HEAD_DIM = 2, 12, 4, 2, 8


def explicit_figure6_attention(queries, keys, values, scaling, window=None):
    """Reference: every step's queries against all `S * T` keys, masked as in Figure 6 (and by a sliding `window`),
    `[S, B, T, H * D]`."""
    steps, length = len(keys), keys[0].shape[2]
    all_keys = torch.cat(keys, dim=2).repeat_interleave(HEADS // KV_HEADS, dim=1)  # [B, H, S*T, D]
    all_values = torch.cat(values, dim=2).repeat_interleave(HEADS // KV_HEADS, dim=1)
    key_step = torch.arange(steps).repeat_interleave(length)  # [S*T]
    key_row = torch.arange(length).repeat(steps)
    outputs = []
    for step, query in enumerate(queries):
        row = torch.arange(length)[:, None]
        native = (key_step == 0) & (key_row <= row) & ((key_row > row + step - window) if window else True)
        own_chain = (key_step >= 1) & (key_step <= step) & (key_row == row)
        allowed = native | own_chain  # [T, S*T]
        scores = torch.matmul(query, all_keys.transpose(2, 3)) * scaling
        scores = scores.masked_fill(~allowed, float("-inf"))
        output = torch.matmul(scores.softmax(-1), all_values)  # [B, H, T, D]
        outputs.append(output.transpose(1, 2).reshape(BATCH, length, -1))
    return outputs


@pytest.mark.parametrize("chunk_rows", [LENGTH, 5, 1])
@pytest.mark.parametrize("window", [None, 6])
def test_ttt_attention_equals_explicit_attention_with_figure6_mask(chunk_rows, window):
    torch.manual_seed(0)
    steps = 5
    queries = [torch.randn(BATCH, HEADS, LENGTH, HEAD_DIM) for _ in range(steps)]
    keys = [torch.randn(BATCH, KV_HEADS, LENGTH, HEAD_DIM) for _ in range(steps)]
    values = [torch.randn(BATCH, KV_HEADS, LENGTH, HEAD_DIM) for _ in range(steps)]
    expected = explicit_figure6_attention(queries, keys, values, HEAD_DIM**-0.5, window)
    for step in range(steps):
        got = ttt_attention(queries[step], keys[: step + 1], values[: step + 1], HEAD_DIM**-0.5, window, chunk_rows)
        assert (got - expected[step]).abs().max() <= 1e-5


def attention_saved_bytes(length: int, steps: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """Bytes autograd keeps for the backward pass of one `ttt_attention` call (distinct storages)."""
    query = torch.randn(1, heads, length, head_dim, requires_grad=True)
    keys = [torch.randn(1, kv_heads, length, head_dim, requires_grad=True) for _ in range(steps)]
    values = [torch.randn(1, kv_heads, length, head_dim, requires_grad=True) for _ in range(steps)]
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        ttt_attention(query, keys, values, head_dim**-0.5)
    return sum(storages.values())


def test_ttt_attention_keeps_no_scores_for_backward():
    length, steps, heads = 1024, 7, 16
    memory = attention_saved_bytes(length, steps, heads, kv_heads=2, head_dim=16)
    # Queries, outputs and log-sum-exps, and each chunk's keys, values and mask: a fraction of the scores
    assert memory < 4 * heads * length * (length + steps) / 4, memory  # [H, T, T + s] float32


def target_view(draft, target_logits):
    return target_distribution(target_logits, torch.nn.Identity(), draft.draft_to_target)


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
    output = TrainingTimeTest(draft, steps=1)(input_ids, target_features, *target_view(draft, target_logits), loss_mask)

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
    target = target_view(draft, target_logits)
    output = TrainingTimeTest(draft, steps=3)(input_ids, target_features, *target, torch.ones(BATCH, LENGTH))
    assert output.step_counts.sum() == 0 and output.loss == 0
    assert output.chain_accepted.sum() == 0 and output.chain_attempted[0] == BATCH * (LENGTH - 2)


def test_loss_weights_steps_by_decay_and_trains(draft_and_batch):
    draft, input_ids, target_features = draft_and_batch
    target_logits = torch.randn(BATCH, LENGTH, VOCAB)
    loss_mask = torch.ones(BATCH, LENGTH)
    target = target_view(draft, target_logits)
    output = TrainingTimeTest(draft, steps=3, decay=0.5)(input_ids, target_features, *target, loss_mask)
    assert torch.allclose(output.loss, (output.step_losses * torch.tensor([1.0, 0.5, 0.25])).sum())
    output.loss.backward()
    assert draft.fc.weight.grad is not None and draft.embed_tokens.weight.grad is not None


def reference_loss(draft, input_ids, target_features, target_logits, loss_mask, steps, decay, loss_kind="kl"):
    """The TTT loss rebuilt from inference-time chain drafting: for every row, the draft's prefix forward and then
    one cached step per drafted token, each scored against the target's distribution of the token it predicts (soft
    cross-entropy; the LK losses from it and the acceptance probability sum(min(p, q)), as arXiv:2602.23881 writes
    them)."""
    batch_size, length = input_ids.shape
    target_probs = target_logits[..., draft.draft_to_target].softmax(-1)
    kept = draft.t2d[target_logits.argmax(-1)]  # [B, T]: the target's top-1 at position j is draftable
    loss = 0.0
    for step in range(steps):
        terms = []
        for batch in range(batch_size):
            for row in range(length - step - 2):  # predicts t_{row + step + 2}
                position = row + step + 1
                if not (loss_mask[batch, position + 1] and kept[batch, position]):
                    continue
                output = draft(input_ids[batch : batch + 1, 1 : row + 2], target_features[batch : batch + 1, : row + 1])
                for drafted in range(1, step + 1):
                    token = input_ids[batch : batch + 1, row + drafted + 1 : row + drafted + 2]
                    output = draft(token, output.hidden_states[:, -1:], cache=output.cache)
                log_probs = output.logits[0, -1].log_softmax(-1)
                p = target_probs[batch, position]
                terms.append((-(p * log_probs).sum(), torch.minimum(p, log_probs.exp()).sum()))
        if terms:
            cross_entropy, alpha = (torch.stack(column) for column in zip(*terms))
            if loss_kind == "kl":
                step_loss = cross_entropy.mean()
            elif loss_kind == "lk":
                weight = math.exp(-3.0 * alpha.mean().item())
                step_loss = weight * cross_entropy.mean() + (1 - weight) * (1 - alpha.mean())
            else:
                step_loss = -alpha.log().mean()
            loss = loss + decay**step * step_loss
    return loss


def check_loss_and_gradients_against_chain_drafting(draft, input_ids, target_features, loss_kind):
    """The checkpointed, chunked TTT gives the loss and the gradients of the same drafts made one cached step at a
    time, as at inference."""
    target_logits = torch.randn(BATCH, LENGTH, VOCAB)
    target_logits[..., draft.draft_to_target[:8]] += 3.0  # most top-1 tokens draftable
    loss_mask = (torch.rand(BATCH, LENGTH) < 0.8).long()
    parameters = [parameter for parameter in draft.parameters() if parameter.requires_grad]
    ttt = TrainingTimeTest(draft, steps=3, decay=0.8, loss=loss_kind)
    target_view = target_distribution(target_logits, torch.nn.Identity(), draft.draft_to_target, chunk_tokens=5)
    loss = ttt(input_ids, target_features, *target_view, loss_mask).loss
    gradients = torch.autograd.grad(loss, parameters, allow_unused=True)
    expected = reference_loss(draft, input_ids, target_features, target_logits, loss_mask, steps=3, decay=0.8,
                              loss_kind=loss_kind)
    expected_gradients = torch.autograd.grad(expected, parameters, allow_unused=True)
    assert torch.allclose(loss, expected, atol=1e-5)
    for got, want in zip(gradients, expected_gradients):
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max()


def test_loss_and_gradients_equal_those_of_inference_time_chain_drafting(draft_and_batch):
    check_loss_and_gradients_against_chain_drafting(*draft_and_batch, "kl")


@pytest.mark.parametrize("loss_kind", ["lk", "lk-alpha"])
def test_lk_losses_and_gradients_equal_the_paper_s_over_inference_time_chain_drafting(loss_kind):
    torch.manual_seed(0)
    draft = tiny_draft(draft_vocab_size=48).eval()
    draft.attach_target_embedding(torch.nn.Embedding(VOCAB, HIDDEN))
    input_ids, target_features = torch.randint(0, VOCAB, (BATCH, LENGTH)), torch.randn(BATCH, LENGTH, 3 * HIDDEN)
    check_loss_and_gradients_against_chain_drafting(draft, input_ids, target_features, loss_kind)


def test_acceptance_probability_is_one_minus_total_variation_and_is_reported_per_step():
    torch.manual_seed(0)
    logits, target_logits = torch.randn(6, 48), torch.randn(6, 48)
    target_probs = target_logits.softmax(-1)
    _, acceptance = row_terms(logits, target_probs)
    total_variation = (target_probs - logits.softmax(-1)).abs().sum(-1) / 2
    assert torch.allclose(acceptance, 1 - total_variation, atol=1e-6)
    assert torch.allclose(row_terms(target_logits, target_probs)[1], torch.ones(6), atol=1e-6)  # the same: always
    draft = tiny_draft(draft_vocab_size=48)
    draft.attach_target_embedding(torch.nn.Embedding(VOCAB, HIDDEN))
    output = TrainingTimeTest(draft, steps=2)(torch.randint(0, VOCAB, (BATCH, LENGTH)),
                                              torch.randn(BATCH, LENGTH, 3 * HIDDEN),
                                              *target_view(draft, torch.randn(BATCH, LENGTH, VOCAB)),
                                              torch.ones(BATCH, LENGTH))
    assert ((output.step_acceptance > 0) & (output.step_acceptance <= output.step_counts)).all()


def test_an_unknown_loss_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="Unknown loss 'tv': use one of kl, lk, lk-alpha"):
        TrainingTimeTest(tiny_draft(), loss="tv")


def test_shift_left():
    assert shift_left(torch.tensor([[1, 2, 3]])).tolist() == [[2, 3, 0]]
    assert shift_left(torch.tensor([[True, True]]), fill=False).tolist() == [[True, False]]


def test_at_least_one_step():
    with pytest.raises(ValueError, match="steps must be >= 1"):
        TrainingTimeTest(tiny_draft(), steps=0)


def test_bench_train_step_reports_a_step_s_speed_and_peak_memory_or_the_error_it_stopped_with():
    shape = dict(vocab_size=VOCAB, draft_vocab_size=48, hidden_size=HIDDEN, intermediate_size=64,
                 num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, target_num_hidden_layers=4)
    result = bench_train_step.train_step(64, 3, "float32", "cpu", None, "lk", shape)
    assert result["tokens_per_second"] > 0 and math.isfinite(result["loss"])
    assert result["peak_host_gib"] >= result["setup_peak_host_gib"] > 0
    failed = {**result, "error": "[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: not enough memory"}
    assert bench_train_step.table_row(result).startswith("| 64 |")
    assert "failed: [enforce fail" in bench_train_step.table_row(failed)
