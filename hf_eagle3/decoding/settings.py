"""The settings of one EAGLE-3 `generate` call, resolved from every place they can be set.

From highest to lowest: the call's keyword arguments; the call's `generation_config` as `generate` prepared it (the
call's own over the target's, field by field); the draft's `generation_config` (where transformers reads an
assistant's settings, as it reads `num_assistant_tokens`); the draft config's defaults. A level that sets
`tree_shape="auto"` drops lower levels' tree sizes, one that sets sizes drops a lower `tree_shape`. With
`tree_shape="auto"` the tree is the shape `calibration.choose_tree` predicts fastest on this machine at this batch
size, or none (decode plainly); a draft without an acceptance profile (every public draft) has nothing to predict
from, so `auto` decodes with the fixed tree instead, saying so once.

The fixed tree is the draft config's, except for a draft without an acceptance profile decoding on a GPU: there it is
the official EAGLE-3 tree, `ACCELERATOR_TREE` (depth 7, top-k 10, 60 tokens). A GPU verifies 61 tokens in about the
time of one decode step, where a CPU's forward grows with its tokens; a config's sizes are what suits a CPU (6x8x60 by
default), and sizes set in a generation config or the call are used everywhere.

A call decoding into a static cache (`cache_implementation="static"`, which compiled verification needs) verifies over
its whole length, so the length is settled here, before the calibration that depends on it: the cache's own where
it holds a whole tree after `max_length - 1` tokens, else the next multiple of `STATIC_CACHE_BLOCK` that does, so
that calls of similar lengths share one compiled graph per tree size and one calibration record.
"""

from dataclasses import dataclass

from transformers.cache_utils import StaticCache
from transformers.utils import logging

from ..configuration_eagle3 import Eagle3Config
from ..modeling_eagle3 import Eagle3DraftModel
from .calibration import TreeChoice, choose_tree, profile_problem, profile_shapes
from .drafter import TreeSettings, max_candidates

TREE_KWARGS = ("tree_depth", "tree_top_k", "tree_total_tokens")
# what a call, its generation config, the target's or the draft's generation config may set
SETTING_KWARGS = (*TREE_KWARGS, "tree_shape", "exact_attention", "ngram_candidates")
# transformers' settings for its own candidate generators: they would be silently ignored
ASSISTED_ONLY_KWARGS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
STATIC_CACHE_BLOCK = 256  # a static cache EAGLE-3 allocates holds a multiple of this many entries
# the official EAGLE-3 tree: a draft's without an acceptance profile on a GPU
ACCELERATOR_TREE = {"tree_depth": 7, "tree_top_k": 10, "tree_total_tokens": 60}
logger = logging.get_logger(__name__)


@dataclass(frozen=True)
class DecodingSettings:
    """How one call decodes: the draft tree (`None`: plainly, the draft is not run), why that tree with
    `tree_shape="auto"` (and the calibration's `choice`, which the loop checks against the call's own speed), whether
    context n-gram continuations join the tree, whether each node is verified over exactly plain decoding's keys, and
    the length of the static cache the call decodes into (`None`: a dynamic cache)."""

    tree: TreeSettings | None
    shape_choice: str | None
    ngram_candidates: bool
    exact_attention: bool
    choice: TreeChoice | None = None  # the calibration's choice with `tree_shape="auto"`, checked during the call
    static_length: int | None = None


def static_cache_length(cache, max_length: int, tree_tokens: int) -> int | None:
    """The length of the static cache a call of up to `max_length` tokens with trees of up to `tree_tokens` nodes
    decodes into (`None` for any other cache): `cache`'s own where it has room (or already holds a prefix: then it is
    checked against the call's tree), else the next multiple of `STATIC_CACHE_BLOCK` with room."""
    if type(cache) is not StaticCache:
        return None
    needed, own = max_length + tree_tokens, cache.layers[0].max_cache_len
    if own >= needed or cache.get_seq_length():
        return own
    return in_blocks(needed)


