"""EAGLE-3 inside `target.generate(**inputs, assistant_model=draft)`.

transformers runs assisted generation through `GenerationMixin._assisted_decoding`, whose cache rollback keeps a
prefix of the candidates: a chain fits, a tree does not. Importing `hf_eagle3` therefore wraps three methods of
`GenerationMixin`, each of which defers to the original unless the assistant is an `Eagle3DraftModel`:

- `generate`: accepts the per-call settings `tree_depth`, `tree_top_k`, `tree_total_tokens`, `tree_shape`,
  `ngram_candidates` and `exact_attention`; with `tree_shape="auto"` it picks the shape predicted fastest on this
  machine (`calibration.choose_tree`), or runs plain decoding (the draft is not run) when none is predicted to pay;
- `_validate_generation_mode`: rejects what EAGLE-3 decoding does not support (beam search, several return
  sequences, a different assistant tokenizer, ...) before any work is done;
- `_assisted_decoding`: runs `eagle3_decoding` instead of the candidate-generator loop.

One decoding cycle: the drafter grows a tree below the last generated token (the root), into which, with
`ngram_candidates`, a context n-gram continuation is merged (`ngram`); the target verifies root and tree in one forward
with a tree attention mask (with `exact_attention=True`, each node over exactly plain decoding's keys instead:
`tree_attention`), returning the hidden states the draft fuses; the accepted path and a bonus token are emitted; the
target's cache keeps only the accepted path, and the drafter feeds the accepted positions' target features to the
draft.
"""

import contextlib
import contextvars
import functools
import time
from dataclasses import dataclass, field

import torch
from transformers import GenerationMixin
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import logging

from .calibration import choose_tree
from .compatibility import adopt_target_layers, check_compatibility, record_target_special_tokens
from .drafter import DraftProposal, Eagle3Drafter, TreeSettings, max_candidates
from .modeling_eagle3 import Eagle3DraftModel
from .ngram import ContinuationAcceptance, find_continuation
from .tree import DraftTree, tree_attention_mask
from .tree_attention import exact_tree_attention
from .verify import accept_among_children, accept_in_turn, children, greedy_accept

TREE_KWARGS = ("tree_depth", "tree_top_k", "tree_total_tokens")
EAGLE3_KWARGS = (*TREE_KWARGS, "tree_shape", "exact_attention", "ngram_candidates")
# transformers' settings for its own candidate generators: they would be silently ignored
ASSISTED_ONLY_KWARGS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
logger = logging.get_logger(__name__)
_call_settings: contextvars.ContextVar[dict] = contextvars.ContextVar("hf_eagle3_call_settings", default={})
_recording_greedy_cycles: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "hf_eagle3_recording_greedy_cycles", default=False
)


@contextlib.contextmanager
def recording_greedy_cycles():
    """Within this block, greedy EAGLE-3 `generate` calls keep every cycle's tree and accepted path in
    `draft.generation_stats.greedy_cycles` (what `tree_sizing.tune_tree` calibrates on); outside it they keep none."""
    token = _recording_greedy_cycles.set(True)
    try:
        yield
    finally:
        _recording_greedy_cycles.reset(token)


