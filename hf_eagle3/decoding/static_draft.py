"""The draft's fixed-shape step, for a call whose forwards are compiled: the draft's forwards in a small, fixed set of
shapes, so that the compiled path can capture them (CUDA graphs), as it captures the target's verification.

The draft's cache is a `StaticCache` of `length` entries, sized for the call; every draft mask spans all of them (the
entries past what a row sees masked). Its entries are written where the cache's own write position stands: the
drafter keeps that position as a host integer and moves it back, without reading the device, over the entries the
next forward overwrites (a cycle's tree, the padding of a feed). A cycle's verified positions are fed padded to
`width`, the most one cycle can feed (its longest accepted path and bonus token, a context continuation included);
the padding is written past the fed positions, seen by no query that counts, and overwritten next. Every depth step
already feeds `[b, top_k]` nodes. So a call's draft forwards have three shapes: the prompt's (eager, as the target's
prefill is), `[b, width]` and `[b, top_k]`.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.cache_utils import StaticCache

from ..modeling_eagle3 import Eagle3DraftModel


@dataclass(frozen=True)
class StaticDraft:
    """What a drafter needs for fixed shapes: the draft's compiled `forward`, its cache's `length` and the `width`
    every cycle's feed is padded to."""

    forward: Callable
    length: int
    width: int

    def cache(self, draft: Eagle3DraftModel) -> StaticCache:
        return StaticCache(config=draft.config, max_cache_len=self.length)


def padded(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """`tensor` (`[b, m, ...]`) padded with zeros (`False`) to `[b, width, ...]`."""
    padding = tensor.new_zeros(tensor.shape[0], width - tensor.shape[1], *tensor.shape[2:])
    return torch.cat([tensor, padding], dim=1)


def spanning(mask: torch.Tensor, length: int) -> torch.Tensor:
    """A boolean mask `[..., K]` over the first `K` cache entries, over all `length` (the others masked)."""
    return torch.nn.functional.pad(mask, (0, length - mask.shape[-1]))
