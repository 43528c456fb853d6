"""Acceptance rules for verifying a draft tree against the target, as plain tensor functions.

Greedy: the accepted path is the longest root-to-node path whose every token is the target's argmax after its
parent; the target's argmax after the last accepted node is the bonus token. The output equals plain greedy decoding.

Sampling, both rules lossless (the emitted token is distributed exactly as the target's processed distribution `p`):
- `accept_among_children` (tree, deterministic top-k candidates): the children `x_1..x_m` of a node are tried in
  order; `x_i` is accepted with probability `p'(x_i)`, where `p'` is `p` with the rejected `x_1..x_{i-1}` removed and
  renormalised. If all are rejected, the bonus token is drawn from `p` without any of them. This is speculative
  sampling with each candidate's draft distribution a point mass, which is what top-k drafting really is.
- `accept_sampled` (chain whose tokens were sampled from draft distributions `q`): the standard rule, accept `x` with
  probability `min(1, p(x) / q(x))`, else draw from `normalise(max(p - q, 0))`.
- `accept_in_turn` (children of mixed origin: a sampled chain child next to a context continuation's token): the
  children are tried in order, each by the rule of its own proposal (`q`, or a point mass), each against what is left
  of `p` after the rejections before it. This is multi-draft speculative sampling with independent proposals.

`accept_argmax` (greedy) and `accept_sampling` (speculative sampling, among deterministic candidates and along
chains sampled from the draft) verify every row's tree at once, as tensors whose shapes do not depend on what was
accepted, so that the device is never waited on: the decoding loop reads one small tensor back per cycle.
`node_scores` gives them the target's processed scores at every node: in one logits-processor call where the
processors do not read the sequence (temperature, top-k, top-p, ...), and where some do but score each row from its
own sequence alone, in one call per row over every node's sequence (a repetition penalty) or one per row and tree
level (minimum lengths).
Where a processor cannot (per-row state, no-repeat-ngram's host n-grams, an unknown processor), `accept_walk` walks
each row's tree by a rule (`greedy_pick`, `sampling_pick`, over `processed_scores`), node by node.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from .tree import DraftTree, node_paths


def greedy_paths(tree: DraftTree, target_choices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's accepted path: the longest root-to-node path whose every token is the target's choice after its
    parent.

    Args:
        tree: the verified trees (`[b, N + 1]` nodes).
        target_choices: `[b, N + 1]` the target's greedy token after each node.
    Returns:
        `(lengths, path)`: `[b]` nodes on each path (root included) and `[b, D + 1]` their indices (`tree_path`).
        The bonus token is the choice after the path's last node.
    """
    token_matches = tree.tokens == target_choices.gather(-1, tree.parents)  # [b, N + 1]
    token_matches[:, 0] = True
    path_matches = ~(tree.ancestors & ~token_matches[:, None, :]).any(dim=-1)  # every node on the path matches
    deepest = torch.where(path_matches, tree.depths, -1).argmax(-1)  # [b]
    return tree_path(tree, deepest)