@dataclass
class Eagle3GenerationStats:
    """What one EAGLE-3 `generate` call did; available afterwards as `draft.generation_stats`.

    `acceptance_lengths[i]` is the number of tokens cycle `i` emitted from one target forward (accepted drafted
    tokens + the bonus token); the first token (from the prefill) is not counted. Times are wall-clock seconds.
    `greedy_cycles` holds each cycle's `DraftTree` and accepted path (node indices, root first), for greedy decoding
    inside `recording_greedy_cycles()` only. With `ngram_candidates`, `continuation_tokens` counts the accepted drafted
    tokens that the context continuation proposed (alone or with the draft). With `tree_shape="auto"`, `shape_choice`
    says which shape was chosen and why; `settings` is `None` when the call decoded plainly (the draft was not run, no
    cycles).
    """

    settings: TreeSettings | None
    acceptance_lengths: list[int] = field(default_factory=list)
    greedy_cycles: list[tuple[DraftTree, torch.Tensor]] = field(default_factory=list)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    shape_choice: str | None = None
    continuation_tokens: int = 0  # accepted drafted tokens that a context n-gram continuation proposed

    @property
    def num_cycles(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def mean_acceptance_length(self) -> float:
        """τ: mean tokens per target forward (verification cycles only)."""
        return sum(self.acceptance_lengths) / max(self.num_cycles, 1)

    @property
    def other_seconds(self) -> float:
        """Time of the cycles spent outside drafting and verification: acceptance, bookkeeping, Python."""
        return self.total_seconds - self.prefill_seconds - self.draft_seconds - self.verify_seconds


class _Stopwatch:
    """Accumulates wall time into fields of the stats; synchronises CUDA so that the split is real."""

    def __init__(self, stats: Eagle3GenerationStats, device: torch.device):
        self.stats = stats
        self.synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    @contextlib.contextmanager
    def time(self, field_name: str):
        self.synchronize()
        start = time.perf_counter()
        yield
        self.synchronize()
        setattr(self.stats, field_name, getattr(self.stats, field_name) + time.perf_counter() - start)


def _check_supported(model, draft: Eagle3DraftModel, input_ids: torch.Tensor, generation_config, model_kwargs):
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"EAGLE-3 decoding supports batch size 1, got {input_ids.shape[0]}: call generate once per sequence."
        )
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError(
            "EAGLE-3 decoding does not return attentions or hidden states: drop output_attentions / "
            "output_hidden_states, or generate without assistant_model."
        )
    cache = model_kwargs.get("cache")
    if type(cache) is not DynamicCache or any(type(layer) is not DynamicLayer for layer in cache.layers):
        raise ValueError(
            f"EAGLE-3 decoding needs a plain DynamicCache on the target (full attention), got {type(cache).__name__}"
            f"{' with ' + ', '.join(sorted({type(layer).__name__ for layer in cache.layers})) if cache else ''}: "
            "drop cache_implementation / the cache argument."
        )
    if model.config._attn_implementation.startswith("flash_attention"):
        raise ValueError(
            "flash-attention cannot take a tree attention mask: load the target with attn_implementation='sdpa'."
        )
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError(
            "EAGLE-3 decoding needs the prompt's token ids (the draft embeds the tokens the target verified): pass "
            "input_ids instead of inputs_embeds, or generate without assistant_model."
        )


class _TargetAttention:
    """How the target attends during verification: one forward with the masks its layers need (full attention, a
    sliding window, or both kinds of layer (`config.layer_types`), in which case the model takes one mask per kind),
    or, with `exact=True`, each node over exactly the keys plain decoding would give it
    (`tree_attention.exact_tree_attention`: sdpa, full attention and an unpadded prompt only)."""

    def __init__(self, model, exact: bool, prompt_mask: torch.Tensor | None):
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
        if exact and (self.sliding_window is not None or model.config._attn_implementation != "sdpa"):
            raise ValueError(
                "exact_attention=True reproduces plain decoding's sdpa attention over full-attention layers; "
                f"{type(model).__name__} uses {model.config._attn_implementation!r} attention"
                f"{' with a sliding window' if self.sliding_window is not None else ''}: load it with "
                "attn_implementation='sdpa', or drop exact_attention."
            )
        if exact and prompt_mask is not None and not prompt_mask.all():
            raise ValueError(
                "exact_attention=True needs every prompt token visible (plain decoding over a padded prompt uses a "
                "mask it cannot reproduce node by node): strip the padding, or drop exact_attention."
            )

    def verifying(self, model, tree: DraftTree, prefix_length: int):
        """Context for the verification forward of `tree` after `prefix_length` cache entries."""
        return exact_tree_attention(model, tree, prefix_length) if self.exact else contextlib.nullcontext()

    def verification_mask(self, tree: DraftTree, prefix_visible: torch.Tensor, dtype: torch.dtype):
        if self.sliding_window is None:
            return tree_attention_mask(tree.ancestors, prefix_visible, dtype)
        sliding = tree_attention_mask(tree.ancestors, prefix_visible, dtype, tree.depths, self.sliding_window)
        if not self.mixed:
            return sliding
        full = tree_attention_mask(tree.ancestors, prefix_visible, dtype)
        return {"full_attention": full, "sliding_attention": sliding}


