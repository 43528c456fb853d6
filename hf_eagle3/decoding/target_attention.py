"""How the target attends while it verifies draft trees: each row's tree mask over its visible cache entries, with
the target's sliding window where it has one, through sdpa over the keys as cached (`grouped_attention`), or node by
node over exactly plain decoding's keys (`exact_attention`)."""

import torch

from ..utils.transformers_api import attention_implementation
from . import grouped_attention
from .exact_attention import KEYWORD, TreeKeyLayout, check_applied
from .exact_attention import install as install_exact_attention
from .tree import DraftTree, tree_attention_mask


class TargetAttention:
    """How the target attends during verification: one forward with the masks its layers need (full attention, a
    sliding window, or both kinds of layer (`config.layer_types`), in which case the model takes one mask per kind),
    with an sdpa target's query heads folded onto their key/value heads (`grouped_attention`), or, with
    `exact=True`, each node over exactly the keys plain decoding would give it (`exact_attention`: sdpa, full
    attention, one unpadded sequence only)."""

    def __init__(self, model, exact: bool, prompt_mask: torch.Tensor | None, batch_size: int):
        text_config = model.config.get_text_config()
        window = getattr(text_config, "sliding_window", None)
        self.sliding_window = window if getattr(text_config, "use_sliding_window", True) else None
        layer_types = set(getattr(text_config, "layer_types", None) or ["sliding_attention"])
        unsupported = layer_types - {"full_attention", "sliding_attention"}
        if unsupported:
            raise ValueError(
                f"{type(model).__name__} has {', '.join(sorted(unsupported))} layers; EAGLE-3 decoding supports full "
                "and sliding-window attention only: generate without assistant_model."
            )
        if "sliding_attention" not in layer_types:
            self.sliding_window = None
        self.mixed = self.sliding_window is not None and "full_attention" in layer_types
        self.exact = exact
        self.implementation = attention_implementation(model.config)
        if exact and (self.sliding_window is not None or self.implementation != "sdpa"):
            raise ValueError(
                "exact_attention=True reproduces plain decoding's sdpa attention over full-attention layers; "
                f"{type(model).__name__} uses {self.implementation!r} attention"
                f"{' with a sliding window' if self.sliding_window is not None else ''}: load it with "
                "attn_implementation='sdpa', or drop exact_attention."
            )
        if exact and batch_size > 1:
            raise ValueError(
                f"exact_attention=True verifies one sequence node by node, got a batch of {batch_size}: generate one "
                "sequence per call, or drop exact_attention (batched verification is lossless in float32)."
            )
        if exact and prompt_mask is not None and not prompt_mask.all():
            raise ValueError(
                "exact_attention=True needs every prompt token visible (plain decoding over a padded prompt uses a "
                "mask it cannot reproduce node by node): strip the padding, or drop exact_attention."
            )
        if exact:
            install_exact_attention()

    def verification_kwargs(self, tree: DraftTree, prefix_length: int) -> dict:
        """The keyword arguments of the verification forward of `tree` after `prefix_length` cache entries that say
        how it attends, beyond its masks: with `exact` (one sequence), each node's keys
        (`exact_attention.TreeKeyLayout`); else, for sdpa, query heads folded onto their key/value heads
        (`grouped_attention`)."""
        if self.exact:
            return {KEYWORD: TreeKeyLayout.of(tree.row(0), prefix_length)}
        return grouped_attention.forward_kwargs(self.implementation)

    def check_verified(self, model, verification_kwargs: dict) -> None:
        """Raise if the forward did not attend as `verification_kwargs` asked."""
        if KEYWORD in verification_kwargs:
            check_applied(model, verification_kwargs[KEYWORD])

    def verification_mask(self, ancestors: torch.Tensor, prefix_visible: torch.Tensor, key_positions: torch.Tensor,
                          dtype: torch.dtype, key_length: int | None = None):
        """Masks of one tree per row (`ancestors` `[B, n, n]`), each over its row's visible prefix (`[B, P]`);
        `key_positions` `[B, P + n]` are the positions of the prefix's cache entries and of the nodes (what a sliding
        window is measured in). `key_length`: a static cache's length, whose entries past the nodes are hidden (full
        attention only)."""
        if self.sliding_window is None:
            mask = tree_attention_mask(ancestors, prefix_visible, dtype)
            if key_length is None:
                return mask
            return torch.nn.functional.pad(mask, (0, key_length - mask.shape[-1]), value=torch.finfo(dtype).min)
        sliding = tree_attention_mask(ancestors, prefix_visible, dtype, sliding_window=self.sliding_window,
                                      key_positions=key_positions)
        if not self.mixed:
            return sliding
        full = tree_attention_mask(ancestors, prefix_visible, dtype)
        return {"full_attention": full, "sliding_attention": sliding}
