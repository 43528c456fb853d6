"""EAGLE-3 inside `generate`: one draft tree per sequence, the whole batch verified in one target forward.

Two entry points run the same decoding loop, `eagle3_generate`, through transformers' `custom_generate=` (the
sanctioned way to bring a decoding loop to `generate`):

- `target.generate(**inputs, custom_generate=eagle3_generate, draft=draft, tree_depth=...)`: transformers hands the
  callable its prepared inputs, processors and stopping criteria, and the callable's own keyword arguments (those
  `GenerationMixin._sample` does not take): the draft, the tree settings `tree_depth`, `tree_top_k`,
  `tree_total_tokens`, `tree_shape`, `ngram_candidates`, `exact_attention`, `record_greedy_cycles`, and
  `eagle3_streamer` (transformers does not pass `streamer` to a callable);
- `target.generate(**inputs, assistant_model=draft, tree_depth=...)`: importing `hf_eagle3` wraps the one method
  `GenerationMixin.generate` (`install`), which re-issues a call whose `assistant_model` is an `Eagle3DraftModel`
  (read by binding generate's own signature) as the call above, and leaves every other call untouched. A draft
  repository can carry `custom_generate/generate.py` for `custom_generate="<repo>", trust_remote_code=True` too.

Everything a call needs is its arguments: no module-level state. With `tree_shape="auto"` the shape predicted fastest
on this machine at this batch size is used (`calibration.choose_tree`), or plain decoding when none is predicted to
pay. The call's statistics (`Eagle3GenerationStats`) come back in the output with `return_dict_in_generate=True`
(`Eagle3GenerateOutput.eagle3_stats`) and as `draft.generation_stats`, the last call of the calling thread.

One decoding cycle: each unfinished row's drafter grows a tree below its last generated token (the root), into which
a context n-gram continuation is merged with `ngram_candidates` (`ngram`); the target verifies every row's root and
tree in one forward, each row with its own tree attention mask over its visible cache entries and its own positions
(with `exact_attention=True`, batch size 1, each node over exactly plain decoding's keys instead: `tree_attention`),
returning the hidden states the draft fuses; each row accepts its own path and a bonus token. The target's cache keeps,
for every row, its accepted entries, contiguous after the previous prefix; a row that accepted fewer than the longest
leaves unused entries, which its visibility mask hides from then on (the cache grows by the longest accepted path per
cycle; plain decoding over a left-padded batch hides its padding the same way). Each row's drafter feeds its accepted
positions' target features to the draft, over that row's own tokens only (no padding reaches the draft). Finished
rows leave the batch; the output pads them exactly as plain batched decoding does.
"""

import contextlib
import functools
import inspect
import time
from dataclasses import dataclass, field

import torch
from transformers import GenerationMixin
from transformers.cache_utils import DynamicCache, DynamicLayer, StaticCache, StaticLayer
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import logging

from ..modeling_eagle3 import Eagle3DraftModel
from .calibration import choose_tree
from .compatibility import adopt_target_layers, check_compatibility, record_target_special_tokens
from .drafter import DraftProposal, Eagle3Drafter, TreeSettings, max_candidates
from .exact_attention import exact_tree_attention
from .ngram import ContinuationAcceptance, find_continuation
from .tree import DraftTree, tree_attention_mask
from .verify import accept_among_children, accept_in_turn, children, greedy_accept

TREE_KWARGS = ("tree_depth", "tree_top_k", "tree_total_tokens")
# settings a call, its generation config, the target's or the draft's generation config may hold (`_layered_settings`)
SETTING_KWARGS = (*TREE_KWARGS, "tree_shape", "exact_attention", "ngram_candidates")
EAGLE3_KWARGS = (*SETTING_KWARGS, "record_greedy_cycles")
# transformers' settings for its own candidate generators: they would be silently ignored
ASSISTED_ONLY_KWARGS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
logger = logging.get_logger(__name__)


def _mean(lengths: list[int]) -> float:
    return sum(lengths) / max(len(lengths), 1)


@dataclass
class Eagle3RowStats:
    """What EAGLE-3 decoding did for one sequence of a call.

    `acceptance_lengths[i]` is the number of tokens the row's cycle `i` emitted from one target forward (accepted
    drafted tokens + the bonus token); the first token (from the prefill) is not counted, nor cycles after the row
    stopped. `greedy_cycles` holds each cycle's `DraftTree` and accepted path (node indices, root first), for greedy
    decoding with `record_greedy_cycles=True` only. With `ngram_candidates`, `continuation_tokens` counts the accepted
    drafted tokens that the context continuation proposed (alone or with the draft)."""

    acceptance_lengths: list[int] = field(default_factory=list)
    greedy_cycles: list[tuple[DraftTree, torch.Tensor]] = field(default_factory=list)
    continuation_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """τ of this row: mean tokens per target forward."""
        return _mean(self.acceptance_lengths)