def _tree_settings(draft: Eagle3DraftModel) -> TreeSettings:
    """The call's tree: its settings, else the draft config's defaults. A default size is capped at what the tree
    holds (`tree_top_k=1` alone drafts the whole chain); a size passed to the call must fit (`TreeSettings`)."""
    overrides = _call_settings.get()
    depth = overrides.get("tree_depth", draft.config.tree_depth)
    top_k = overrides.get("tree_top_k", draft.config.tree_top_k)
    default_total = min(draft.config.tree_total_tokens, max_candidates(depth, top_k))
    settings = TreeSettings(depth, top_k, overrides.get("tree_total_tokens", default_total))
    if settings.top_k > draft.config.draft_vocab_size:
        raise ValueError(f"tree_top_k={settings.top_k} exceeds the draft vocabulary ({draft.config.draft_vocab_size}).")
    return settings


def _keep_cache_entries(cache: DynamicCache, start: int, keep: torch.Tensor) -> None:
    """Of the cache entries from `start` on, keep only those at offsets `keep` (sorted), moved to be contiguous."""
    end = start + keep.numel()
    for layer in cache.layers:
        layer.keys[:, :, start:end] = layer.keys[:, :, start + keep]
        layer.values[:, :, start:end] = layer.values[:, :, start + keep]
        layer.keys, layer.values = layer.keys[:, :, :end], layer.values[:, :, :end]


class _TargetDistribution:
    """The target's processed next-token scores at tree nodes, exactly as plain decoding would compute them."""

    def __init__(self, logits_processor, input_ids: torch.Tensor, tree: DraftTree, logits: torch.Tensor):
        self.logits_processor, self.input_ids, self.tree, self.logits = logits_processor, input_ids, tree, logits

    def scores(self, path: list[int]) -> torch.Tensor:
        """`[V]` processed scores after the last node of `path` (root first), given the prefix and the path."""
        path_tokens = self.tree.tokens[path[1:]][None]
        prefix = torch.cat([self.input_ids, path_tokens], dim=-1)
        return self.logits_processor(prefix, self.logits[path[-1]][None].float())[0]


def _accept(proposal: DraftProposal, logits: torch.Tensor, input_ids, logits_processor, do_sample: bool,
            draft_to_target: torch.Tensor):
    """Verify the proposal's tree given the target's raw logits `[N + 1, V]` at its nodes.

    Returns `(path, bonus_token, scores)`: accepted node indices (root first) `[m]`, the bonus token `[1]`, and the
    processed scores `[m, V]` that produced the `m` emitted tokens.
    """
    tree = proposal.tree
    if not do_sample and len(logits_processor) == 0:
        # `max(-1).indices` is argmax with the same first-index tie rule, several times faster on bf16 CPU tensors
        target_choices = logits.max(-1).indices  # [N + 1]
        path = greedy_accept(tree, target_choices)
        return path, target_choices[path[-1], None], logits[path].float()

    target = _TargetDistribution(logits_processor, input_ids, tree, logits)
    path, path_scores = [0], []
    while True:
        scores = target.scores(path)
        path_scores.append(scores)
        child_nodes = children(tree, path[-1])
        if not do_sample:
            choice = scores.argmax(-1, keepdim=True)
            matching = child_nodes[tree.tokens[child_nodes] == choice]
            if matching.numel() == 0:
                return torch.tensor(path, device=logits.device), choice, torch.stack(path_scores)
            path.append(int(matching[0]))
            continue
        probs = scores.softmax(-1)
        if child_nodes.numel() == 0:
            residual = probs
        elif proposal.sampled is not None:  # a sampled chain, maybe next to a context continuation's token
            proposals = [
                torch.zeros_like(probs).index_add_(0, draft_to_target, proposal.draft_probs[child].to(probs.dtype))
                if proposal.sampled[child] else None
                for child in child_nodes.tolist()
            ]
            index, residual = accept_in_turn(
                probs, tree.tokens[child_nodes], proposals, torch.rand(child_nodes.numel(), device=probs.device)
            )
            if index >= 0:
                path.append(int(child_nodes[index]))
                continue
        else:
            index, residual = accept_among_children(
                probs, tree.tokens[child_nodes], torch.rand(child_nodes.numel(), device=probs.device)
            )
            if index >= 0:
                path.append(int(child_nodes[index]))
                continue
        bonus = torch.multinomial(residual, 1)
        return torch.tensor(path, device=logits.device), bonus, torch.stack(path_scores)


