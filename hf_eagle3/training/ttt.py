"""Training-time test (TTT): the EAGLE-3 training loss, unrolled over `S` draft steps (arXiv:2503.01840 §3.2).

Alignment (the same as `Eagle3DraftModel` at inference). A training sequence holds tokens `t_0 .. t_{T-1}`; one
target forward gives, at every position `j`, the fused feature `g_j` (target hidden states at `target_layer_ids`) and
logits `L_j`, the target's distribution of `t_{j+1}`. Every *row* `i` of the draft's input is one ground-truth prefix
`t_0 .. t_{i+1}`, from which step `s` drafts one more token:

    step s, row i   virtual position p = i + s            (its RoPE position)
        feature     s = 0: g_i          s > 0: a^{s-1}_i  (the draft's own output of the previous step, same row,
                                                           which stands in for the target feature g_{i+s})
        token       t_{i+s+1}                             (ground truth: embeddings are never the draft's guesses)
        predicts    t_{i+s+2}, against the target's L_{i+s+1} restricted to the draft vocabulary
        attends to  the native step's keys of rows 0 .. i (the real prefix, causal)
                    + the keys of steps 1 .. s of row i   (its own chain of drafted positions)

This is Figure 6 of the paper: a simulated token sees its ground-truth prefix and its own earlier predictions, never a
sibling made at another row. At inference, after the target accepts a prefix ending at position `i + 1`, the draft
holds keys for positions `0 .. i` computed from target features, and every draft step appends one key computed from
its own feature `a`: exactly the rows above. So with `S = 1` this is plain (no-TTT) training.

Loss. At each step a soft cross-entropy between the target's distribution renormalised over the draft vocabulary and
the draft's, averaged over the kept positions and weighted `decay ** s` (official: 7 steps, 0.8). A position is kept
when its predicted token `t_{i+s+2}` is an assistant token of the conversation (`loss_mask`) and the target's top-1
there lies inside the draft vocabulary (the draft can never propose it otherwise). Positions past the end of the
sequence are dropped. (The official code leaves `loss_mask` unshifted before step 0, masking by `t_{i+s}` instead of
the predicted token `t_{i+s+2}`; we mask by the predicted token.)

Attention cost. The native step's keys are scored with one `[T, T]` matrix product per step; the keys of the
simulated steps only ever meet the query of their own row, so each is scored by a per-row dot product (`[T]`).
Memory is therefore linear in `S`: nothing of size `S*T x S*T` is ever built.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..modeling_eagle3 import Eagle3DraftModel


def shift_left(tensor: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
    """`tensor[:, i] <- tensor[:, i + 1]` along dim 1, the last position filled with `fill`."""
    return torch.cat([tensor[:, 1:], torch.full_like(tensor[:, :1], fill)], dim=1)


def ttt_attention(
    query: torch.Tensor,  # [B, H, T, D], step s (rotated)
    keys: list[torch.Tensor],  # s + 1 tensors [B, KV, T, D]: keys[0] from the native step, keys[j] from step j
    values: list[torch.Tensor],  # same layout as keys
    scaling: float,
    causal_mask: torch.Tensor,  # [T, T] additive (0 or dtype min): the native step's causal mask
) -> torch.Tensor:
    """Attention of step `s = len(keys) - 1` under the Figure-6 mask, output `[B, T, H * D]`.

    Row `i` attends to `keys[0][:, :, :i+1]` (the real prefix) and to `keys[j][:, :, i]` for `j = 1 .. s` (its own
    drafted chain). The first is a matrix product; the others are per-row dot products. Query heads are grouped per
    key / value head (`[B, KV, G, T, D]`) instead of repeating keys, so no step stores copies of earlier keys.
    """
    batch_size, num_heads, length, head_dim = query.shape
    num_kv_heads = keys[0].shape[1]
    grouped_query = query.view(batch_size, num_kv_heads, num_heads // num_kv_heads, length, head_dim)
    prefix_scores = torch.matmul(grouped_query, keys[0][:, :, None].transpose(-1, -2))  # [B, KV, G, T, T]
    chain_scores = [(grouped_query * key[:, :, None]).sum(-1, keepdim=True) for key in keys[1:]]  # [B, KV, G, T, 1]
    scores = torch.cat([prefix_scores, *chain_scores], dim=-1) * scaling + F.pad(causal_mask, (0, len(chain_scores)))
    probabilities = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)  # [B, KV, G, T, T + s]
    output = torch.matmul(probabilities[..., :length], values[0][:, :, None])  # [B, KV, G, T, D]
    for j, value in enumerate(values[1:]):
        output = output + probabilities[..., length + j, None] * value[:, :, None]
    return output.reshape(batch_size, num_heads, length, head_dim).transpose(1, 2).reshape(batch_size, length, -1)


def windowed_causal_mask(causal_mask: torch.Tensor, step: int, window: int) -> torch.Tensor:
    """The native step's `[T, T]` causal mask for a sliding-window layer at step `step`: row `i` (at position
    `i + step`) sees the prefix keys at positions `j > i + step - window` only. Its own drafted chain (positions
    `i + 1 .. i + step`) stays inside the window, as `TrainingTimeTest` checks."""
    rows = torch.arange(causal_mask.shape[0], device=causal_mask.device)
    outside = rows[None, :] <= rows[:, None] + step - window
    return causal_mask.masked_fill(outside, torch.finfo(causal_mask.dtype).min)


@dataclass
class TTTOutput:
    """Result of one training-time-test forward; every tensor but `loss` is detached and has shape `[S]`.

    Args:
        loss: sum over steps of `decay ** s` times the step's soft cross-entropy (a scalar with grad).
        step_losses: soft cross-entropy of each step, averaged over its kept positions.
        step_correct / step_counts: kept positions where the draft's top-1 is the target's top-1 / all kept positions.
        chain_accepted / chain_attempted: greedy chain acceptance. `chain_attempted[s]` counts the rows whose step-s
            token is an assistant token and whose drafts at steps `0 .. s-1` all matched the target's top-1;
            `chain_accepted[s]` those among them whose step-s draft matches too. Their ratio is s-α.
    """

    loss: torch.Tensor
    step_losses: torch.Tensor
    step_correct: torch.Tensor
    step_counts: torch.Tensor
    chain_accepted: torch.Tensor
    chain_attempted: torch.Tensor


class TrainingTimeTest(nn.Module):
    """The draft plus its TTT loss, as one module (so `accelerate` / DDP can wrap it).

    `forward(input_ids, target_features, target_logits, loss_mask)` unrolls `steps` draft steps over a batch and
    returns a `TTTOutput`. The target's work (its hidden states and logits) is done by the caller, so features can
    come from an online target forward or from disk.
    """

    def __init__(self, draft: Eagle3DraftModel, steps: int = 7, decay: float = 0.8):
        super().__init__()
        if steps < 1:
            raise ValueError(f"The number of training-time-test steps must be >= 1, got {steps}.")
        window = draft.config.sliding_window
        if window is not None and "sliding_attention" in (draft.config.layer_types or []) and steps >= window:
            raise ValueError(
                f"The draft's sliding window ({window}) must be longer than the training-time-test steps ({steps})."
            )
        self.draft = draft
        self.steps = steps
        self.decay = decay

    def unroll(self, input_ids: torch.LongTensor, target_features: torch.Tensor) -> Iterator[torch.Tensor]:
        """The draft's output features `a^s` `[B, T, k]` of steps `s = 0 .. steps-1`, one step per iteration.

        `input_ids` `[B, T]` are the ground-truth tokens, `target_features` `[B, T, 3 k_t]` the target's hidden
        states at `target_layer_ids` concatenated. Row `i` of step `s` is the draft's prediction of `t_{i+s+2}`.
        """
        draft = self.draft
        draft.check_target_attached()  # a head or embedding still the draft's random one would train silently
        layers = draft.decoder_layers
        batch_size, length = input_ids.shape
        tokens = shift_left(input_ids)  # t_{i+1}
        features = draft.fuse(target_features)  # g, [B, T, k]
        positions = torch.arange(length, device=input_ids.device)[None].expand(batch_size, -1)
        causal_mask = torch.full((length, length), torch.finfo(features.dtype).min, device=features.device).triu(1)
        keys, values = [[] for _ in layers], [[] for _ in layers]  # per decoder layer, one entry per step
        for step in range(self.steps):
            embeds = draft.embed_tokens(tokens).to(features.dtype)
            position_embeddings = draft.rotary_emb(features, positions + step)
            for layer, layer_keys, layer_values in zip(layers, keys, values):
                attention = layer.self_attn
                attn_input, residual = layer.attention_input(embeds, features)  # [B, T, 2k | k], [B, T, k]
                query, key, value = attention.project(attn_input, position_embeddings)
                layer_keys.append(key)
                layer_values.append(value)
                mask = causal_mask
                if attention.sliding_window is not None:
                    mask = windowed_causal_mask(causal_mask, step, attention.sliding_window)
                attn_output = ttt_attention(query, layer_keys, layer_values, attention.scaling, mask.to(query.dtype))
                features = layer.finish(residual, attention.o_proj(attn_output))  # [B, T, k]
            features = draft.output_feature(features)  # a^s
            yield features
            # Next step: same rows, one position further on; the feature a^s stays in its row and feeds back.
            tokens = shift_left(tokens)

    def forward(
        self,
        input_ids: torch.LongTensor,  # [B, T]
        target_features: torch.Tensor,  # [B, T, 3 k_t]: target hidden states at target_layer_ids, concatenated
        target_logits: torch.Tensor,  # [B, T, V]: the target's logits
        loss_mask: torch.Tensor,  # [B, T]: 1 where the token is an assistant token (0 on padding)
    ) -> TTTOutput:
        draft = self.draft
        length = input_ids.shape[1]
        # The target's view of every position j: its distribution of t_{j+1} renormalised over the draft vocabulary,
        # and whether its top-1 is in that vocabulary. Row i at step s is scored against position j = i + s + 1.
        # (`max(-1).indices` rather than `argmax`: the same index, several times faster on CPU.)
        with torch.no_grad():
            draft_to_target = draft.draft_to_target  # sorted target ids
            target_probs = target_logits[..., draft_to_target].float().softmax(-1)  # [B, T, Vd]
            target_top1 = target_logits.max(-1).indices  # [B, T]
            target_top1_in_draft = draft.t2d[target_top1]  # [B, T]
            target_top1_draft_id = torch.searchsorted(draft_to_target, target_top1).clamp(max=len(draft_to_target) - 1)
        assistant = shift_left(shift_left(loss_mask.bool(), fill=False), fill=False)  # t_{i+2} is an assistant token

        loss = target_probs.new_zeros(())
        step_losses, step_correct, step_counts, chain_accepted, chain_attempted = [], [], [], [], []
        chain_alive = torch.ones_like(assistant)  # every earlier draft of the row matched the target's top-1
        for step, features in enumerate(self.unroll(input_ids, target_features)):
            # Logits only where they are scored: rows whose predicted token is an assistant token.
            rows = assistant[:, : length - step - 1]  # rows past T - step - 2 have no target
            logits = draft.compute_logits(features[:, : length - step - 1][rows])  # [N, Vd]
            log_probs = logits.float().log_softmax(-1)
            row_target_probs = target_probs[:, step + 1 :][rows]  # [N, Vd]
            row_in_draft = target_top1_in_draft[:, step + 1 :][rows]  # [N]
            cross_entropy = -(row_target_probs * log_probs).sum(-1)  # [N]
            kept_count = row_in_draft.sum()
            step_loss = (cross_entropy * row_in_draft).sum() / kept_count.clamp(min=1)
            loss = loss + self.decay**step * step_loss
            with torch.no_grad():
                row_target_top1 = target_top1_draft_id[:, step + 1 :][rows]  # [N], valid where row_in_draft
                row_correct = (logits.max(-1).indices == row_target_top1) & row_in_draft  # [N]
                correct = torch.zeros_like(assistant)
                correct[:, : length - step - 1][rows] = row_correct
                step_losses.append(step_loss.detach())
                step_correct.append(row_correct.sum())
                step_counts.append(kept_count)
                chain_attempted.append((chain_alive & assistant).sum())
                chain_alive = chain_alive & correct
                chain_accepted.append(chain_alive.sum())
            assistant = shift_left(assistant, fill=False)
        return TTTOutput(
            loss=loss,
            step_losses=torch.stack(step_losses),
            step_correct=torch.stack(step_correct),
            step_counts=torch.stack(step_counts),
            chain_accepted=torch.stack(chain_accepted),
            chain_attempted=torch.stack(chain_attempted),
        )


__all__ = ["TTTOutput", "TrainingTimeTest", "shift_left", "ttt_attention", "windowed_causal_mask"]