@dataclass
class Eagle3GenerationStats:
    """What one EAGLE-3 `generate` call did: `rows[b]` for row `b` of the batch (`Eagle3RowStats`), the time split of
    the whole call (wall-clock seconds) and `num_cycles`, the verification forwards of the target.

    The row fields read across the batch: `acceptance_lengths` and `greedy_cycles` list every row's cycles, row after
    row (for one sequence, its own), `continuation_tokens` sums them. With `tree_shape="auto"`, `shape_choice` says
    which shape was chosen and why; `settings` is `None` when the call decoded plainly (the draft was not run).
    """

    settings: TreeSettings | None
    rows: list[Eagle3RowStats] = field(default_factory=list)
    num_cycles: int = 0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    shape_choice: str | None = None

    @property
    def acceptance_lengths(self) -> list[int]:
        return [length for row in self.rows for length in row.acceptance_lengths]

    @property
    def greedy_cycles(self) -> list[tuple[DraftTree, torch.Tensor]]:
        return [cycle for row in self.rows for cycle in row.greedy_cycles]

    @property
    def continuation_tokens(self) -> int:
        return sum(row.continuation_tokens for row in self.rows)

    @property
    def mean_acceptance_length(self) -> float:
        """τ: mean tokens per target forward and row (verification cycles only)."""
        return _mean(self.acceptance_lengths)

    @property
    def other_seconds(self) -> float:
        """Time of the cycles spent outside drafting and verification: acceptance, bookkeeping, Python."""
        return self.total_seconds - self.prefill_seconds - self.draft_seconds - self.verify_seconds


