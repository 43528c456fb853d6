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
the draft's (or an LK loss on the same distributions, `losses.py`), averaged over the kept positions and weighted
`decay ** s` (official: 7 steps, 0.8). A position is kept
when its predicted token `t_{i+s+2}` is an assistant token of the conversation (`loss_mask`) and the target's top-1
there lies inside the draft vocabulary (the draft can never propose it otherwise). Positions past the end of the
sequence are dropped. (The official code leaves `loss_mask` unshifted before step 0, masking by `t_{i+s}` instead of
the predicted token `t_{i+s+2}`; we mask by the predicted token.)

Memory. The keys of the simulated steps only ever meet the query of their own row, so a step's attention is the
causal prefix plus one diagonal per earlier step: `scaled_dot_product_attention` over chunks of rows under that mask
(`ttt_attention`), which a fused kernel (flash attention on CPUs) runs without keeping scores for backward. Each step,
and each step's logits and loss, is checkpointed: backward keeps a step's inputs, keys and values, and recomputes the
rest one step at a time. The target's distributions come from its final hidden states a chunk of positions at a time,
restricted to the draft vocabulary (`target_distribution`): no full-vocabulary logits for the whole batch.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..modeling_eagle3 import Eagle3DraftModel
from .losses import LOSSES, row_terms, step_loss