def tree_path(tree: DraftTree, node: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The path from the root to `node` (`[b]`) of each row: `[b]` its length in nodes and `[b, W]` its node
    indices, root first, the last repeated past the length (`node_paths`: a fixed shape)."""
    lengths = tree.depths.gather(-1, node[:, None])[:, 0] + 1
    return lengths, node_paths(tree, node[:, None])[:, 0]


def children(tree: DraftTree, node: int) -> torch.Tensor:
    """`[m]` indices of the children of `node`, in drafting order (most likely under the draft first)."""
    child_mask = tree.parents == node
    child_mask[node] = False  # the root is its own parent
    return child_mask.nonzero().squeeze(-1)


def accept_among_children(
    target_probs: torch.Tensor, child_tokens: torch.Tensor, uniforms: torch.Tensor
) -> tuple[int, torch.Tensor]:
    """Try deterministic candidates in order against the target distribution, renormalising after each rejection.

    Args:
        target_probs: `[V]` the target's processed next-token distribution.
        child_tokens: `[m]` distinct candidate tokens, in the order they are tried.
        uniforms: `[m]` independent U(0, 1) draws.
    Returns:
        `(index, residual)`: the position in `child_tokens` of the accepted candidate, or -1 when all are rejected,
        and the distribution to draw the bonus token from in that case (`[V]`).
    """
    child_probs = target_probs[child_tokens]
    mass_left = 1.0 - (child_probs.cumsum(0) - child_probs)  # mass of p not yet rejected before each candidate
    accepted = uniforms * mass_left < child_probs
    if accepted.any():
        return int(accepted.int().argmax()), target_probs
    residual = target_probs.clone()
    residual[child_tokens] = 0.0
    return -1, _normalised(residual, fallback=target_probs)


def accept_sampled(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, token: int, uniform: float
) -> tuple[bool, torch.Tensor]:
    """Standard speculative sampling for a token drawn from `draft_probs` (`[V]` each).

    Returns `(accepted, residual)`, residual being the distribution of the replacement token when rejected.
    """
    if uniform * draft_probs[token] < target_probs[token]:
        return True, target_probs
    return False, _normalised((target_probs - draft_probs).clamp_min(0.0), fallback=target_probs)


def accept_in_turn(
    target_probs: torch.Tensor,
    child_tokens: torch.Tensor,
    child_draft_probs: list[torch.Tensor | None],
    uniforms: torch.Tensor,
) -> tuple[int, torch.Tensor]:
    """Try candidates in order, each drawn from its own proposal: `child_draft_probs[i]` (`[V]`), or `None` for a
    deterministic candidate (a point mass). Returns `(index, residual)` as `accept_among_children` does."""
    probs = target_probs
    for index, (token, draft_probs) in enumerate(zip(child_tokens.tolist(), child_draft_probs)):
        if draft_probs is None:
            accepted, probs = accept_among_children(probs, child_tokens[index : index + 1], uniforms[index : index + 1])
            accepted = accepted == 0
        else:
            accepted, probs = accept_sampled(probs, draft_probs, token, float(uniforms[index]))
        if accepted:
            return index, target_probs
    return -1, probs


@dataclass
class Acceptance:
    """What verifying every row's tree decided: `lengths` `[b]` the tokens each row emits (its accepted drafted
    tokens and the bonus token, the target's own after them), `path` `[b, W]` the accepted node indices (root first;
    `lengths` of them, the last repeated after), `tokens` `[b, W]` the emitted tokens (`lengths` of them) and, where
    asked for, `scores` `[b, W, V]`, the processed scores that chose them."""

    lengths: torch.Tensor
    path: torch.Tensor
    tokens: torch.Tensor
    scores: torch.Tensor | None


# `scores_after(path)`: the target's processed scores `[V]` after the last node of `path` (node indices, root first)
ScoresAfter = Callable[[list[int]], torch.Tensor]
# `pick(scores, child_nodes)`: the accepted child's node index and `None`, or `None` and the bonus token `[1]`
Pick = Callable[[torch.Tensor, torch.Tensor], tuple[int | None, torch.Tensor | None]]


def sample(probs: torch.Tensor) -> torch.Tensor:
    """One draw from each distribution `probs` `[..., V]`: the index of the largest `p / E` over independent
    exponential `E`, which is distributed as `p` (the smallest of independent exponentials of rates `p` is index `i`
    with probability `p_i`); unlike `torch.multinomial`, nothing is read back from the device."""
    return (probs / torch.empty_like(probs).exponential_()).argmax(-1)


def accept_argmax(tree: DraftTree, scores: torch.Tensor, keep_scores: bool = False) -> Acceptance:
    """Greedy verification of every row over the target's scores `[b, N + 1, V]` at its nodes (raw logits, or
    processed ones)."""
    # `max(-1).indices` is argmax with the same first-index tie rule, several times faster on bf16 CPU tensors
    target_choices = scores.max(-1).indices  # [b, N + 1]
    lengths, path = greedy_paths(tree, target_choices)
    return _acceptance(lengths, path, target_choices.gather(-1, path), scores, keep_scores)


def accept_sampling(tree: DraftTree, scores: torch.Tensor, keep_scores: bool = False,
                    proposals: torch.Tensor | None = None, sampled: torch.Tensor | None = None) -> Acceptance:
    """Speculative sampling down every row's tree, decided for every node at once: the children of a node are tried
    in order, the path follows each node's first accepted child, and the bonus token is drawn from what is left of
    the last node's distribution after its children's rejections. The decisions of nodes off the path are drawn and
    never used, so the path is distributed as the node-by-node walk's (`accept_in_turn`).

    Deterministic candidates (`accept_among_children`): node `x` is accepted, when tried, with probability `p'(x)`
    under its parent's distribution `p` with `x`'s earlier siblings removed and renormalised. Nodes of chains sampled
    from the draft (`sampled` `[b, N + 1]`, each drawn from its row of `proposals` `[b, N + 1, V]`, over the target
    vocabulary): the standard rule `min(1, p(x) / q(x))` (`accept_sampled`); a node has at most one such child, tried
    before the deterministic ones (a context continuation's), which are then tried against `normalise(max(p - q, 0))`.
    """
    probs = scores.float().softmax(-1)  # [b, N + 1, V]
    nodes = torch.arange(tree.num_nodes, device=probs.device)
    child_of = (tree.parents[:, None, :] == nodes[None, :, None]) & (nodes[None, None, :] > 0)  # [b, parent, node]
    sampled = torch.zeros_like(tree.tokens, dtype=torch.bool) if sampled is None else sampled
    left = probs if proposals is None else _after_sampled_child(probs, proposals, child_of & sampled[:, None, :])
    accepted = _accepted(tree, probs, left, proposals, sampled)
    taken = child_of & accepted[:, None, :]
    first_child = torch.where(taken.any(-1), taken.int().argmax(-1), -1)  # [b, N + 1]
    node = nodes.new_zeros(probs.shape[0])
    for _ in range(tree.max_depth):
        child = first_child.gather(1, node[:, None])[:, 0]
        node = torch.where(child >= 0, child, node)
    lengths, path = tree_path(tree, node)
    last = left.gather(1, node[:, None, None].expand(-1, 1, probs.shape[-1]))[:, 0]  # [b, V]
    last_children = (child_of & ~sampled[:, None, :]).gather(1, node[:, None, None].expand(-1, 1, tree.num_nodes))
    rejected_tokens = torch.zeros_like(last).scatter_add_(1, tree.tokens, last_children[:, 0].float()) > 0
    bonus = sample(_normalised(last.masked_fill(rejected_tokens, 0.0), fallback=last))
    tokens = torch.cat([tree.tokens.gather(1, path[:, 1:]), bonus[:, None]], dim=1)  # [b, D + 1]
    tokens = tokens.scatter(1, (lengths - 1)[:, None], bonus[:, None])  # the bonus right after each row's path
    return _acceptance(lengths, path, tokens, scores, keep_scores)


def _after_sampled_child(probs: torch.Tensor, proposals: torch.Tensor, sampled_child: torch.Tensor) -> torch.Tensor:
    """`[b, N + 1, V]` each node's distribution after its sampled child's rejection (`sampled_child`
    `[b, parent, node]`, at most one per parent): `normalise(max(p - q, 0))`, or `p` where it has none."""
    below = sampled_child.to(proposals.dtype) @ proposals  # [b, N + 1, V]: the child's q (one term: exact), or 0
    return torch.where(sampled_child.any(-1)[..., None], _normalised((probs - below).clamp_min(0.0), probs), probs)


def _accepted(tree: DraftTree, probs: torch.Tensor, left: torch.Tensor, proposals: torch.Tensor | None,
              sampled: torch.Tensor) -> torch.Tensor:
    """`[b, N + 1]` whether each node would be accepted when tried: a deterministic one against what its parent's
    sampled child (`left`) and its earlier deterministic siblings left, a sampled one by `min(1, p(x) / q(x))`."""
    batch, num_nodes, vocab = probs.shape
    nodes = torch.arange(num_nodes, device=probs.device)
    at_parent = tree.parents * vocab + tree.tokens
    child_probs = left.flatten(1).gather(1, at_parent)  # [b, N + 1]: p'_parent(x)
    siblings = (tree.parents[:, :, None] == tree.parents[:, None, :]) & (nodes[None, :, None] > nodes[None, None, :])
    siblings = siblings & ~sampled[:, None, :]
    siblings[:, :, 0] = False  # the root is its own parent, nobody's sibling
    rejected_before = (siblings * child_probs[:, None, :]).sum(-1)  # mass of the earlier siblings
    uniforms = torch.rand(batch, num_nodes, device=probs.device)
    accepted = uniforms * (1.0 - rejected_before) < child_probs
    if proposals is not None:
        drawn = uniforms * proposals.gather(2, tree.tokens[..., None])[..., 0] < probs.flatten(1).gather(1, at_parent)
        accepted = torch.where(sampled, drawn, accepted)
    accepted[:, 0] = False
    return accepted


def proposals_over_target(draft_probs: torch.Tensor, draft_to_target: torch.Tensor, vocab: int) -> torch.Tensor:
    """The draft's distributions `[..., V_d]` over the target vocabulary (`[..., V]`), entry `i` at
    `draft_to_target[i]`."""
    over_target = draft_probs.new_zeros(*draft_probs.shape[:-1], vocab)
    return over_target.index_add_(-1, draft_to_target, draft_probs)


def _normalised(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """`weights` `[..., V]` normalised; where no mass is left (only through float rounding: the rejected candidates
    held all of it), `fallback`."""
    total = weights.sum(-1, keepdim=True)
    return torch.where(total > 0, weights / total.clamp_min(torch.finfo(total.dtype).tiny), fallback)


def _acceptance(lengths: torch.Tensor, path: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor,
                keep_scores: bool) -> Acceptance:
    path_scores = scores.gather(1, path[..., None].expand(-1, -1, scores.shape[-1])).float() if keep_scores else None
    return Acceptance(lengths, path, tokens, path_scores)


def stacked(walks: list["Walk"], width: int) -> Acceptance:
    """The `Acceptance` of rows walked one by one (`accept_walk`), padded to `width` nodes."""
    paths = torch.stack([walk.path[torch.arange(width, device=walk.path.device).clamp_max(walk.path.numel() - 1)]
                         for walk in walks])
    tokens = torch.stack([torch.cat([walk.tokens, walk.tokens[-1:].expand(width - walk.tokens.numel())])
                          for walk in walks])
    scores = torch.stack([torch.cat([walk.scores, walk.scores[-1:].expand(width - walk.scores.shape[0], -1)])
                          for walk in walks])
    lengths = torch.stack([torch.tensor(walk.path.numel(), device=paths.device) for walk in walks])
    return Acceptance(lengths, paths, tokens, scores)


@dataclass
class Walk:
    """One row's walk down its tree: the accepted node indices `path` (`[m]`, root first), the emitted `tokens`
    (`[m]`: the path's drafted tokens, then the bonus) and the processed `scores` (`[m, V]`) that chose them."""

    path: torch.Tensor
    tokens: torch.Tensor
    scores: torch.Tensor


def accept_walk(tree: DraftTree, scores_after: ScoresAfter, pick: Pick) -> Walk:
    """Walk down one tree (no batch dimension) from the root, at each node accepting the child `pick` chooses, until
    it chooses the bonus token."""
    path, path_scores = [0], []
    while True:
        scores = scores_after(path)
        path_scores.append(scores)
        child, bonus = pick(scores, children(tree, path[-1]))
        if child is None:
            path = torch.tensor(path, device=scores.device)
            return Walk(path, torch.cat([tree.tokens[path[1:]], bonus]), torch.stack(path_scores))
        path.append(child)


def greedy_pick(tree: DraftTree) -> Pick:
    """The child holding the target's argmax, else the argmax as the bonus token."""

    def pick(scores: torch.Tensor, child_nodes: torch.Tensor):
        choice = scores.argmax(-1, keepdim=True)
        matching = child_nodes[tree.tokens[child_nodes] == choice]
        return (int(matching[0]), None) if matching.numel() else (None, choice)

    return pick


def sampling_pick(tree: DraftTree, draft_probs: torch.Tensor | None = None, sampled: torch.Tensor | None = None,
                  draft_to_target: torch.Tensor | None = None) -> Pick:
    """Speculative sampling among a node's children: deterministic candidates (`accept_among_children`), or, for a
    sampled chain (`draft_probs` `[N + 1, V_d]` over the draft vocabulary, `sampled` `[N + 1]`, mapped to target ids
    by `draft_to_target`), each child by the rule of its own proposal (`accept_in_turn`)."""

    def pick(scores: torch.Tensor, child_nodes: torch.Tensor):
        probs = scores.softmax(-1)
        if child_nodes.numel() == 0:
            return None, sample(probs)[None]
        if sampled is None:
            index, residual = accept_among_children(
                probs, tree.tokens[child_nodes], torch.rand(child_nodes.numel(), device=probs.device)
            )
        else:
            proposals = [
                proposals_over_target(draft_probs[child].to(probs.dtype), draft_to_target, probs.shape[-1])
                if sampled[child] else None
                for child in child_nodes.tolist()
            ]
            index, residual = accept_in_turn(
                probs, tree.tokens[child_nodes], proposals, torch.rand(child_nodes.numel(), device=probs.device)
            )
        if index >= 0:
            return int(child_nodes[index]), None
        return None, sample(residual)[None]

    return pick


def processed_scores(logits_processor, sequence: torch.Tensor, tree: DraftTree, logits: torch.Tensor, row: int = 0,
                     batch_size: int = 1) -> ScoresAfter:
    """The target's processed scores at the tree's nodes exactly as plain decoding would compute them, for row `row`
    of a batch of `batch_size` whose sequence so far is `sequence` (`[1, L]`), from the raw `logits` `[N + 1, V]`.
    Processors may hold per-row state (a left-padded row's prompt length, ...), so the row's prefix goes through them
    at its own index, in a batch of copies of it."""

    def scores_after(path: list[int]) -> torch.Tensor:
        path_tokens = tree.tokens[path[1:]][None]
        prefix = torch.cat([sequence, path_tokens], dim=-1).expand(batch_size, -1)
        node_logits = logits[path[-1]][None].float().repeat(batch_size, 1)
        return logits_processor(prefix, node_logits)[row]

    return scores_after


# Logits processors whose scores do not depend on the sequence (`input_ids`).
SEQUENCE_FREE_PROCESSORS = (
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "TopHLogitsWarper", "MinPLogitsWarper",
    "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "LogitNormalization",
    "SuppressTokensLogitsProcessor", "InfNanRemoveLogitsProcessor",
)
# Logits processors that read the sequence and score each row from that row's sequence and scores alone, keeping no
# state across calls.
ROW_WISE_PROCESSORS = (
    "RepetitionPenaltyLogitsProcessor", "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor",
    "ForcedEOSTokenLogitsProcessor",
)
# Of those, the ones that read a sequence only as the set of its tokens (past an ignored prompt): a sequence with some
# of its own tokens appended scores the same.
TOKEN_SET_PROCESSORS = ("RepetitionPenaltyLogitsProcessor",)


def _one_of(processor, names: tuple[str, ...]) -> bool:
    return type(processor).__name__ in names and type(processor).__module__ == "transformers.generation.logits_process"


def reads_sequence(processor) -> bool:
    """Whether a processor's scores may depend on the sequence (an unknown one's may)."""
    return not _one_of(processor, SEQUENCE_FREE_PROCESSORS)


def scores_every_node(logits_processor) -> bool:
    """Whether `node_scores` can score every node at once: each processor reads no sequence, or scores a row from
    that row alone. Not so for a processor with per-row state that `per_row` does not resolve (a prefix
    constraint's batch index, a watermark's), one that reads the sequence on the host anyway (no-repeat-ngram's n-grams
    are Python dictionaries: one read per sequence, so scoring every node would read more, not less), or an unknown
    one: `accept_walk` walks those trees node by node."""
    return all(not reads_sequence(processor) or (
        _one_of(processor, ROW_WISE_PROCESSORS)
        and not isinstance(getattr(processor, "prompt_ignore_length", None), torch.Tensor))
        for processor in logits_processor)


def per_row(logits_processor, batch_size: int) -> list[LogitsProcessorList]:
    """Each row's processors, with their per-row state resolved where it is known: a repetition penalty that ignores a
    prompt length per row (`prompt_ignore_length` a `[B]` tensor: `generate` passes each row's left padding) becomes,
    for row `i`, one that ignores its first `prompt_ignore_length[i]` tokens (read here, once a call)."""
    ignored = {id(processor): processor.prompt_ignore_length.tolist() for processor in logits_processor
               if _one_of(processor, ROW_WISE_PROCESSORS)
               and isinstance(getattr(processor, "prompt_ignore_length", None), torch.Tensor)}

    def of_row(processor, row: int):
        if id(processor) not in ignored:
            return processor
        return RepetitionPenaltyLogitsProcessor(processor.penalty, prompt_ignore_length=ignored[id(processor)][row])

    return [LogitsProcessorList([of_row(processor, row) for processor in logits_processor])
            for row in range(batch_size)]


def node_scores(row_processors: list, sequences: list[torch.Tensor], tree: DraftTree,
                logits: torch.Tensor) -> torch.Tensor:
    """The processed scores `[b, N + 1, V]` at every node from the raw `logits`, each as plain decoding computes it
    after the node's sequence: its row's `sequences[i]` (`[L_i]`, the root last), then its path's tokens, through
    its row's processors `row_processors[i]` (`per_row`).

    The processors up to the last that reads the sequence run once per row (a repetition penalty) or once per row and
    tree level (length-reading ones), over all the row's nodes (`along_paths`); those after it run once over every
    node. Shapes are fixed by the tree: nothing is read back. Every processor must read
    no sequence or score a row from that row alone (`scores_every_node`)."""
    batch, num_nodes, vocab = logits.shape
    readers = 1 + max((i for i, processor in enumerate(row_processors[0]) if reads_sequence(processor)), default=-1)
    scores = logits.float()
    if readers:
        paths = node_paths(tree)[..., 1:]  # [b, N + 1, W - 1]: each node's drafted tokens, root excluded
        path_tokens = tree.tokens.gather(1, paths.flatten(1)).view(paths.shape)
        scores = torch.stack([
            along_paths(LogitsProcessorList(processors[:readers]), sequence, path_tokens[row], tree.depths[row],
                        scores[row])
            for row, (processors, sequence) in enumerate(zip(row_processors, sequences))])
    rest = LogitsProcessorList(row_processors[0][readers:])  # the same for every row: none has per-row state
    return rest(tree.tokens.reshape(-1, 1), scores.reshape(-1, vocab)).view(batch, num_nodes, vocab)


def along_paths(logits_processor, sequence: torch.Tensor, path_tokens: torch.Tensor, depths: torch.Tensor,
                scores: torch.Tensor) -> torch.Tensor:
    """One row's processed `scores` (`[n, V]`) at its nodes, each after `sequence` (`[L]`) and its path's tokens
    (`path_tokens` `[n, W - 1]`, the first `depths` of them its own, then the node's own token repeated). Processors
    that read the sequence as a set of tokens (`TOKEN_SET_PROCESSORS`) score every node in one call over its whole
    padded path, which holds the same tokens; the others in one call per depth `d` over every node's sequence cut at
    `L + d` tokens, of which the nodes at depth `d` keep theirs."""
    num_nodes = scores.shape[0]
    if all(not reads_sequence(processor) or _one_of(processor, TOKEN_SET_PROCESSORS) for processor in logits_processor):
        return logits_processor(torch.cat([sequence.expand(num_nodes, -1), path_tokens], dim=-1), scores.clone())
    processed = scores
    for depth in range(path_tokens.shape[-1] + 1):
        node_sequences = torch.cat([sequence.expand(num_nodes, -1), path_tokens[:, :depth]], dim=-1)
        at_depth = logits_processor(node_sequences, scores.clone())
        processed = torch.where((depths == depth)[:, None], at_depth, processed)
    return processed