@dataclass
class Eagle3GenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` of an EAGLE-3 `generate` call, with what the call did (`eagle3_stats`).

    `cache` is the target's cache for one sequence; for a batch it is `None` (rows leave the batch as they finish,
    and the kept entries of rows that accepted fewer tokens are interleaved with unused ones)."""

    eagle3_stats: Eagle3GenerationStats | None = None


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


def _check_generation_mode(generation_config) -> None:
    if generation_config.prompt_lookup_num_tokens is not None:
        raise ValueError(
            "EAGLE-3 replaces prompt lookup (its context candidates are `ngram_candidates=True`): drop "
            "prompt_lookup_num_tokens."
        )
    mode = generation_config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(
            f"EAGLE-3 decoding supports greedy decoding and sampling (num_beams=1), not {mode}: drop num_beams / "
            "penalty_alpha / constraints, or generate without the EAGLE-3 draft."
        )
    if generation_config.num_return_sequences > 1:
        raise ValueError(
            f"EAGLE-3 decoding returns one sequence per prompt, got num_return_sequences="
            f"{generation_config.num_return_sequences}: repeat the prompt in the batch instead."
        )


def _check_supported(model, input_ids: torch.Tensor, generation_config, model_kwargs, streamer) -> None:
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError(
            "EAGLE-3 decoding does not return attentions or hidden states: drop output_attentions / "
            "output_hidden_states, or generate without assistant_model."
        )
    batch_size = input_ids.shape[0]
    if batch_size > 1 and generation_config.return_dict_in_generate and (
        generation_config.output_scores or generation_config.output_logits
    ):
        raise ValueError(
            f"EAGLE-3 decoding returns scores and logits for one sequence, got a batch of {batch_size} (a batch's "
            "rows advance by different numbers of tokens per step): drop output_scores / output_logits, or "
            "generate one sequence per call."
        )
    if batch_size > 1 and streamer is not None:
        raise ValueError(
            f"EAGLE-3 decoding streams one sequence, got a batch of {batch_size}: drop the streamer, or generate one "
            "sequence per call."
        )
    cache = model_kwargs.get("cache")
    layer_type = {DynamicCache: DynamicLayer, StaticCache: StaticLayer}.get(type(cache))
    if layer_type is None or any(type(layer) is not layer_type for layer in cache.layers):
        raise ValueError(
            "EAGLE-3 decoding needs a plain DynamicCache or StaticCache on the target (full attention), got "
            f"{type(cache).__name__}"
            f"{' with ' + ', '.join(sorted({type(layer).__name__ for layer in cache.layers})) if cache else ''}: "
            "drop the cache argument, or use cache_implementation='static' / 'dynamic'."
        )
    if type(cache) is StaticCache and batch_size > 1:
        raise ValueError(
            f"EAGLE-3 decoding with a static cache generates one sequence per call, got a batch of {batch_size}: drop "
            "cache_implementation='static', or generate one sequence per call."
        )
    if cache.get_seq_length() and batch_size > 1:
        raise ValueError("EAGLE-3 decoding of a batch starts from an empty cache: drop the cache argument.")
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
    (`tree_attention.exact_tree_attention`: sdpa, full attention, one unpadded sequence only)."""

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
        if exact and (self.sliding_window is not None or model.config._attn_implementation != "sdpa"):
            raise ValueError(
                "exact_attention=True reproduces plain decoding's sdpa attention over full-attention layers; "
                f"{type(model).__name__} uses {model.config._attn_implementation!r} attention"
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

    def verifying(self, model, trees: list[DraftTree], prefix_length: int):
        """Context for the verification forward of `trees` after `prefix_length` cache entries."""
        return exact_tree_attention(model, trees[0], prefix_length) if self.exact else contextlib.nullcontext()

    def verification_mask(self, trees: list[DraftTree], prefix_visible: torch.Tensor, key_positions: torch.Tensor,
                          dtype: torch.dtype, key_length: int | None = None):
        """Masks of one tree per row, each over its row's visible prefix (`[B, P]`); `key_positions` `[B, P + n]`
        are the positions of the prefix's cache entries and of the nodes (what a sliding window is measured in).
        `key_length`: a static cache's length, whose entries past the nodes are hidden (full attention only)."""
        ancestors = torch.stack([tree.ancestors for tree in trees])
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


def _tree_settings(draft: Eagle3DraftModel, overrides: dict) -> TreeSettings:
    """The call's tree: its settings, else the draft config's defaults. A default size is capped at what the tree
    holds (`tree_top_k=1` alone drafts the whole chain); a size passed to the call must fit (`TreeSettings`)."""
    depth = overrides.get("tree_depth", draft.config.tree_depth)
    top_k = overrides.get("tree_top_k", draft.config.tree_top_k)
    default_total = min(draft.config.tree_total_tokens, max_candidates(depth, top_k))
    settings = TreeSettings(depth, top_k, overrides.get("tree_total_tokens", default_total))
    if settings.top_k > draft.config.draft_vocab_size:
        raise ValueError(f"tree_top_k={settings.top_k} exceeds the draft vocabulary ({draft.config.draft_vocab_size}).")
    return settings


def _keep_cache_entries(cache: DynamicCache | StaticCache, start: int, keep: torch.Tensor) -> None:
    """Of each row's cache entries from `start` on, keep those at offsets `keep[b]` (`[B, M]`, sorted), moved to be
    contiguous; where a row keeps fewer than `M`, its `keep` repeats any offset (the row's mask hides those). A static
    cache's tensors are updated in place (a compiled forward holds their addresses)."""
    end = start + keep.shape[1]
    for layer in cache.layers:
        index = (start + keep)[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
        layer.keys[:, :, start:end] = layer.keys.gather(2, index)
        layer.values[:, :, start:end] = layer.values.gather(2, index)
    cache.crop(end - int(cache.get_seq_length()))


def _sized_static_cache(model, cache, generation_config, settings: TreeSettings, exact: bool):
    """`(cache, key_length)`: a static cache with room for the call's last tree, and its length (what every
    verification mask spans); a dynamic cache as it is, with `None`. A static cache too short is replaced while empty
    and refused once filled."""
    if type(cache) is not StaticCache:
        return cache, None
    if exact:
        raise ValueError("exact_attention=True verifies node by node over a dynamic cache: drop "
                         "cache_implementation='static', or drop exact_attention.")
    needed = generation_config.max_length + settings.total_tokens  # a whole tree after at most max_length - 1 tokens
    if cache.layers[0].max_cache_len < needed:
        if cache.get_seq_length():
            raise ValueError(f"EAGLE-3 decoding into this static cache needs room for {needed} tokens (max_length "
                             f"plus the tree's {settings.total_tokens}): pass a StaticCache of max_cache_len >= "
                             f"{needed}.")
        cache = StaticCache(config=model.config, max_cache_len=needed)
    return cache, cache.layers[0].max_cache_len


class _TargetDistribution:
    """The target's processed next-token scores at tree nodes of row `row` of a batch of `batch_size`, exactly as plain
    decoding would compute them. Processors may hold per-row state (a left-padded row's prompt length, ...), so the
    row's prefix goes through them at its own index, in a batch of copies of it."""

    def __init__(self, logits_processor, input_ids: torch.Tensor, tree: DraftTree, logits: torch.Tensor, row: int,
                 batch_size: int):
        self.logits_processor, self.input_ids, self.tree, self.logits = logits_processor, input_ids, tree, logits
        self.row, self.batch_size = row, batch_size

    def scores(self, path: list[int]) -> torch.Tensor:
        """`[V]` processed scores after the last node of `path` (root first), given the prefix and the path."""
        path_tokens = self.tree.tokens[path[1:]][None]
        prefix = torch.cat([self.input_ids, path_tokens], dim=-1).expand(self.batch_size, -1)
        node_logits = self.logits[path[-1]][None].float().repeat(self.batch_size, 1)
        return self.logits_processor(prefix, node_logits)[self.row]


def _accept(proposal: DraftProposal, logits: torch.Tensor, input_ids, logits_processor, do_sample: bool,
            draft_to_target: torch.Tensor, row: int = 0, batch_size: int = 1):
    """Verify the proposal's tree given the target's raw logits `[N + 1, V]` at its nodes; `input_ids` `[1, L]` is
    row `row`'s sequence in a batch of `batch_size`.

    Returns `(path, bonus_token, scores)`: accepted node indices (root first) `[m]`, the bonus token `[1]`, and the
    processed scores `[m, V]` that produced the `m` emitted tokens.
    """
    tree = proposal.tree
    if not do_sample and len(logits_processor) == 0:
        # `max(-1).indices` is argmax with the same first-index tie rule, several times faster on bf16 CPU tensors
        target_choices = logits.max(-1).indices  # [N + 1]
        path = greedy_accept(tree, target_choices)
        return path, target_choices[path[-1], None], logits[path].float()

    target = _TargetDistribution(logits_processor, input_ids, tree, logits, row, batch_size)
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


class _Row:
    """One sequence of the batch: its tokens so far (left padding included: what plain decoding's stopping criteria
    and logits processors see), its drafter, its context-continuation acceptance, its statistics, and the length at
    which the stopping criteria first held."""

    def __init__(self, tokens: torch.Tensor, visible: torch.Tensor, drafter: Eagle3Drafter,
                 continuation_acceptance: ContinuationAcceptance):
        self.tokens = tokens  # [L]
        self.context_start = int(visible.int().argmax())  # the first visible token: left padding is no context
        self.drafter = drafter
        self.continuation_acceptance = continuation_acceptance
        self.stats = Eagle3RowStats()
        self.stop_length: int | None = None
        self.scores: list[torch.Tensor] = []  # [1, V] per emitted token, with output_scores
        self.logits: list[torch.Tensor] = []  # [1, V] per emitted token, with output_logits
        self.match = 0  # length of the n-gram match behind this cycle's context continuation (0: none)

    def emit(self, new_tokens, step_scores, step_logits, stopping_criteria, max_length: int, keep_scores: bool,
             keep_logits: bool) -> torch.Tensor:
        """Append `new_tokens`, stopping exactly where plain decoding would: the criteria see each new token's prefix
        in turn. A row that has stopped and decodes on (see `eagle3_generate`) only respects `max_length`. Returns
        the tokens appended."""
        if self.stop_length is not None:
            new_tokens = new_tokens[: max_length - self.tokens.numel()]
            self.tokens = torch.cat([self.tokens, new_tokens])
            return new_tokens
        extended, kept = torch.cat([self.tokens, new_tokens]), self.tokens.numel()
        for token_scores, token_logits in zip(step_scores, step_logits):
            kept += 1
            if keep_scores:
                self.scores.append(token_scores[None])
            if keep_logits:
                self.logits.append(token_logits[None])
            if stopping_criteria(extended[None, :kept], tuple(self.scores) if keep_scores else None)[0]:
                self.stop_length = kept
                break
        new_tokens = new_tokens[: kept - self.tokens.numel()]
        if self.stop_length is not None and self.stats.acceptance_lengths:  # a cut cycle counts the tokens it emitted
            self.stats.acceptance_lengths[-1] = new_tokens.numel()
        self.tokens = extended[:kept]
        return new_tokens

    def propose(self, root_position: int, use_continuations: bool, max_match: int, max_tokens: int) -> DraftProposal:
        continuation, self.match = (
            find_continuation(self.tokens[self.context_start :], max_match, max_tokens) if use_continuations
            else (None, 0)
        )
        log_rates = (
            self.continuation_acceptance.log_rates(self.match, continuation.numel(), continuation.device)
            if self.match else None
        )
        return self.drafter.draft_tree(self.tokens[-1], root_position, continuation, log_rates)

    def accepted(self, proposal: DraftProposal, path: torch.Tensor, record_cycle: bool) -> None:
        counted = self.stop_length is None  # cycles of a row decoding on after its stop are not its statistics
        if self.match:
            on_path = int((proposal.continuation_nodes[:, None] == path[None, :]).any(-1).sum())  # a prefix: [K]
            self.continuation_acceptance = self.continuation_acceptance.updated(
                self.match, proposal.continuation_nodes.numel(), on_path
            )
            self.stats.continuation_tokens += on_path if counted else 0
        if counted:
            self.stats.acceptance_lengths.append(path.numel())  # accepted drafted tokens + the bonus token
            if record_cycle:  # references only: nothing computed on the decoding path
                self.stats.greedy_cycles.append((proposal.tree, path))


def _resolve_tree_shape(model, draft: Eagle3DraftModel, overrides: dict, tree_shape: str | None,
                        ngram_candidates: bool, batch_size: int) -> tuple[TreeSettings | None, str | None]:
    """The call's tree and why: `"fixed"` (the default when any tree setting is passed) takes the call's settings
    and the draft config's defaults; `"auto"` (the draft config's `tree_shape` otherwise) the shape
    `calibration.choose_tree` predicts fastest here at this batch size, or `None` (decode plainly) and the reason."""
    explicit = [name for name in TREE_KWARGS if name in overrides]
    shape = tree_shape or ("fixed" if explicit else draft.config.tree_shape)
    if shape not in ("fixed", "auto"):
        raise ValueError(f"tree_shape must be 'fixed' or 'auto', got {shape!r}.")
    if shape == "fixed":
        return _tree_settings(draft, overrides), None
    if explicit:
        raise ValueError(f"tree_shape='auto' chooses the tree itself: drop {', '.join(explicit)} or tree_shape.")
    choice = choose_tree(model, draft, ngram_candidates, batch_size)
    return choice.settings, choice.reason


def eagle3_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    *,
    draft: Eagle3DraftModel | None = None,
    tree_depth: int | None = None,
    tree_top_k: int | None = None,
    tree_total_tokens: int | None = None,
    tree_shape: str | None = None,
    ngram_candidates: bool | None = None,
    exact_attention: bool | None = None,
    record_greedy_cycles: bool = False,
    eagle3_streamer=None,
    **model_kwargs,
):
    """EAGLE-3 decoding (greedy and sampling, batches left-padded as transformers pads them), as a `custom_generate`
    callable: `target.generate(**inputs, custom_generate=eagle3_generate, draft=draft)`.

    Args:
        draft: the `Eagle3DraftModel` made for `model`.
        tree_depth, tree_top_k, tree_total_tokens: the draft tree. These settings, `tree_shape`, `ngram_candidates`
            and `exact_attention` are also read from the call's generation config (as `generate` prepared it: the
            call's over the target's) and the draft's `generation_config`, then the draft config
            (`_layered_settings`).
        tree_shape: `"fixed"` (those settings) or `"auto"` (the shape predicted fastest on this machine at this batch
            size, or plain decoding when none pays; default: the draft config's `tree_shape`).
        ngram_candidates: merge context n-gram continuations into each tree (default: the draft config's).
        exact_attention: verify each node over exactly plain decoding's keys (one unpadded sequence, sdpa).
        record_greedy_cycles: keep every greedy cycle's tree and accepted path in the statistics.
        eagle3_streamer: a streamer (transformers does not pass `streamer` to a `custom_generate` callable).

    Returns the sequences, or with `return_dict_in_generate=True` an `Eagle3GenerateOutput` carrying the call's
    statistics; `draft.generation_stats` holds them too (the last call of the calling thread).
    """
    if not isinstance(draft, Eagle3DraftModel):
        raise TypeError(
            "eagle3_generate decodes with an EAGLE-3 draft: call generate(..., custom_generate=eagle3_generate, "
            f"draft=<Eagle3DraftModel>) or generate(..., assistant_model=<Eagle3DraftModel>); got draft={draft!r}."
        )
    streamer = eagle3_streamer if eagle3_streamer is not None else streamer
    for unused in ("inputs_tensor", "tokenizer", "assistant_tokenizer"):  # used by generate's own criteria only
        model_kwargs.pop(unused, None)
    _check_generation_mode(generation_config)
    adopt_target_layers(draft.config, model)
    check_compatibility(draft.config, model)
    _check_device(draft, model)
    record_target_special_tokens(draft.config, model)
    call_settings = dict(zip(SETTING_KWARGS, (tree_depth, tree_top_k, tree_total_tokens, tree_shape, exact_attention,
                                              ngram_candidates)))
    layered = _layered_settings(draft, generation_config,
                                {name: value for name, value in call_settings.items() if value is not None})
    use_continuations = bool(layered.get("ngram_candidates", draft.config.ngram_candidates))
    overrides = {name: layered[name] for name in TREE_KWARGS if name in layered}
    settings, shape_choice = _resolve_tree_shape(model, draft, overrides, layered.get("tree_shape"),
                                                 use_continuations, input_ids.shape[0])
    if streamer is not None:
        streamer.put(input_ids.cpu())
    if settings is None:  # no tree pays here: plain decoding, the draft is not run
        logger.warning_once(shape_choice)
        stats = Eagle3GenerationStats(None, shape_choice=shape_choice)
        draft.generation_stats = stats
        # the loop `generate` itself runs for greedy decoding and sampling
        output = model._sample(input_ids, logits_processor, stopping_criteria, generation_config,
                               streamer=streamer, **model_kwargs)
        if not generation_config.return_dict_in_generate:
            return output
        return Eagle3GenerateOutput(**output, eagle3_stats=stats)
    return _decode(model, draft, settings, shape_choice, input_ids, logits_processor, stopping_criteria,
                   generation_config, streamer, bool(layered.get("exact_attention", False)), use_continuations,
                   record_greedy_cycles,
                   model_kwargs)


def _decode(model, draft: Eagle3DraftModel, settings: TreeSettings, shape_choice: str | None, input_ids,
            logits_processor, stopping_criteria, generation_config, streamer, exact: bool, use_continuations: bool,
            record_greedy_cycles: bool, model_kwargs: dict):
    """The decoding loop of `eagle3_generate`.

    Rows stop as plain batched decoding stops them: with an EOS criterion a row that stops is padded with the pad
    token until every row has stopped; without one (stop strings or `max_length` only), plain decoding goes on
    computing the rows that stopped until the last row stops, so a stopped row decodes on here too, up to the
    length of the longest row."""
    cache = model_kwargs.get("cache")
    if type(cache) is DynamicCache and cache.get_seq_length() == 0 and any(layer.is_sliding for layer in cache.layers):
        # A sliding-window layer keeps only the last window of entries; the cycle's cache compaction indexes entries
        # by sequence position, so keep them all (the verification masks apply the window).
        model_kwargs["cache"] = cache = DynamicCache()
    _check_supported(model, input_ids, generation_config, model_kwargs, streamer)
    batch_size, device = input_ids.shape[0], input_ids.device
    attention = _TargetAttention(model, exact, model_kwargs.get("attention_mask"), batch_size)
    cache, static_length = _sized_static_cache(model, cache, generation_config, settings, exact)
    model_kwargs["cache"] = cache
    # As `_sample` does: the forwards after the prefill compiled where transformers compiles them (a static cache on
    # an accelerator, or `compile_config._compile_all_devices`), one graph per tree size.
    compiled = model._valid_auto_compile_criteria(model_kwargs, generation_config)
    verify_forward = model.get_compiled_call(generation_config.compile_config) if compiled else model
    draft.attach_target(model)
    do_sample = generation_config.do_sample
    temperature = (generation_config.temperature or 1.0) if do_sample else None
    max_match, max_continuation = draft.config.ngram_max_match, draft.config.ngram_max_tokens
    record_cycles = not do_sample and record_greedy_cycles
    stats = Eagle3GenerationStats(settings, shape_choice=shape_choice)
    draft.generation_stats = stats
    stopwatch = _Stopwatch(stats, device)
    start_time = time.perf_counter()
    layer_ids = draft.config.target_layer_ids
    return_dict = generation_config.return_dict_in_generate
    keep_scores = bool(return_dict and generation_config.output_scores)
    keep_logits = bool(return_dict and generation_config.output_logits)
    pad_stopped_rows = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)  # as `_sample` pads
    max_length = generation_config.max_length

    # Prefill: the prompts through the target, each row's visible features through its drafter.
    with stopwatch.time("prefill_seconds"):
        model_inputs = model.prepare_inputs_for_generation(input_ids, is_first_iteration=True, **model_kwargs)
        outputs = model(**model_inputs, output_hidden_states=layer_ids)
        attention_mask = model_kwargs.get("attention_mask")
        prefix_visible = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids).bool()
        key_positions = model_inputs.get("position_ids")  # [B, P]: positions of the cache entries
        if key_positions is None:
            key_positions = torch.arange(input_ids.shape[1], device=device)[None]
        key_positions = key_positions.expand(batch_size, -1)
        next_logits = outputs.logits[:, -1].float()  # [B, V]
        next_scores = logits_processor(input_ids, next_logits)
        next_tokens = torch.multinomial(next_scores.softmax(-1), 1)[:, 0] if do_sample else next_scores.argmax(-1)
        features = torch.cat([outputs.hidden_states[i] for i in layer_ids], dim=-1)  # [B, P, 3 k_t]
        followers = torch.cat([input_ids[:, 1:], next_tokens[:, None]], dim=-1)
        rows = []
        for b in range(batch_size):
            visible = prefix_visible[b]
            row = _Row(input_ids[b], visible, Eagle3Drafter(draft, settings, temperature),
                       ContinuationAcceptance.prior(max_match))
            row.drafter.extend(followers[b, visible][None], features[b, visible][None], key_positions[b, visible][None])
            rows.append(row)
    stats.rows = [row.stats for row in rows]
    root_positions = key_positions[:, -1] + 1  # [B]: position of each row's root (its last token, not yet cached)
    pending = [(next_tokens[b, None], next_scores[b, None], next_logits[b, None]) for b in range(batch_size)]
    in_batch = list(range(batch_size))  # the rows the target's cache holds, in its order

    while True:
        for b, (new_tokens, step_scores, step_logits) in zip(in_batch, pending):
            emitted = rows[b].emit(new_tokens, step_scores, step_logits, stopping_criteria, max_length, keep_scores,
                                   keep_logits)
            if streamer is not None:
                streamer.put(emitted.cpu())
        stop_lengths = [row.stop_length for row in rows]
        final_length = max(stop_lengths) if None not in stop_lengths else max_length
        decoding = [
            index for index, b in enumerate(in_batch)
            if rows[b].stop_length is None
            or (not pad_stopped_rows and rows[b].tokens.numel() < min(final_length, max_length))
        ]
        if not decoding:
            break
        if len(decoding) < len(in_batch):  # rows that are done leave the batch
            index = torch.tensor(decoding, device=device)
            cache.batch_select_indices(index)
            prefix_visible, key_positions = prefix_visible[index], key_positions[index]
            root_positions = root_positions[index]
            in_batch = [in_batch[i] for i in decoding]

        with stopwatch.time("draft_seconds"):
            proposals = [rows[b].propose(int(position), use_continuations, max_match, max_continuation)
                         for b, position in zip(in_batch, root_positions)]
        trees = [proposal.tree for proposal in proposals]
        prefix_length = prefix_visible.shape[1]
        node_positions = root_positions[:, None] + torch.stack([tree.depths for tree in trees])  # [b, n]
        with stopwatch.time("verify_seconds"), attention.verifying(model, trees, prefix_length):
            outputs = verify_forward(
                input_ids=torch.stack([tree.tokens for tree in trees]),
                position_ids=node_positions,
                attention_mask=attention.verification_mask(
                    trees, prefix_visible, torch.cat([key_positions, node_positions], dim=1), model.dtype,
                    static_length
                ),
                cache=cache,
                output_hidden_states=layer_ids,
                use_cache=True,
            )
        stats.num_cycles += 1
        features = torch.cat([outputs.hidden_states[i] for i in layer_ids], dim=-1)  # [b, n, 3 k_t]
        paths, pending = [], []
        for index, (b, proposal) in enumerate(zip(in_batch, proposals)):
            logits = outputs.logits[index]  # [n, V], model dtype: argmax is exact, float32 only where scores are kept
            path, bonus, path_scores = _accept(proposal, logits, rows[b].tokens[None], logits_processor, do_sample,
                                               rows[b].drafter.draft_to_target, b, batch_size)
            rows[b].accepted(proposal, path, record_cycles)
            pending.append((torch.cat([proposal.tree.tokens[path[1:]], bonus]), path_scores, logits[path].float()))
            paths.append(path)

        # Each row keeps its accepted entries; rows that accepted fewer leave entries their mask hides from now on.
        lengths = torch.tensor([path.numel() for path in paths], device=device)
        offsets = torch.arange(int(lengths.max()), device=device)
        keep = torch.stack([torch.cat([path, path.new_zeros(offsets.numel() - path.numel())]) for path in paths])
        _keep_cache_entries(cache, prefix_length, keep)
        prefix_visible = torch.cat([prefix_visible, offsets[None] < lengths[:, None]], dim=1)
        key_positions = torch.cat([key_positions, root_positions[:, None] + offsets], dim=1)
        with stopwatch.time("draft_seconds"):
            for index, (b, path) in enumerate(zip(in_batch, paths)):
                positions = root_positions[index] + offsets[: path.numel()]
                rows[b].drafter.extend(pending[index][0][None], features[index, path][None], positions[None])
        root_positions = root_positions + lengths

    if batch_size == 1:  # a cycle cut short by a stop leaves entries past the last kept token: plain decoding has none
        cache.crop(min(0, rows[0].tokens.numel() - 1 - int(cache.get_seq_length())))
    if streamer is not None:
        streamer.end()
    final_length = max(row.stop_length for row in rows)
    pad_token = generation_config._pad_token_tensor  # what `_sample` pads stopped rows with
    sequences = torch.stack([_right_padded(row.tokens[:final_length], final_length, pad_token) for row in rows])
    stats.total_seconds = time.perf_counter() - start_time
    if return_dict:
        return Eagle3GenerateOutput(
            sequences=sequences,
            scores=tuple(rows[0].scores) if keep_scores else None,
            logits=tuple(rows[0].logits) if keep_logits else None,
            cache=cache if batch_size == 1 else None,
            eagle3_stats=stats,
        )
    return sequences


def _right_padded(tokens: torch.Tensor, length: int, pad_token: torch.Tensor | None) -> torch.Tensor:
    if tokens.numel() == length:
        return tokens
    return torch.cat([tokens, pad_token.to(tokens).expand(length - tokens.numel())])


def _with_stop_string_criteria(model, arguments: dict) -> dict:
    """`generate`'s keyword arguments (`arguments`, as bound, `kwargs` flattened) with the call's stop strings turned
    into a `StopStringCriteria`: transformers 5.24 does not hand the tokenizer to a `custom_generate` callable's
    stopping criteria (it builds them without, and refuses stop strings), so they are built here, as `generate`
    builds them."""
    arguments = dict(arguments)
    arguments.update(arguments.pop("kwargs", {}))
    tokenizer = arguments.get("tokenizer")
    config = arguments.get("generation_config") or model.generation_config
    stop_strings = arguments["stop_strings"] if "stop_strings" in arguments else config.stop_strings
    if tokenizer is None or not stop_strings:
        return arguments
    criteria = StoppingCriteriaList(arguments.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    return arguments | {"stopping_criteria": criteria, "stop_strings": None}


def _check_device(draft: Eagle3DraftModel, model) -> None:
    """The draft runs in its own dtype (the target's features are cast to it, as transformers runs an assistant in
    the dtype it was loaded in), but on the target's device: it reads the target's hidden states every cycle."""
    embedding = model.get_input_embeddings().weight
    if embedding.device.type != "meta" and draft.device != embedding.device:
        raise ValueError(
            f"The draft is on {draft.device} and the target on {embedding.device}: EAGLE-3 drafts from the target's "
            "hidden states and shares its embedding. Move the draft with `draft.to(target.device)`."
        )


def _layered_settings(draft: Eagle3DraftModel, generation_config, call_settings: dict) -> dict:
    """The call's EAGLE-3 settings, where transformers looks for an assistant's (`num_assistant_tokens` is read from
    the assistant's `generation_config`): the call's keyword arguments, over the call's `generation_config` as
    `generate` prepared it (the call's own over the target's, field by field), over the draft's `generation_config`
    (the draft config's defaults come last, in `_tree_settings`).
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
    levels = [
        {name: getattr(config, name) for name in SETTING_KWARGS if getattr(config, name, None) is not None}
        for config in (draft.generation_config, generation_config)
    ]
    settings = {}
    for level in (*levels, call_settings):
        if level.get("tree_shape") == "auto":
            settings = {name: value for name, value in settings.items() if name not in TREE_KWARGS}
        elif "tree_shape" not in level and any(name in level for name in TREE_KWARGS):
            settings.pop("tree_shape", None)
        settings |= level
    for name in ("ngram_candidates", "exact_attention"):  # a string such as "no" would read as True
        if not isinstance(settings.get(name, False), bool):
            raise TypeError(f"{name} must be True or False, got {settings[name]!r}.")
    return settings


def _wrap_generate(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        arguments = signature.bind(self, *args, **kwargs).arguments  # generate's own TypeError on a bad call
        draft, custom_generate = arguments.get("assistant_model"), arguments.get("custom_generate")
        if isinstance(custom_generate, str):  # a repository's generate: it receives every argument itself
            return original(self, *args, **kwargs)
        if not isinstance(draft, Eagle3DraftModel):
            if custom_generate is eagle3_generate:
                arguments = {name: value for name, value in arguments.items() if name != "self"}
                return original(self, **_with_stop_string_criteria(self, arguments))
            passed = sorted(name for name in EAGLE3_KWARGS if name in kwargs)
            if passed:
                raise TypeError(f"{passed} only apply with an Eagle3DraftModel as assistant_model.")
            return original(self, *args, **kwargs)
        ignored = sorted(name for name in ASSISTED_ONLY_KWARGS if name in kwargs)
        if ignored:
            raise TypeError(
                f"{', '.join(ignored)} size transformers' own assisted generation, which EAGLE-3 replaces: drop them, "
                "and set tree_depth / tree_top_k / tree_total_tokens (or tree_shape='auto') instead."
            )
        if "assistant_tokenizer" in kwargs:
            raise ValueError("An Eagle3DraftModel shares the target's tokenizer: drop assistant_tokenizer.")
        if custom_generate is not None:
            raise ValueError(
                "assistant_model=<Eagle3DraftModel> decodes with hf_eagle3's own custom_generate: drop custom_generate."
            )
        arguments = {name: value for name, value in arguments.items() if name not in ("self", "assistant_model")}
        streamer = arguments.pop("streamer", None)  # not passed to a custom_generate callable: handed over by name
        return original(self, **_with_stop_string_criteria(self, arguments), custom_generate=eagle3_generate,
                        draft=draft, eagle3_streamer=streamer)

    return generate


def install() -> None:
    """Route `generate(assistant_model=<Eagle3DraftModel>)` to EAGLE-3 decoding (idempotent): wraps
    `GenerationMixin.generate`, the one method hf_eagle3 replaces."""
    original = GenerationMixin.generate
    if getattr(original, "_hf_eagle3_hook", False):
        return
    missing = {"assistant_model", "streamer", "custom_generate", "kwargs"} - set(inspect.signature(original).parameters)
    if missing:
        raise ImportError(
            f"This transformers' GenerationMixin.generate has no {', '.join(sorted(missing))} parameter, which "
            "hf_eagle3 routes EAGLE-3 decoding through: install a tested transformers version "
            "(hf_eagle3.decoding.compatibility.TESTED_TRANSFORMERS)."
        )
    hooked = _wrap_generate(original)
    hooked._hf_eagle3_hook = True
    GenerationMixin.generate = hooked
