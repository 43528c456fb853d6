"""The loss of one training-time-test step: KL, or an LK loss aimed at the acceptance rate (arXiv:2602.23881).

Each kept row `n` of a step has the target's distribution `p_n` over the draft vocabulary and the draft's `q_n`. The
draft's token is accepted by speculative sampling with probability `α_n = Σ_v min(p_n(v), q_n(v))` (one minus their
total-variation distance), so the acceptance rate is what the LK losses train for:

    kl         mean_n CE(p_n, q_n)                        (KL(p || q) plus p's entropy: the same gradient)
    lk         λ · mean_n CE(p_n, q_n) + (1 - λ) · (1 - ᾱ), λ = exp(-decay · sg[ᾱ]), ᾱ = mean_n α_n
    lk-alpha   -mean_n log α_n

`lk` (the paper's LK^λ) leans on KL while the draft is poor (ᾱ small, λ near 1) and on the acceptance rate as it
improves; `lk-alpha` is the acceptance rate's likelihood alone. SpecForge calls them `--lk-loss-type lambda` (with
`--kl-scale 1 --kl-decay 3` by default) and `alpha`. The target's distribution is the one the KL uses: renormalised
over the draft vocabulary, on rows whose target top-1 the draft can propose.
"""

import torch

LOSSES = ("kl", "lk", "lk-alpha")
LK_DECAY = 3.0  # λ = exp(-3 ᾱ): SpecForge's default --kl-decay


def row_terms(logits: torch.Tensor, target_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(soft cross-entropy `[N]`, acceptance probability `α` `[N]`) of the draft's `logits` `[N, Vd]` against the
    target's `target_probs` `[N, Vd]` (float32)."""
    log_probs = logits.log_softmax(-1, dtype=torch.float32)
    cross_entropy = -(target_probs * log_probs).sum(-1)
    acceptance = torch.minimum(target_probs, log_probs.exp()).sum(-1)
    return cross_entropy, acceptance


def step_loss(loss: str, cross_entropy: torch.Tensor, acceptance: torch.Tensor, kept: torch.Tensor,
              decay: float = LK_DECAY) -> torch.Tensor:
    """The step's loss (a scalar) under `loss` (one of `LOSSES`), averaged over the rows where `kept` `[N]` is set."""
    count = kept.sum().clamp(min=1)

    def mean(values: torch.Tensor) -> torch.Tensor:
        return (values * kept).sum() / count

    if loss == "kl":
        return mean(cross_entropy)
    if loss == "lk":
        mean_acceptance = mean(acceptance)
        weight = torch.exp(-decay * mean_acceptance.detach())
        return weight * mean(cross_entropy) + (1 - weight) * (1 - mean_acceptance)
    if loss == "lk-alpha":
        return -mean(acceptance.clamp(min=torch.finfo(acceptance.dtype).tiny).log())
    raise ValueError(f"Unknown loss {loss!r}: use one of {', '.join(LOSSES)}.")


__all__ = ["LK_DECAY", "LOSSES", "row_terms", "step_loss"]
