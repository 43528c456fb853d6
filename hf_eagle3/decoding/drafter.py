"""Runs the EAGLE-3 draft model during one `generate` call: its KV cache, the root state, and tree expansion."""

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from ..configuration_eagle3 import MAX_TREE_DEPTH, MAX_TREE_TOKENS
from ..modeling_eagle3 import Eagle3DraftModel
from .ngram import merge_continuation
from .tree import DraftTree, build_tree, expand, select_frontier


@dataclass(frozen=True)
class TreeSettings:
    """Shape of the EAGLE-2 draft tree: `depth` expansion steps, `top_k` children per frontier node and a frontier
    of `top_k` nodes, `total_tokens` drafted nodes verified per cycle. `top_k == 1` drafts a chain."""

    depth: int
    top_k: int
    total_tokens: int

    def __post_init__(self):
        for name in ("depth", "top_k", "total_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"tree_{name} must be a positive integer, got {getattr(self, name)!r}.")
        if self.depth > MAX_TREE_DEPTH or self.total_tokens > MAX_TREE_TOKENS:
            raise ValueError(f"A tree of depth {self.depth} and {self.total_tokens} tokens is past what one cycle "
                             f"verifies (at most depth {MAX_TREE_DEPTH}, {MAX_TREE_TOKENS} tokens): use a smaller "
                             "tree_depth / tree_total_tokens.")
        candidates = max_candidates(self.depth, self.top_k)
        if self.total_tokens > candidates:
            raise ValueError(
                f"tree_total_tokens={self.total_tokens} exceeds the {candidates} candidates a tree of depth "
                f"{self.depth} and top-k {self.top_k} drafts: lower tree_total_tokens, or raise tree_depth / "
                "tree_top_k."
            )


@dataclass
class DraftProposal:
    """What one drafting cycle hands to verification.

    `tree` holds the candidates. For a sampled chain, `sampled[i]` says whether node `i` was drawn from the draft's
    distribution `draft_probs[i]` (`[N + 1, V_d]`, over the draft vocabulary; rows of other nodes are unused); both
    are `None` when every node is a deterministic candidate (top-k children, context continuations).
    `continuation_nodes` `[K]` are the nodes holding the first `K` tokens of the context continuation merged into the
    tree (`ngram.merge_continuation`), in continuation order; empty without one.
    """

    tree: DraftTree
    draft_probs: torch.Tensor | None
    sampled: torch.Tensor | None
    continuation_nodes: torch.Tensor


def max_candidates(depth: int, top_k: int) -> int:
    """Candidates a tree expansion of `depth` levels drafts: `top_k` children of the root, then `top_k` children of
    each of the `top_k` frontier nodes per further level."""
    return top_k + (depth - 1) * top_k * top_k


def _sampled_chain_proposal(tree: DraftTree, drafted: torch.Tensor, continuation_nodes: torch.Tensor) -> DraftProposal:
    """The proposal of a sampled chain: `drafted` `[depth, V_d]` holds the distribution each depth's chain candidate
    was drawn from (the chain's candidates come first, one per depth)."""
    node_candidates = torch.cat([tree.candidate_ids.new_zeros(1), tree.candidate_ids])
    sampled = node_candidates < drafted.shape[0]
    sampled[0] = False  # the root
    draft_probs = drafted[node_candidates.clamp_max(drafted.shape[0] - 1)]  # [N + 1, V_d]
    return DraftProposal(tree, draft_probs, sampled, continuation_nodes)


class Eagle3Drafter:
    """Drafts trees for one sequence.

    The draft's cache holds one entry per *verified* position fed so far (`num_verified`), then the speculative
    entries of the current cycle's tree expansion, which `extend` drops before feeding newly verified positions.

    With `sampling_temperature` set and `top_k == 1`, the chain is sampled from the draft's distributions (returned
    with the tree for `verify`); otherwise candidates are the draft's top-k.
    """

    def __init__(self, draft: Eagle3DraftModel, settings: TreeSettings, sampling_temperature: float | None = None):
        self.draft = draft
        self.settings = settings
        self.sample_chain = sampling_temperature is not None and settings.top_k == 1
        self.temperature = sampling_temperature
        self.cache = DynamicCache()
        self.num_verified = 0
        self.draft_to_target = draft.draft_to_target  # [V_d]
        self.root_hidden: torch.Tensor | None = None  # [1, 1, k] draft output at the last verified position
        self.root_logits: torch.Tensor | None = None  # [V_d] draft logits for the token after the root

    def extend(self, next_tokens: torch.Tensor, target_features: torch.Tensor, positions: torch.Tensor) -> None:
        """Feed verified positions: `next_tokens` `[1, m]` (the token after each position), the target's features
        `[1, m, 3 k_t]` and their positions `[1, m]`."""
        self.cache.crop(self.num_verified - self.cache.get_seq_length())
        output = self.draft(
            input_ids=next_tokens,
            hidden_states=target_features.to(self.draft.dtype),
            position_ids=positions,
            cache=self.cache,
            logits_to_keep=1,
        )
        self.num_verified += next_tokens.shape[1]
        self.root_hidden = output.hidden_states[:, -1:]
        self.root_logits = output.logits[0, -1]

    def draft_tree(
        self,
        root_token: torch.Tensor,
        root_position: int,
        continuation: torch.Tensor | None = None,
        continuation_log_rates: torch.Tensor | None = None,
    ) -> DraftProposal:
        """Expand `settings.depth` levels below `root_token` (the last token the target produced, at position
        `root_position`), merge the context `continuation` (`[m]` target ids, with the `[m]` log acceptance rates
        of its positions) into the candidates, and keep the best `settings.total_tokens` of them."""
        top_k, device = self.settings.top_k, self.root_logits.device
        scores, draft_ids, probs = self._children(self.root_logits[None], torch.zeros(1, device=device), top_k)
        candidate_tokens, candidate_scores = [draft_ids[0]], [scores[0]]  # [k] each
        candidate_parents = [torch.full((top_k,), -1, device=device)]
        candidate_depths = [torch.ones(top_k, dtype=torch.long, device=device)]
        sampled_probs = [probs]

        frontier = torch.arange(top_k, device=device)  # candidate indices of the frontier
        frontier_scores, frontier_ids = scores[0], draft_ids[0]
        frontier_hidden = self.root_hidden.expand(1, top_k, -1)  # [1, k, hidden]: output before each node
        ancestry = torch.zeros(top_k, 0, dtype=torch.bool, device=device)  # frontier x speculative cache entries
        num_candidates = top_k
        for depth in range(2, self.settings.depth + 1):
            visible = torch.cat([torch.ones(top_k, self.num_verified, dtype=torch.bool, device=device), ancestry,
                                 torch.eye(top_k, dtype=torch.bool, device=device)], dim=1)
            output = self.draft(
                input_ids=self.draft_to_target[frontier_ids][None], hidden_states=frontier_hidden,
                position_ids=torch.full((1, top_k), root_position + depth - 2, device=device),
                attention_mask=visible[None, None], cache=self.cache,
            )
            child_scores, child_ids, probs = self._children(output.logits[0], frontier_scores, top_k)  # [k, k]
            candidate_tokens.append(child_ids.flatten())
            candidate_scores.append(child_scores.flatten())
            candidate_parents.append(frontier.repeat_interleave(top_k))
            candidate_depths.append(torch.full((top_k * top_k,), depth, device=device))
            sampled_probs.append(probs)

            best = select_frontier(child_scores, top_k)  # flat indices into [k, k]
            parent_slots = best // top_k
            frontier = num_candidates + best
            num_candidates += top_k * top_k
            frontier_scores, frontier_ids = child_scores.flatten()[best], child_ids.flatten()[best]
            frontier_hidden = output.hidden_states[:, parent_slots]
            ancestry = torch.cat([ancestry, torch.eye(top_k, dtype=torch.bool, device=device)], dim=1)[parent_slots]

        tokens = self.draft_to_target[torch.cat(candidate_tokens)]
        scores, parents, depths = torch.cat(candidate_scores), torch.cat(candidate_parents), torch.cat(candidate_depths)
        chain = parents[:0]
        if continuation is not None and continuation.numel():
            tokens, scores, parents, depths, chain = merge_continuation(
                tokens, scores, parents, depths, continuation, continuation_log_rates
            )
        tree = build_tree(root_token, tokens, scores, parents, depths, self.settings.total_tokens)
        kept = tree.candidate_ids[None, :] == chain[:, None]  # [m, N]: continuation token j is node i + 1
        continuation_nodes = (kept.int().argmax(-1) + 1)[kept.any(-1)]
        if not self.sample_chain:
            return DraftProposal(tree, None, None, continuation_nodes)
        return _sampled_chain_proposal(tree, torch.stack(sampled_probs), continuation_nodes)

    def _children(
        self, logits: torch.Tensor, frontier_scores: torch.Tensor, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Scores and draft ids `[F, top_k]` of the children of each frontier node, from its logits `[F, V_d]`;
        for a sampled chain also the distribution `[V_d]` the child was drawn from."""
        if not self.sample_chain:
            return *expand(logits.float().log_softmax(-1), frontier_scores, top_k), None
        probs = (logits.float() / self.temperature).softmax(-1)  # [1, V_d]
        draft_ids = torch.multinomial(probs, 1)  # [1, 1]
        return frontier_scores[:, None] + probs.gather(-1, draft_ids).log(), draft_ids, probs[0]