def in_blocks(length: int) -> int:
    """`length` rounded up to a multiple of `STATIC_CACHE_BLOCK`: calls of similar lengths share compiled graphs."""
    return -(-length // STATIC_CACHE_BLOCK) * STATIC_CACHE_BLOCK


def resolve_settings(model, draft: Eagle3DraftModel, generation_config, call: dict, batch_size: int,
                     compile_config=None, cache=None, prompt_length: int | None = None) -> DecodingSettings:
    """The call's settings. `call` holds the call's keyword arguments by name (`SETTING_KWARGS`), `None` for unset;
    `compile_config`: the verification forwards are compiled with it (`None`: eager), and `cache` is the one
    `generate` prepared: the path `tree_shape="auto"` calibrates; `prompt_length` and `max_length` give the tokens
    cached on average while the call decodes, which plain decoding's step depends on."""
    ignored = sorted(name for name in ASSISTED_ONLY_KWARGS if getattr(draft.generation_config, name, None) is not None)
    if ignored:
        raise TypeError(
            f"The draft's generation_config sets {', '.join(ignored)}, which size transformers' own assisted "
            "generation, which EAGLE-3 replaces: unset them, and set tree_depth / tree_top_k / tree_total_tokens "
            "(or tree_shape='auto') instead."
        )
    levels = [
        {name: getattr(config, name) for name in SETTING_KWARGS if getattr(config, name, None) is not None}
        for config in (draft.generation_config, generation_config)
    ]
    layered = _layered([*levels, {name: value for name, value in call.items() if value is not None}])
    for name in ("ngram_candidates", "exact_attention"):  # a string such as "no" would read as True
        if not isinstance(layered.get(name, False), bool):
            raise TypeError(f"{name} must be True or False, got {layered[name]!r}.")
    ngram_candidates = bool(layered.get("ngram_candidates", draft.config.ngram_candidates))
    exact_attention = bool(layered.get("exact_attention", False))
    sizes = {name: layered[name] for name in TREE_KWARGS if name in layered}
    shape = layered.get("tree_shape") or ("fixed" if sizes else draft.config.tree_shape)
    if shape not in ("fixed", "auto"):
        raise ValueError(f"tree_shape must be 'fixed' or 'auto', got {shape!r}.")
    if shape == "auto" and not sizes and not draft.config.acceptance_profile:
        logger.warning_once(
            "hf_eagle3: tree_shape='auto' chooses the tree from the draft's acceptance profile, which this draft's "
            "config does not record: decoding with the fixed tree instead. Run `hf-eagle3 tune-tree --draft DIR "
            "--save-to DIR` once to record it, or pass tree_depth / tree_top_k / tree_total_tokens.")
        shape = "fixed"
    if shape == "fixed":
        tree = _fixed_tree(draft.config, sizes, model.device.type)
        static_length = static_cache_length(cache, generation_config.max_length, tree.total_tokens)
        return DecodingSettings(tree, None, ngram_candidates, exact_attention, static_length=static_length)
    if sizes:
        raise ValueError(f"tree_shape='auto' chooses the tree itself: drop {', '.join(sizes)} or tree_shape.")
    static_length = static_cache_length(cache, generation_config.max_length, _largest_profiled_tree(draft.config))
    context_length = (None if prompt_length is None
                      else prompt_length + max(generation_config.max_length - prompt_length, 0) / 2)
    choice = choose_tree(model, draft, ngram_candidates, batch_size, compile_config, static_length, context_length)
    return DecodingSettings(choice.settings, choice.reason, ngram_candidates, exact_attention, choice, static_length)


def _largest_profiled_tree(config: Eagle3Config) -> int:
    """The most tokens of a tree `tree_shape="auto"` may choose (0 for a profile it cannot use)."""
    profile = config.acceptance_profile
    if not profile or profile_problem(profile, config.draft_vocab_size):
        return 0
    return max(shape.total_tokens for shape, _ in profile_shapes(profile))


def _layered(levels: list[dict]) -> dict:
    """Merge `levels`, lowest first, each over the ones below it."""
    settings = {}
    for level in levels:
        if level.get("tree_shape") == "auto":
            settings = {name: value for name, value in settings.items() if name not in TREE_KWARGS}
        elif "tree_shape" not in level and any(name in level for name in TREE_KWARGS):
            settings.pop("tree_shape", None)
        settings |= level
    return settings


def _fixed_tree(config: Eagle3Config, sizes: dict, device_type: str) -> TreeSettings:
    """The tree of `sizes`, else the defaults: on a GPU (`device_type` `"cuda"`) for a draft without an acceptance
    profile `ACCELERATOR_TREE`, else the draft config's. A default size is capped at what the tree holds
    (`tree_top_k=1` alone drafts the whole chain); a size set for the call must fit (`TreeSettings`)."""
    defaults = (ACCELERATOR_TREE if device_type == "cuda" and not config.acceptance_profile
                else {name: getattr(config, name) for name in TREE_KWARGS})
    depth = sizes.get("tree_depth", defaults["tree_depth"])
    top_k = sizes.get("tree_top_k", defaults["tree_top_k"])
    default_total = min(defaults["tree_total_tokens"], max_candidates(depth, top_k))
    settings = TreeSettings(depth, top_k, sizes.get("tree_total_tokens", default_total))
    if settings.top_k > config.draft_vocab_size:
        raise ValueError(f"tree_top_k={settings.top_k} exceeds the draft vocabulary ({config.draft_vocab_size}).")
    return settings
