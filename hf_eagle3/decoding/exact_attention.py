"""Tree verification attention that gives every node exactly the attention plain decoding would give it.

Verifying a tree in one forward with a mask puts the keys of other branches between or after a node's own keys, and
the attention kernels' reductions over keys depend on that layout (vector lanes, tails, blocks): in bfloat16 a node's
logits then differ from what plain decoding computes by up to about half a logit, enough to flip near-ties, so greedy
outputs part from plain `generate`.

`exact_tree_sdpa` removes the difference. Each node attends to the keys plain decoding would hold at that point,
in the same order and nothing else: the prefix, then its own path from the root. The nodes of one depth have key
sequences of one length, so one call per depth scores them all, the nodes in the batch dimension, through the very
function plain decoding uses (transformers' sdpa attention) with the arguments it passes: no mask, one query.
The rest of a decoder layer works row by row; where its kernels also give a row the same result whatever the number of
rows (the CPU's bfloat16 matrix multiplications do), verified tokens get plain decoding's logits and cache entries bit
for bit. It applies to sdpa full-attention layers over a fully visible prefix; generation refuses it elsewhere.

How a forward asks for it, with no model or config changed: transformers 5.24 chooses a layer's attention function
by `config._attn_implementation` alone (the choice is the model's, `set_attn_implementation` included), and passes a
forward's extra keyword arguments on to that function. So `install` registers, once, an "sdpa" entry that is the
sdpa function registered before it, unless a forward passes `exact_tree_keys=TreeKeyLayout.of(tree, prefix_length)`:
threads sharing a target each choose per forward, and every other forward runs the plain function unchanged. The
first call with `exact_attention=True` installs it (`TargetAttention`); importing hf_eagle3 leaves "sdpa" as it is.
"""

import itertools
from dataclasses import dataclass, field

import torch

from ..utils.transformers_api import wrap_sdpa
from .tree import DraftTree

KEYWORD = "exact_tree_keys"  # the forward keyword argument that carries a `TreeKeyLayout`


@dataclass
class TreeKeyLayout:
    """Which cache entries each tree node attends to: the first `prefix_length`, then its path from the root.

    A `DraftTree` orders its nodes by depth, so the nodes of depth `d` are the range `depth_starts[d]` ..
    `depth_starts[d + 1]`, and `path_entries[d]` `[n_d * (d + 1)]` holds their paths from the root (root first), one
    after the other, as cache positions. `layers` counts the attention layers that attended by it (in a forward that
    passed it), so that a model that does not hand its forward's keyword arguments to its attention is caught."""

    prefix_length: int
    depth_starts: list[int]
    path_entries: list[torch.Tensor]
    layers: int = field(default=0, compare=False)

    @classmethod
    def of(cls, tree: DraftTree, prefix_length: int) -> "TreeKeyLayout":
        if bool((tree.depths[1:] < tree.depths[:-1]).any()):
            raise ValueError("exact tree attention needs the tree's nodes ordered by depth, as build_tree orders them.")
        starts = [0, *itertools.accumulate(torch.bincount(tree.depths).tolist())]
        # A node's ancestors in increasing index order are its path from the root (parents precede children).
        entries = [prefix_length + tree.ancestors[start:end].nonzero()[:, 1]
                   for start, end in itertools.pairwise(starts)]
        return cls(prefix_length, starts, entries)


def exact_tree_sdpa(sdpa, module, query, key, value, attention_mask, exact_tree_keys: TreeKeyLayout | None = None,
                    **kwargs):
    """`sdpa` (transformers' sdpa attention function), or with `exact_tree_keys` each of the tree's nodes over only
    the keys it may see. `query` `[1, H, n, D]` for the tree's `n` nodes; `key` / `value` `[1, H_kv, P + n, D]`:
    prefix, then the nodes. Returns `[1, n, H, D]`, as transformers' attention functions do."""
    layout = exact_tree_keys
    if layout is None:  # any forward that does not ask for it
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    layout.layers += 1
    prefix_length, starts = layout.prefix_length, layout.depth_starts
    outputs = []
    for depth, (start, end, entries) in enumerate(zip(starts, starts[1:], layout.path_entries)):
        if depth == 0:  # the root: the prefix and itself, contiguous in the cache
            node_keys, node_values = key[:, :, : prefix_length + 1], value[:, :, : prefix_length + 1]
        else:
            node_keys, node_values = (
                torch.cat(
                    [
                        states[:, :, :prefix_length].expand(end - start, -1, -1, -1),
                        states[0].index_select(1, entries).unflatten(1, (end - start, depth + 1)).transpose(0, 1),
                    ],
                    dim=2,
                )  # [n_d, H_kv, P + d + 1, D]
                for states in (key, value)
            )
        node_queries = query[0, :, start:end].transpose(0, 1)[:, :, None]  # [n_d, H, 1, D]
        node_output, _ = sdpa(module, node_queries, node_keys, node_values, None, **kwargs)
        outputs.append(node_output.transpose(0, 1))  # [1, n_d, H, D]
    return torch.cat(outputs, dim=1), None


def install() -> None:
    """Register the "sdpa" attention function that takes `exact_tree_keys` (idempotent)."""
    wrap_sdpa(exact_tree_sdpa, "_hf_eagle3_hook")


def check_applied(model, layout: TreeKeyLayout) -> None:
    """Raise unless the forward that carried `layout` attended by it."""
    if not layout.layers:
        raise RuntimeError(
            f"{type(model).__name__} did not pass its forward's keyword arguments on to its attention layers, so "
            "exact_attention=True could not reach them: drop exact_attention (verification stays lossless in float32)."
        )
