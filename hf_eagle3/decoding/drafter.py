"""Runs the EAGLE-3 draft model during one `generate` call: its KV cache, the root state, and tree expansion."""

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from ..configuration_eagle3 import MAX_TREE_DEPTH, MAX_TREE_TOKENS
from ..modeling_eagle3 import Eagle3DraftModel
from ..utils.transformers_api import crop_cache
from .ngram import merge_continuation
from .static_draft import StaticDraft, padded, spanning
from .tree import DraftTree, build_tree, expand, select_frontier
from .verify import sample


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
    """What one drafting cycle hands to verification, for every row of the batch.

    `tree` holds the candidates. For a sampled chain, `sampled[., i]` says whether node `i` was drawn from the draft's
    distribution `draft_probs[., i]` (`[b, N + 1, V_d]`, over the draft vocabulary; rows of other nodes are unused);
    both are `None` when every node is a deterministic candidate (top-k children, context continuations).
    `continuation_nodes` `[b, M]` are the nodes holding the context continuation's tokens merged into the tree
    (`ngram.merge_continuation`), in continuation order, 0 (the root) where the tree does not hold the token; `[b, 0]`
    without continuations.
    """

    tree: DraftTree
    draft_probs: torch.Tensor | None
    sampled: torch.Tensor | None
    continuation_nodes: torch.Tensor

    def select(self, rows: torch.Tensor) -> "DraftProposal":
        """The proposal of the rows `rows` (`[b']` indices)."""
        return DraftProposal(self.tree.select(rows), None if self.draft_probs is None else self.draft_probs[rows],
                             None if self.sampled is None else self.sampled[rows], self.continuation_nodes[rows])


def max_candidates(depth: int, top_k: int) -> int:
    """Candidates a tree expansion of `depth` levels drafts: `top_k` children of the root, then `top_k` children of
    each of the `top_k` frontier nodes per further level."""
    return top_k + (depth - 1) * top_k * top_k


def _sampled_chain_proposal(tree: DraftTree, drafted: torch.Tensor, continuation_nodes: torch.Tensor) -> DraftProposal:
    """The proposal of sampled chains: `drafted` `[b, depth, V_d]` holds the distribution each depth's chain
    candidate was drawn from (the chain's candidates come first, one per depth)."""
    node_candidates = torch.cat([tree.candidate_ids.new_zeros(tree.candidate_ids.shape[0], 1), tree.candidate_ids], -1)
    sampled = node_candidates < drafted.shape[1]
    sampled[:, 0] = False  # the root
    index = node_candidates.clamp_max(drafted.shape[1] - 1)[..., None].expand(-1, -1, drafted.shape[-1])
    return DraftProposal(tree, drafted.gather(1, index), sampled, continuation_nodes)  # [b, N + 1, V_d]