def shift_left(tensor: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
    """`tensor[:, i] <- tensor[:, i + 1]` along dim 1, the last position filled with `fill`."""
    return torch.cat([tensor[:, 1:], torch.full_like(tensor[:, :1], fill)], dim=1)


def ttt_attention(
    query: torch.Tensor,  # [B, H, T, D], step s (rotated)
    keys: list[torch.Tensor],  # s + 1 tensors [B, KV, T, D]: keys[0] from the native step, keys[j] from step j
    values: list[torch.Tensor],  # same layout as keys
    scaling: float,
    window: int | None = None,  # a sliding-window layer's window
    chunk_rows: int = 256,
) -> torch.Tensor:
    """Attention of step `s = len(keys) - 1` under the Figure-6 mask, output `[B, T, H * D]`.

    Row `i` attends to `keys[0][:, :, :i+1]` (the real prefix; in a sliding-window layer only the keys at positions
    `j > i + s - window`) and to `keys[j][:, :, i]` for `j = 1 .. s` (its own drafted chain). Rows are taken
    `chunk_rows` at a time through `scaled_dot_product_attention`: a chunk's query meets the prefix keys up to its last
    row and the chunk's own `s * chunk_rows` chain keys, under a boolean mask (causal, then one diagonal per step).
    Nothing of size `T x T` is built, and a fused kernel (flash attention on CPUs) keeps no scores for backward.
    """
    batch_size, num_heads, length, head_dim = query.shape
    steps = len(keys) - 1
    outputs = []
    for start in range(0, length, chunk_rows):
        end = min(start + chunk_rows, length)
        rows = torch.arange(start, end, device=query.device)[:, None]
        columns = torch.arange(end, device=query.device)[None]
        prefix = (columns <= rows) & (columns > rows + steps - window if window is not None else True)
        chain = torch.eye(end - start, dtype=torch.bool, device=query.device).repeat(1, steps)  # [C, s * C]
        chunk_keys = torch.cat([keys[0][:, :, :end], *(key[:, :, start:end] for key in keys[1:])], dim=2)
        chunk_values = torch.cat([values[0][:, :, :end], *(value[:, :, start:end] for value in values[1:])], dim=2)
        outputs.append(F.scaled_dot_product_attention(
            query[:, :, start:end], chunk_keys, chunk_values, attn_mask=torch.cat([prefix, chain], dim=1),
            scale=scaling, enable_gqa=True,
        ))
    return torch.cat(outputs, dim=2).transpose(1, 2).reshape(batch_size, length, num_heads * head_dim)


@torch.no_grad()
def target_distribution(
    final_hidden: torch.Tensor, lm_head: nn.Module, draft_to_target: torch.Tensor, chunk_tokens: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's view of every position `j` of a batch: (its distribution of `t_{j+1}` renormalised over the draft
    vocabulary, float32 `[B, T, Vd]`; its top-1 token, a target id `[B, T]`).

    `final_hidden` `[B, T, k_t]` is the target's final hidden state and `lm_head` its output layer (or `final_hidden`
    the logits themselves and `lm_head` an `nn.Identity`). Logits are made `chunk_tokens` positions at a time and
    only their draft-vocabulary columns are kept: no full-vocabulary logits for the whole batch, in float32 or not.
    (`max(-1).indices` rather than `argmax`: the same index, several times faster on CPU.)
    """
    probs, top1 = [], []
    for hidden in final_hidden.flatten(0, 1).split(chunk_tokens):
        logits = lm_head(hidden)  # [C, V]
        probs.append(logits[:, draft_to_target].softmax(-1, dtype=torch.float32))
        top1.append(logits.max(-1).indices)
    return torch.cat(probs).unflatten(0, final_hidden.shape[:2]), torch.cat(top1).unflatten(0, final_hidden.shape[:2])


@dataclass
class TTTOutput:
    """Result of one training-time-test forward; every tensor but `loss` is detached and has shape `[S]`.

    Args:
        loss: sum over steps of `decay ** s` times the step's loss (a scalar with grad).
        step_losses: the loss of each step (soft cross-entropy, or the LK loss), averaged over its kept positions.
        step_correct / step_counts: kept positions where the draft's top-1 is the target's top-1 / all kept positions.
        step_acceptance: the sum over kept positions of the probability `α` that speculative sampling accepts the
            draft's token (`losses.row_terms`); over `step_counts`, the step's expected acceptance rate.
        chain_accepted / chain_attempted: greedy chain acceptance. `chain_attempted[s]` counts the rows whose step-s
            token is an assistant token and whose drafts at steps `0 .. s-1` all matched the target's top-1;
            `chain_accepted[s]` those among them whose step-s draft matches too. Their ratio is s-α.
    """

    loss: torch.Tensor
    step_losses: torch.Tensor
    step_correct: torch.Tensor
    step_counts: torch.Tensor
    step_acceptance: torch.Tensor
    chain_accepted: torch.Tensor
    chain_attempted: torch.Tensor


class TrainingTimeTest(nn.Module):
    """The draft plus its TTT loss, as one module (so `accelerate` / DDP can wrap it).

    `forward(input_ids, target_features, target_probs, target_top1, loss_mask)` unrolls `steps` draft steps over a
    batch and returns a `TTTOutput`. The target's work (its hidden states and distributions) is done by the caller, so
    features can come from an online target forward or from disk. `loss` is one of `losses.LOSSES`.
    """

    def __init__(self, draft: Eagle3DraftModel, steps: int = 7, decay: float = 0.8, loss: str = "kl"):
        super().__init__()
        if steps < 1:
            raise ValueError(f"The number of training-time-test steps must be >= 1, got {steps}.")
        if loss not in LOSSES:
            raise ValueError(f"Unknown loss {loss!r}: use one of {', '.join(LOSSES)}.")
        window = draft.config.sliding_window
        if window is not None and "sliding_attention" in (draft.config.layer_types or []) and steps >= window:
            raise ValueError(
                f"The draft's sliding window ({window}) must be longer than the training-time-test steps ({steps})."
            )
        self.draft = draft
        self.steps = steps
        self.decay = decay
        self.loss = loss

    def unroll(self, input_ids: torch.LongTensor, target_features: torch.Tensor) -> Iterator[torch.Tensor]:
        """The draft's output features `a^s` `[B, T, k]` of steps `s = 0 .. steps-1`, one step per iteration.

        `input_ids` `[B, T]` are the ground-truth tokens, `target_features` `[B, T, 3 k_t]` the target's hidden
        states at `target_layer_ids` concatenated. Row `i` of step `s` is the draft's prediction of `t_{i+s+2}`.
        Each step is checkpointed: backward keeps its inputs, keys and values, and recomputes the rest.
        """
        draft = self.draft
        draft.check_target_attached()  # a head or embedding still the draft's random one would train silently
        batch_size, length = input_ids.shape
        tokens = shift_left(input_ids)  # t_{i+1}
        features = draft.fuse(target_features)  # g, [B, T, k]
        positions = torch.arange(length, device=input_ids.device)[None].expand(batch_size, -1)
        # Per decoder layer, the keys / values of the steps so far: tuples, made anew at each step, so that a step's
        # recomputation for backward sees the keys it saw.
        keys = values = [() for _ in draft.decoder_layers]
        for step in range(self.steps):
            features, step_keys, step_values = checkpoint(
                self.draft_step, tokens, features, positions + step, keys, values, use_reentrant=False
            )
            keys = [(*layer_keys, key) for layer_keys, key in zip(keys, step_keys)]
            values = [(*layer_values, value) for layer_values, value in zip(values, step_values)]
            yield features
            # Next step: same rows, one position further on; the feature a^s stays in its row and feeds back.
            tokens = shift_left(tokens)

    def draft_step(
        self, tokens: torch.LongTensor, features: torch.Tensor, positions: torch.LongTensor,
        keys: list[tuple[torch.Tensor, ...]], values: list[tuple[torch.Tensor, ...]],
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """One draft step over every row: (`a^s` `[B, T, k]`, each decoder layer's new keys, its new values), from
        the step's tokens, its input features and the keys / values of the earlier steps (left unchanged)."""
        draft = self.draft
        embeds = draft.embed_tokens(tokens).to(features.dtype)
        position_embeddings = draft.rotary_emb(features, positions)
        step_keys, step_values = [], []
        for layer, layer_keys, layer_values in zip(draft.decoder_layers, keys, values):
            attention = layer.self_attn
            attn_input, residual = layer.attention_input(embeds, features)  # [B, T, 2k | k], [B, T, k]
            query, key, value = attention.project(attn_input, position_embeddings)
            step_keys.append(key)
            step_values.append(value)
            attn_output = ttt_attention(query, [*layer_keys, key], [*layer_values, value], attention.scaling,
                                        attention.sliding_window)
            features = layer.finish(residual, attention.o_proj(attn_output))  # [B, T, k]
        return draft.output_feature(features), step_keys, step_values

    def head_terms(self, features: torch.Tensor, target_probs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(soft cross-entropy `[N]` and acceptance probability `[N]` of the draft's distribution at `features`
        `[N, k]` against `target_probs` `[N, Vd]`, the draft's top-1 draft id `[N]`)."""
        logits = self.draft.compute_logits(features)  # [N, Vd]
        return *row_terms(logits, target_probs), logits.detach().max(-1).indices

    def forward(
        self,
        input_ids: torch.LongTensor,  # [B, T]
        target_features: torch.Tensor,  # [B, T, 3 k_t]: target hidden states at target_layer_ids, concatenated
        target_probs: torch.Tensor,  # [B, T, Vd] float32: the target's distributions over the draft vocabulary
        target_top1: torch.LongTensor,  # [B, T]: the target's top-1 tokens (target ids); see `target_distribution`
        loss_mask: torch.Tensor,  # [B, T]: 1 where the token is an assistant token (0 on padding)
    ) -> TTTOutput:
        draft = self.draft
        length = input_ids.shape[1]
        # Row i at step s is scored against the target's view of position j = i + s + 1.
        draft_to_target = draft.draft_to_target  # sorted target ids
        target_top1_in_draft = draft.t2d[target_top1]  # [B, T]
        target_top1_draft_id = torch.searchsorted(draft_to_target, target_top1).clamp(max=len(draft_to_target) - 1)
        assistant = shift_left(shift_left(loss_mask.bool(), fill=False), fill=False)  # t_{i+2} is an assistant token

        loss = target_probs.new_zeros(())
        step_losses, step_correct, step_counts, step_acceptance = [], [], [], []
        chain_accepted, chain_attempted = [], []
        chain_alive = torch.ones_like(assistant)  # every earlier draft of the row matched the target's top-1
        for step, features in enumerate(self.unroll(input_ids, target_features)):
            # Logits only where they are scored: rows whose predicted token is an assistant token.
            rows = assistant[:, : length - step - 1]  # rows past T - step - 2 have no target
            row_in_draft = target_top1_in_draft[:, step + 1 :][rows]  # [N]
            cross_entropy, acceptance, draft_top1 = checkpoint(  # [N] each: the logits are recomputed for backward
                self.head_terms, features[:, : length - step - 1][rows], target_probs[:, step + 1 :][rows],
                use_reentrant=False,
            )
            this_step = step_loss(self.loss, cross_entropy, acceptance, row_in_draft)
            loss = loss + self.decay**step * this_step
            with torch.no_grad():
                row_target_top1 = target_top1_draft_id[:, step + 1 :][rows]  # [N], valid where row_in_draft
                row_correct = (draft_top1 == row_target_top1) & row_in_draft  # [N]
                correct = torch.zeros_like(assistant)
                correct[:, : length - step - 1][rows] = row_correct
                step_losses.append(this_step.detach())
                step_correct.append(row_correct.sum())
                step_counts.append(row_in_draft.sum())
                step_acceptance.append((acceptance * row_in_draft).sum())
                chain_attempted.append((chain_alive & assistant).sum())
                chain_alive = chain_alive & correct
                chain_accepted.append(chain_alive.sum())
            assistant = shift_left(assistant, fill=False)
        return TTTOutput(
            loss=loss,
            step_losses=torch.stack(step_losses),
            step_correct=torch.stack(step_correct),
            step_counts=torch.stack(step_counts),
            step_acceptance=torch.stack(step_acceptance),
            chain_accepted=torch.stack(chain_accepted),
            chain_attempted=torch.stack(chain_attempted),
        )


__all__ = ["TTTOutput", "TrainingTimeTest", "shift_left", "target_distribution", "ttt_attention"]