def eagle3_decoding(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    assistant_model: Eagle3DraftModel | None = None,
    **model_kwargs,
):
    """EAGLE-3 decoding loop with the signature of `GenerationMixin._assisted_decoding` (greedy and sampling)."""
    draft = assistant_model
    for unused in ("inputs_tensor", "tokenizer", "assistant_tokenizer"):  # used by generate's own criteria only
        model_kwargs.pop(unused, None)
    cache = model_kwargs.get("cache")
    if type(cache) is DynamicCache and cache.get_seq_length() == 0 and any(layer.is_sliding for layer in cache.layers):
        # A sliding-window layer keeps only the last window of entries; the cycle's cache compaction indexes entries
        # by sequence position, so keep them all (the verification masks apply the window).
        model_kwargs["cache"] = DynamicCache()
    _check_supported(model, draft, input_ids, generation_config, model_kwargs)
    exact = bool(_call_settings.get().get("exact_attention", False))
    attention = _TargetAttention(model, exact, model_kwargs.get("attention_mask"))
    draft.attach_target(model)
    settings = _tree_settings(draft)
    use_continuations = bool(_call_settings.get().get("ngram_candidates", draft.config.ngram_candidates))
    max_match, max_continuation = draft.config.ngram_max_match, draft.config.ngram_max_tokens
    continuation_acceptance = ContinuationAcceptance.prior(max_match)
    do_sample = generation_config.do_sample
    record_cycles = not do_sample and _recording_greedy_cycles.get()
    drafter = Eagle3Drafter(draft, settings, (generation_config.temperature or 1.0) if do_sample else None)
    stats = Eagle3GenerationStats(settings, shape_choice=_call_settings.get().get("shape_choice"))
    draft.generation_stats = stats
    stopwatch = _Stopwatch(stats, input_ids.device)
    start_time = time.perf_counter()
    layer_ids = draft.config.target_layer_ids
    return_dict = generation_config.return_dict_in_generate
    scores = () if return_dict and generation_config.output_scores else None
    raw_logits = () if return_dict and generation_config.output_logits else None
    cache = model_kwargs["cache"]

    # Prefill: the prompt through the target, its features through the draft.
    with stopwatch.time("prefill_seconds"):
        model_inputs = model.prepare_inputs_for_generation(input_ids, is_first_iteration=True, **model_kwargs)
        outputs = model(**model_inputs, output_hidden_states=layer_ids)
        attention_mask = model_kwargs.get("attention_mask")
        prefix_visible = (
            attention_mask[0].bool() if attention_mask is not None else torch.ones_like(input_ids[0], dtype=torch.bool)
        )
        prompt_positions = model_inputs.get("position_ids")
        if prompt_positions is None:
            prompt_positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        next_logits = outputs.logits[:, -1].float()  # [1, V]
        next_scores = logits_processor(input_ids, next_logits)
        if do_sample:
            next_token = torch.multinomial(next_scores.softmax(-1), 1)[0]
        else:
            next_token = next_scores.argmax(-1)
        features = torch.cat([outputs.hidden_states[i] for i in layer_ids], dim=-1)  # [1, L, 3 k_t]
        followers = torch.cat([input_ids[:, 1:], next_token[None]], dim=-1)
        drafter.extend(followers[:, prefix_visible], features[:, prefix_visible], prompt_positions[:, prefix_visible])
    root_position = int(prompt_positions[0, -1]) + 1
    new_tokens, step_scores, step_logits = next_token, next_scores, next_logits

    while True:
        # Emit, stopping exactly where plain decoding would: the criteria see each new token's prefix in turn.
        extended, kept, finished = torch.cat([input_ids, new_tokens[None]], dim=-1), input_ids.shape[1], False
        for token_scores, token_logits in zip(step_scores, step_logits):
            kept += 1
            if scores is not None:
                scores += (token_scores[None],)
            if raw_logits is not None:
                raw_logits += (token_logits[None],)
            if stopping_criteria(extended[:, :kept], scores)[0]:
                finished = True
                break
        new_tokens = new_tokens[: kept - input_ids.shape[1]]
        if stats.acceptance_lengths:  # a cycle cut by a stop counts only the tokens it emitted
            stats.acceptance_lengths[-1] = new_tokens.numel()
        input_ids = extended[:, :kept]
        if streamer is not None:
            streamer.put(new_tokens.cpu())
        if finished:
            break

        with stopwatch.time("draft_seconds"):
            continuation, match = (
                find_continuation(input_ids[0], max_match, max_continuation) if use_continuations else (None, 0)
            )
            log_rates = (
                continuation_acceptance.log_rates(match, continuation.numel(), continuation.device) if match else None
            )
            proposal = drafter.draft_tree(input_ids[0, -1], root_position, continuation, log_rates)
        tree = proposal.tree
        with stopwatch.time("verify_seconds"), attention.verifying(model, tree, prefix_visible.numel()):
            outputs = model(
                input_ids=tree.tokens[None],
                position_ids=(root_position + tree.depths)[None],
                attention_mask=attention.verification_mask(tree, prefix_visible, model.dtype),
                cache=cache,
                output_hidden_states=layer_ids,
                use_cache=True,
            )
        prefix_length = prefix_visible.numel()
        logits = outputs.logits[0]  # [N + 1, V], model dtype: argmax is exact, float32 only where scores are kept
        path, bonus, path_scores = _accept(proposal, logits, input_ids, logits_processor, do_sample,
                                           drafter.draft_to_target)
        if match:
            on_path = (proposal.continuation_nodes[:, None] == path[None, :]).any(-1)  # a prefix: [K]
            continuation_acceptance = continuation_acceptance.updated(
                match, proposal.continuation_nodes.numel(), int(on_path.sum())
            )
            stats.continuation_tokens += int(on_path.sum())
        new_tokens = torch.cat([tree.tokens[path[1:]], bonus])
        step_scores, step_logits = path_scores, logits[path].float()
        stats.acceptance_lengths.append(new_tokens.numel())
        if record_cycles:  # references only: nothing computed on the decoding path
            stats.greedy_cycles.append((tree, path))

        _keep_cache_entries(cache, prefix_length, path)
        prefix_visible = torch.cat([prefix_visible, prefix_visible.new_ones(path.numel())])
        features = torch.cat([outputs.hidden_states[i] for i in layer_ids], dim=-1)[:, path]
        accepted_positions = root_position + torch.arange(path.numel(), device=path.device)
        with stopwatch.time("draft_seconds"):
            drafter.extend(new_tokens[None], features, accepted_positions[None])
        root_position += path.numel()

    # A cycle cut short by a stop leaves cache entries past the last kept token: plain decoding has none of them.
    cache.crop(min(0, input_ids.shape[1] - 1 - cache.get_seq_length()))
    if streamer is not None:
        streamer.end()
    stats.total_seconds = time.perf_counter() - start_time
    if return_dict:
        return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores, logits=raw_logits, cache=cache)
    return input_ids


