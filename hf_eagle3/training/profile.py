"""A draft's acceptance profile: τ of every tree shape up to a size (`Eagle3Config.acceptance_profile`), measured
in one greedy run per top-k.

τ for every `D <= D_max` and `N <= N_max` of one `K` comes from a single
greedy run with the largest tree. Frontiers do not depend on `D` or `N`, so a smaller tree holds the `N` best of the
largest tree's candidates of depth <= `D`. Greedy verification accepts the one path of the target's argmax tokens,
so the smaller tree accepts that path up to the first node it lacks. The smaller trees are evaluated at the largest
tree's cycle starts, which makes their τ an estimate (a close one) rather than what their own run would measure.
"""

import torch

from ..decoding.drafter import max_candidates
from ..modeling_eagle3 import Eagle3DraftModel

# The shapes an acceptance profile covers by default (`tune-tree`, and the trainer's final draft): up to the official
# EAGLE-3 tree and past it (depth 8, top-k 10, 128 tokens), which a GPU verifies at about a decode step's cost, though a
# CPU's calibration never picks them. One greedy run per top-k gives every depth and size of it, so four top-ks keep
# the profile at four runs; its largest trees make each run's cycles dearer on a CPU, and fewer of them.
PROFILE_TOP_KS, PROFILE_MAX_DEPTH, PROFILE_MAX_TOTAL, PROFILE_NEW_TOKENS = (1, 2, 4, 10), 8, 128, 96
TOTAL_TOKENS_GRID = (1, 2, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128)


def accepted_in_smaller_trees(
    rank_keys: torch.Tensor,
    candidate_depths: torch.Tensor,
    accepted: torch.Tensor,
    depths: torch.Tensor,
    totals: torch.Tensor,
) -> torch.Tensor:
    """Drafted tokens that trees of depth `depths[a]` and `totals[b]` nodes would have accepted in one greedy cycle.

    Args:
        rank_keys: `[C]` the cycle's candidate ranking (`DraftTree.candidate_rank_keys`; a tree keeps the highest).
        candidate_depths: `[C]` the draft depth that holds every candidate: its depth, or 0 for a context
            continuation's own candidates, which trees of every depth hold (`ngram`).
        accepted: `[L]` candidate indices of the drafted tokens the largest tree accepted, root's child first.
        depths: `[A]` depths to evaluate, each <= the largest tree's.
        totals: `[B]` tree sizes to evaluate, each <= the largest tree's.
    Returns:
        `[A, B]` accepted drafted tokens (the bonus token not counted).
    """
    outranked_by = rank_keys[None, :] > rank_keys[accepted][:, None]  # [L, C]
    within_depth = candidate_depths[None, :] <= depths[:, None]  # [A, C]
    rank = (outranked_by[None] & within_depth[:, None]).sum(-1)  # [A, L]: rank among candidates of depth <= D
    path_within_depth = candidate_depths[accepted][None, :, None] <= depths[:, None, None]  # [A, L, 1]
    kept = (rank[:, :, None] < totals[None, None, :]) & path_within_depth
    return kept.long().cumprod(dim=1).sum(dim=1)  # the path is accepted up to its first missing node


def acceptance_profile(
    target, draft: Eagle3DraftModel, prompts: list[torch.Tensor], top_ks: list[int], max_depth: int, max_total: int,
    max_new_tokens: int = 128, progress: bool = True, ngram_candidates: bool | None = None,
    prompt_sets: list[str] | None = None,
) -> list[dict]:
    """τ of every tree shape up to `max_depth` x `max_total` for each top-k in `top_ks`, from one greedy run per
    top-k with its largest tree over `prompts`: rows `{"tree_depth", "tree_top_k", "tree_total_tokens", "tau"}`
    (`Eagle3Config.acceptance_profile`), with `"ngram_candidates": True` for trees holding context continuations
    (`ngram_candidates`, by default the draft's setting; the smaller trees take the continuations' acceptance rates
    from the largest tree's run). Shapes with more nodes than their
    depth has candidates are left out (the same tree as a smaller size). `prompt_sets` names the set of each prompt
    (`"mt-bench"`, `"humaneval"`, ...): where it names two or more, every row also holds each set's median over its
    prompts of their τ (`"tau_by_set"`): a typical prompt's, which is what the median over calls of their speedups
    reads, for predictions per kind of prompt. (`"tau"` pools every cycle: the long-run rate `tree_shape="auto"`
    chooses by; the few prompts whose answers a context continuation copies reach two or three times the others' τ
    and pull it above a typical prompt's.)"""
    from tqdm.auto import tqdm

    if ngram_candidates is None:
        ngram_candidates = draft.config.ngram_candidates
    if prompt_sets is not None and len(prompt_sets) != len(prompts):
        raise ValueError(f"prompt_sets names {len(prompt_sets)} prompts' sets for {len(prompts)} prompts: give one "
                         "set name per prompt.")
    labels = prompt_sets if prompt_sets is not None and len(set(prompt_sets)) > 1 else [None] * len(prompts)
    sets = list(dict.fromkeys(labels))
    depths = list(range(1, max_depth + 1))
    rows = []
    for top_k in top_ks:
        largest = min(max_total, max_candidates(max_depth, top_k))  # can't keep more than the candidates
        totals = sorted({n for n in TOTAL_TOKENS_GRID if n < largest} | {largest})
        accepted = torch.zeros(len(prompts), len(depths), len(totals), dtype=torch.long)  # per prompt and shape
        cycles = torch.zeros(len(prompts), dtype=torch.long)
        for prompt, input_ids in enumerate(tqdm(prompts, desc=f"acceptance profile, top-k {top_k}",
                                                disable=not progress)):
            stats = target.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=draft,
                                    tree_depth=max_depth, tree_top_k=top_k, tree_total_tokens=largest,
                                    ngram_candidates=ngram_candidates, record_greedy_cycles=True,
                                    return_dict_in_generate=True).eagle3_stats
            drafted = max_candidates(max_depth, top_k)  # candidates after these are a continuation's own
            for (tree, path), emitted in zip(stats.greedy_cycles, stats.acceptance_lengths):
                holding_depths = tree.candidate_depths.clone()
                holding_depths[drafted:] = 0
                accepted[prompt] += accepted_in_smaller_trees(
                    tree.candidate_rank_keys, holding_depths, tree.candidate_ids[path[1:] - 1],
                    torch.tensor(depths, device=path.device), torch.tensor(totals, device=path.device),
                ).cpu().clamp_max(emitted - 1)  # a cycle cut by max_new_tokens or a stop emits fewer
            cycles[prompt] = stats.num_cycles
        taus = 1 + accepted.sum(0).double() / max(int(cycles.sum()), 1)
        prompt_taus = 1 + accepted.double() / cycles.clamp_min(1).double()[:, None, None]
        set_taus = {name: prompt_taus[torch.tensor([label == name for label in labels])].quantile(0.5, dim=0)
                    for name in sets if name}
        for depth in depths:
            for index, total in enumerate(totals):
                if total <= max_candidates(depth, top_k):
                    rows.append({"tree_depth": depth, "tree_top_k": top_k, "tree_total_tokens": total,
                                 "tau": round(float(taus[depth - 1, index]), 4),
                                 "prompts": len(prompts), "cycles": int(cycles.sum())}
                                | ({"ngram_candidates": True} if ngram_candidates else {})
                                | ({"tau_by_set": {name: round(float(set_tau[depth - 1, index]), 4)
                                                   for name, set_tau in set_taus.items()}} if set_taus else {}))
    return rows