class Eagle3Drafter:
    """Drafts the trees of a batch of sequences, one draft forward per tree level for all rows.

    The draft's cache holds, for every row, one entry per position verified and fed so far, then the speculative
    entries of the current cycle's tree expansion, which `extend` drops before feeding newly verified positions. Rows
    feed different numbers of positions per cycle: the cache grows by the most any row fed, and `visible` (`[b, P]`)
    hides the entries a row did not fill, as the target's cache does in the decoding loop.

    With `sampling_temperature` set and `top_k == 1`, each chain is sampled from the draft's distributions (returned
    with the tree for `verify`); otherwise candidates are the draft's top-k. With `static` (a call whose forwards are
    compiled), the cache is static and the forwards keep fixed shapes (`static_draft`).
    """

    def __init__(self, draft: Eagle3DraftModel, settings: TreeSettings, sampling_temperature: float | None = None,
                 static: StaticDraft | None = None):
        self.draft = draft
        self.settings = settings
        self.sample_chain = sampling_temperature is not None and settings.top_k == 1
        self.temperature = sampling_temperature
        self.static = static
        self.cache = DynamicCache() if static is None else static.cache(draft)
        self.cached = 0  # entries the cache holds (its write position), kept on the host
        self.visible: torch.Tensor | None = None  # [b, P] bool: the cache entries of verified positions a row filled
        self.draft_to_target = draft.draft_to_target  # [V_d]
        self.root_hidden: torch.Tensor | None = None  # [b, 1, k] draft output at each row's last verified position
        self.root_logits: torch.Tensor | None = None  # [b, V_d] draft logits for the token after each row's root

    @property
    def num_verified(self) -> int:
        return 0 if self.visible is None else self.visible.shape[1]

    def extend(self, next_tokens: torch.Tensor, target_features: torch.Tensor, positions: torch.Tensor,
               fed: torch.Tensor) -> None:
        """Feed verified positions: `next_tokens` `[b, m]` (the token after each position), the target's features
        `[b, m, 3 k_t]`, their positions `[b, m]` and which of them each row feeds (`fed` `[b, m]` bool; a row's
        last fed position becomes its root). With `static`, a cycle's positions are fed padded to `static.width`."""
        self._rewind()
        forward, length = self.draft, fed.shape[1]
        visible = fed if self.visible is None else torch.cat([self.visible, fed], dim=1)
        keys = visible  # [b, P + m]: the entries the fed positions see, before the causal mask
        if self.static is not None and length <= self.static.width:  # the captured shape (not the prompt's)
            forward, length = self.static.forward, self.static.width
            next_tokens, target_features, positions, fed = (padded(tensor, length) for tensor in
                                                            (next_tokens, target_features, positions, fed))
            keys = padded(visible, self.num_verified + length)
        causal = torch.ones(length, length, dtype=torch.bool, device=fed.device).tril()
        mask = keys[:, None, :].expand(-1, length, -1).clone()  # [b, m, P + m]
        mask[:, :, -length:] &= causal
        output = forward(input_ids=next_tokens, hidden_states=target_features.to(self.draft.dtype),
                         position_ids=positions, attention_mask=self._spanning(mask[:, None]), cache=self.cache,
                         logits_to_keep=positions.new_empty(0))  # only the roots' logits, below
        self.cached += length
        self.visible = visible
        offsets = torch.arange(length, device=fed.device)
        last = torch.where(fed, offsets, -1).max(-1).values  # [b]
        hidden = output.hidden_states
        self.root_hidden = hidden.gather(1, last[:, None, None].expand(-1, 1, hidden.shape[-1]))
        self.root_logits = self.draft.compute_logits(self.root_hidden)[:, 0]

    def select(self, rows: torch.Tensor) -> None:
        """Keep the rows `rows` (`[b']` indices) only."""
        self.cache.batch_select_indices(rows)
        self.visible, self.root_hidden, self.root_logits = self.visible[rows], self.root_hidden[rows], \
            self.root_logits[rows]

    def draft_tree(self, root_tokens: torch.Tensor, root_positions: torch.Tensor,
                   continuation: torch.Tensor | None = None,
                   continuation_log_rates: torch.Tensor | None = None) -> DraftProposal:
        """Expand `settings.depth` levels below each row's root (`root_tokens` `[b]`, the last token the target
        produced, at `root_positions` `[b]`), merge the context `continuation` (`[b, M]` target ids, -1 past a row's
        end, with `[b, M]` log acceptance rates of their positions) into the candidates, and keep each row's best
        `settings.total_tokens` of them."""
        top_k, device = self.settings.top_k, self.root_logits.device
        batch, forward = root_tokens.shape[0], self.draft if self.static is None else self.static.forward
        self._rewind()
        scores, draft_ids, probs = self._children(self.root_logits[:, None], root_tokens.new_zeros(batch, 1).float(),
                                                  top_k)  # [b, 1, k]
        candidate_tokens, candidate_scores = [draft_ids[:, 0]], [scores[:, 0]]  # [b, k] each
        candidate_parents = [torch.full((batch, top_k), -1, device=device)]
        candidate_depths = [torch.ones(batch, top_k, dtype=torch.long, device=device)]
        sampled_probs = [probs]

        frontier = torch.arange(top_k, device=device).expand(batch, -1)  # candidate indices of the frontier
        frontier_scores, frontier_ids = scores[:, 0], draft_ids[:, 0]
        frontier_hidden = self.root_hidden.expand(-1, top_k, -1)  # [b, k, hidden]: output before each node
        eye = torch.eye(top_k, dtype=torch.bool, device=device).expand(batch, -1, -1)
        ancestry = eye[:, :, :0]  # [b, k, speculative cache entries]: which of them each frontier node descends from
        num_candidates = top_k
        for depth in range(2, self.settings.depth + 1):
            visible = torch.cat([self.visible[:, None, :].expand(-1, top_k, -1), ancestry, eye], dim=-1)
            output = forward(
                input_ids=self.draft_to_target[frontier_ids], hidden_states=frontier_hidden,
                position_ids=(root_positions + depth - 2)[:, None].expand(-1, top_k),
                attention_mask=self._spanning(visible[:, None]), cache=self.cache,
            )
            self.cached += top_k
            child_scores, child_ids, probs = self._children(output.logits, frontier_scores, top_k)  # [b, k, k]
            candidate_tokens.append(child_ids.flatten(1))
            candidate_scores.append(child_scores.flatten(1))
            candidate_parents.append(frontier.repeat_interleave(top_k, dim=1))
            candidate_depths.append(torch.full((batch, top_k * top_k), depth, device=device))
            sampled_probs.append(probs)

            best = select_frontier(child_scores, top_k)  # [b, k] flat indices into [k, k]
            parent_slots = best // top_k
            frontier = num_candidates + best
            num_candidates += top_k * top_k
            frontier_scores = child_scores.flatten(1).gather(1, best)
            frontier_ids = child_ids.flatten(1).gather(1, best)
            frontier_hidden = output.hidden_states.gather(1, parent_slots[..., None].expand(-1, -1,
                                                                                              frontier_hidden.shape[-1]))
            ancestry = torch.cat([ancestry, eye], dim=-1)
            ancestry = ancestry.gather(1, parent_slots[..., None].expand(-1, -1, ancestry.shape[-1]))

        tokens = self.draft_to_target[torch.cat(candidate_tokens, dim=1)]
        scores, parents = torch.cat(candidate_scores, dim=1), torch.cat(candidate_parents, dim=1)
        depths, max_depth = torch.cat(candidate_depths, dim=1), self.settings.depth
        chain = parents[:, :0]
        if continuation is not None:
            tokens, scores, parents, depths, chain = merge_continuation(
                tokens, scores, parents, depths, continuation, continuation_log_rates
            )
            max_depth = max(max_depth, continuation.shape[1])
        tree = build_tree(root_tokens, tokens, scores, parents, depths, self.settings.total_tokens, max_depth)
        kept = tree.candidate_ids[:, None, :] == chain[:, :, None]  # [b, M, N]: continuation token j is node i + 1
        continuation_nodes = torch.where(kept.any(-1), kept.int().argmax(-1) + 1, 0)
        if not self.sample_chain:
            return DraftProposal(tree, None, None, continuation_nodes)
        return _sampled_chain_proposal(tree, torch.stack(sampled_probs, dim=1), continuation_nodes)

    def _rewind(self) -> None:
        """Move the cache's write position back to the verified entries: past them it holds the last tree's entries
        or a feed's padding, which the next forward overwrites (a static cache) or which are dropped (a dynamic one)."""
        if self.cached > self.num_verified:
            crop_cache(self.cache, self.num_verified - self.cached)
            self.cached = self.num_verified

    def _spanning(self, mask: torch.Tensor) -> torch.Tensor:
        """`mask` over every entry of a static cache; a dynamic cache's as it is."""
        return mask if self.static is None else spanning(mask, self.static.length)

    def _children(
        self, logits: torch.Tensor, frontier_scores: torch.Tensor, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Scores and draft ids `[b, F, top_k]` of the children of each frontier node, from its logits
        `[b, F, V_d]`; for a sampled chain also the distribution `[b, V_d]` the child was drawn from."""
        if not self.sample_chain:
            return *expand(logits.float().log_softmax(-1), frontier_scores, top_k), None
        probs = (logits[:, 0].float() / self.temperature).softmax(-1)  # [b, V_d]
        draft_ids = sample(probs)[:, None]  # [b, 1]
        return frontier_scores[..., None] + probs.gather(-1, draft_ids).log()[:, None], draft_ids[:, None], probs