def _assistant_of(args: tuple, kwargs: dict):
    # `generate(inputs, generation_config, logits_processor, stopping_criteria, prefix_allowed_tokens_fn,
    #           synced_gpus, assistant_model, ...)`
    return kwargs.get("assistant_model", args[6] if len(args) > 6 else None)


def _without_assistant(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if "assistant_model" in kwargs:
        return args, {name: value for name, value in kwargs.items() if name != "assistant_model"}
    return args[:6] + (None,) + args[7:], kwargs


def _resolve_tree_shape(model, draft: Eagle3DraftModel, eagle3_kwargs: dict) -> dict:
    """The call's settings with `tree_shape` resolved: `"fixed"` (the default when any tree setting is passed)
    keeps them; `"auto"` (the draft config's `tree_shape` otherwise) adds the shape `calibration.choose_tree`
    predicts fastest here, or `tree_depth=None` to decode plainly, and the reason as `shape_choice`."""
    settings = dict(eagle3_kwargs)
    explicit = [name for name in TREE_KWARGS if name in settings]
    shape = settings.pop("tree_shape", None) or ("fixed" if explicit else draft.config.tree_shape)
    if shape not in ("fixed", "auto"):
        raise ValueError(f"tree_shape must be 'fixed' or 'auto', got {shape!r}.")
    if shape == "fixed":
        return settings
    if explicit:
        raise ValueError(f"tree_shape='auto' chooses the tree itself: drop {', '.join(explicit)} or tree_shape.")
    choice = choose_tree(model, draft, settings.get("ngram_candidates"))
    if choice.settings is None:
        return settings | {"tree_depth": None, "shape_choice": choice.reason}
    shape = choice.settings
    return settings | {"tree_depth": shape.depth, "tree_top_k": shape.top_k, "tree_total_tokens": shape.total_tokens,
                       "shape_choice": choice.reason}


def _check_device(draft: Eagle3DraftModel, model) -> None:
    """The draft runs in its own dtype (the target's features are cast to it, as transformers runs an assistant in
    the dtype it was loaded in), but on the target's device: it reads the target's hidden states every cycle."""
    embedding = model.get_input_embeddings().weight
    if embedding.device.type != "meta" and draft.device != embedding.device:
        raise ValueError(
            f"The draft is on {draft.device} and the target on {embedding.device}: EAGLE-3 drafts from the target's "
            "hidden states and shares its embedding. Move the draft with `draft.to(target.device)`."
        )


def _layered_settings(model, draft: Eagle3DraftModel, args: tuple, kwargs: dict, call_settings: dict) -> dict:
    """The call's EAGLE-3 settings, where transformers looks for an assistant's (`num_assistant_tokens` is read from
    the assistant's `generation_config`): the call's keyword arguments, over the call's `generation_config`, over
    the target's, over the draft's `generation_config` (the draft config's defaults come last, in `_tree_settings`).
    A level that sets `tree_shape="auto"` drops lower levels' tree sizes, one that sets sizes a lower `tree_shape`.
    transformers' own assisted-generation sizes are read from the assistant's `generation_config` only: set there,
    they are refused, as they are in the call."""
    ignored = sorted(name for name in ASSISTED_ONLY_KWARGS if getattr(draft.generation_config, name, None) is not None)
    if ignored:
        raise TypeError(
            f"The draft's generation_config sets {', '.join(ignored)}, which size transformers' own assisted "
            "generation, which EAGLE-3 replaces: unset them, and set tree_depth / tree_top_k / tree_total_tokens "
            "(or tree_shape='auto') instead."
        )
    call_config = kwargs.get("generation_config", args[1] if len(args) > 1 else None)
    levels = [
        {name: getattr(config, name) for name in EAGLE3_KWARGS if getattr(config, name, None) is not None}
        for config in (draft.generation_config, model.generation_config, call_config)
    ]
    settings = {}
    for level in (*levels, call_settings):
        if level.get("tree_shape") == "auto":
            settings = {name: value for name, value in settings.items() if name not in TREE_KWARGS}
        elif "tree_shape" not in level and any(name in level for name in TREE_KWARGS):
            settings.pop("tree_shape", None)
        settings |= level
    return settings


def _wrap_generate(original):
    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        eagle3_kwargs = {name: kwargs.pop(name) for name in EAGLE3_KWARGS if name in kwargs}
        draft = _assistant_of(args, kwargs)
        if not isinstance(draft, Eagle3DraftModel):
            if eagle3_kwargs:
                raise TypeError(f"{sorted(eagle3_kwargs)} only apply with an Eagle3DraftModel as assistant_model.")
            return original(self, *args, **kwargs)
        ignored = sorted(name for name in ASSISTED_ONLY_KWARGS if name in kwargs)
        if ignored:
            raise TypeError(
                f"{', '.join(ignored)} size transformers' own assisted generation, which EAGLE-3 replaces: drop them, "
                "and set tree_depth / tree_top_k / tree_total_tokens (or tree_shape='auto') instead."
            )
        # before transformers' own assistant checks, which would ask for an assistant tokenizer on a vocabulary mismatch
        adopt_target_layers(draft.config, self)
        check_compatibility(draft.config, self)
        _check_device(draft, self)
        record_target_special_tokens(draft.config, self)
        settings = _resolve_tree_shape(self, draft, _layered_settings(self, draft, args, kwargs, eagle3_kwargs))
        if "tree_depth" in settings and settings["tree_depth"] is None:  # no tree pays here: plain decoding
            logger.warning_once(settings["shape_choice"])
            draft.generation_stats = Eagle3GenerationStats(None, shape_choice=settings["shape_choice"])
            plain_args, plain_kwargs = _without_assistant(args, kwargs)
            return original(self, *plain_args, **plain_kwargs)
        token = _call_settings.set(settings)
        try:
            return original(self, *args, **kwargs)
        finally:
            _call_settings.reset(token)

    return generate


def _wrap_validate_generation_mode(original):
    @functools.wraps(original)
    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        if isinstance(generation_mode_kwargs.get("assistant_model"), Eagle3DraftModel):
            if generation_mode != GenerationMode.ASSISTED_GENERATION:
                raise ValueError(
                    f"EAGLE-3 decoding supports greedy decoding and sampling (num_beams=1), not {generation_mode}: "
                    "drop num_beams / penalty_alpha / constraints, or generate without assistant_model."
                )
            if generation_config.num_return_sequences > 1:
                raise ValueError(
                    f"EAGLE-3 decoding returns one sequence per call, got num_return_sequences="
                    f"{generation_config.num_return_sequences}: call generate several times instead."
                )
            if generation_config.prompt_lookup_num_tokens is not None or "assistant_tokenizer" in generation_mode_kwargs:
                raise ValueError(
                    "An Eagle3DraftModel shares the target's tokenizer and replaces prompt lookup: drop "
                    "assistant_tokenizer / prompt_lookup_num_tokens."
                )
        return original(self, generation_mode, generation_config, generation_mode_kwargs)

    return _validate_generation_mode


def _wrap_assisted_decoding(original):
    @functools.wraps(original)
    def _assisted_decoding(self, *args, assistant_model=None, **kwargs):
        if isinstance(assistant_model, Eagle3DraftModel):
            return eagle3_decoding(self, *args, assistant_model=assistant_model, **kwargs)
        return original(self, *args, assistant_model=assistant_model, **kwargs)

    return _assisted_decoding


def install() -> None:
    """Route `generate(assistant_model=<Eagle3DraftModel>)` to EAGLE-3 decoding (idempotent)."""
    for name, wrap in (
        ("generate", _wrap_generate),
        ("_validate_generation_mode", _wrap_validate_generation_mode),
        ("_assisted_decoding", _wrap_assisted_decoding),
    ):
        original = getattr(GenerationMixin, name)
        if not getattr(original, "_hf_eagle3_hook", False):
            hooked = wrap(original)
            hooked._hf_eagle3_hook = True
            setattr(GenerationMixin, name, hooked)
