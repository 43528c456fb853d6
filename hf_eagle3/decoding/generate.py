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
The loop itself is `loop.decode`; the call's settings come from `settings.resolve_settings`.
"""

import functools
import inspect

import torch
from transformers import CompileConfig, GenerationMixin
from transformers.cache_utils import DynamicCache, DynamicLayer, StaticCache, StaticLayer
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria
from transformers.utils import logging

from ..modeling_eagle3 import Eagle3DraftModel
from ..utils.transformers_api import (
    CACHE,
    attention_implementation,
    compiles_forwards,
    recorded_mask_length,
    sample,
)
from .compatibility import check_compatibility, target_layer_ids
from .loop import decode
from .settings import ASSISTED_ONLY_KWARGS, SETTING_KWARGS, DecodingSettings, resolve_settings
from .stats import Eagle3GenerateOutput, Eagle3GenerationStats, Eagle3RowStats

__all__ = ["Eagle3GenerateOutput", "Eagle3GenerationStats", "Eagle3RowStats", "eagle3_generate", "install"]
EAGLE3_KWARGS = (*SETTING_KWARGS, "record_greedy_cycles")
logger = logging.get_logger(__name__)


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
    cache = model_kwargs.get(CACHE)
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
    if attention_implementation(model.config).startswith("flash_attention"):
        raise ValueError(
            "flash-attention cannot take a tree attention mask: load the target with attn_implementation='sdpa'."
        )
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError(
            "EAGLE-3 decoding needs the prompt's token ids (the draft embeds the tokens the target verified): pass "
            "input_ids instead of inputs_embeds, or generate without assistant_model."
        )


def eagle3_generate(
    model, input_ids: torch.LongTensor, logits_processor, stopping_criteria, generation_config,
    synced_gpus: bool = False, streamer=None, *, draft: Eagle3DraftModel | None = None, tree_depth: int | None = None,
    tree_top_k: int | None = None, tree_total_tokens: int | None = None, tree_shape: str | None = None,
    ngram_candidates: bool | None = None, exact_attention: bool | None = None, record_greedy_cycles: bool = False,
    eagle3_streamer=None, **model_kwargs,
):
    """EAGLE-3 decoding (greedy and sampling, batches left-padded as transformers pads them), as a `custom_generate`
    callable: `target.generate(**inputs, custom_generate=eagle3_generate, draft=draft)`.

    Args:
        draft: the `Eagle3DraftModel` made for `model`.
        tree_depth, tree_top_k, tree_total_tokens: the draft tree. These settings, `tree_shape`, `ngram_candidates`
            and `exact_attention` are also read from the call's generation config (as `generate` prepared it: the
            call's over the target's) and the draft's `generation_config`, then the draft config
            (`settings.resolve_settings`).
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
    layer_ids = target_layer_ids(draft.config, model)  # the draft's config is never rewritten by a call
    check_compatibility(draft.config, model, layer_ids)
    _check_device(draft, model)
    call = {"tree_depth": tree_depth, "tree_top_k": tree_top_k, "tree_total_tokens": tree_total_tokens,
            "tree_shape": tree_shape, "exact_attention": exact_attention, "ngram_candidates": ngram_candidates}
    compiled = compiles_forwards(model, model_kwargs, generation_config)  # as `_sample` decides
    settings = resolve_settings(model, draft, generation_config, call, input_ids.shape[0],
                                (generation_config.compile_config or CompileConfig()) if compiled else None,
                                model_kwargs.get(CACHE), input_ids.shape[1])
    if streamer is not None:
        streamer.put(input_ids.cpu())
    if settings.tree is None:  # no tree pays here: plain decoding, the draft is not run
        return _decode_plainly(model, draft, settings, input_ids, logits_processor, stopping_criteria,
                               generation_config, streamer, model_kwargs)
    model_kwargs[CACHE] = _keeping_every_entry(model_kwargs.get(CACHE))
    _check_supported(model, input_ids, generation_config, model_kwargs, streamer)
    _check_cached_prefix(draft, input_ids, generation_config, model_kwargs)
    return decode(model, draft, settings, layer_ids, input_ids, logits_processor, stopping_criteria, generation_config,
                  streamer, record_greedy_cycles, model_kwargs)


_WARNED_PLAIN: set = set()


def _warn_plain_once(settings: DecodingSettings) -> None:
    """Say why EAGLE-3 decodes plainly once per calibration record (its reason names each call's context, so
    transformers' `warning_once`, keyed by the message, would repeat it every call); every call's own reason is in
    its statistics (`shape_choice`)."""
    choice = settings.choice
    key = choice.path if choice is not None and choice.path is not None else settings.shape_choice
    if key not in _WARNED_PLAIN:
        _WARNED_PLAIN.add(key)
        logger.warning(settings.shape_choice)


def _decode_plainly(model, draft: Eagle3DraftModel, settings: DecodingSettings, input_ids, logits_processor,
                    stopping_criteria, generation_config, streamer, model_kwargs: dict):
    """The loop `generate` itself runs for greedy decoding and sampling, where `tree_shape="auto"` found that no tree
    pays (`settings.shape_choice` says why), with the call's statistics."""
    _warn_plain_once(settings)
    stats = Eagle3GenerationStats(None, shape_choice=settings.shape_choice, choice=settings.choice)
    draft.generation_stats = stats
    output = sample(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer, model_kwargs)
    if not generation_config.return_dict_in_generate:
        return output
    return Eagle3GenerateOutput(**output, eagle3_stats=stats)


def _keeping_every_entry(cache):
    """An empty dynamic cache whose sliding-window layers would keep only the last window of entries is replaced by
    one that keeps them all: the cycle's cache compaction indexes entries by sequence position (the verification
    masks apply the window)."""
    if type(cache) is DynamicCache and cache.get_seq_length() == 0 and any(layer.is_sliding for layer in cache.layers):
        return DynamicCache()
    return cache


def _with_stop_string_criteria(model, arguments: dict) -> dict:
    """`generate`'s keyword arguments (`arguments`, as bound, `kwargs` flattened) with the call's stop strings turned
    into a `StopStringCriteria`: transformers 5.24 does not hand the tokenizer to a `custom_generate` callable's
    stopping criteria (it builds them without, and refuses stop strings), so they are built here, as `generate`
    builds them."""
    arguments = dict(arguments)
    arguments.update(arguments.pop("kwargs", {}))
    tokenizer = arguments.get("tokenizer")
    config = arguments.get("generation_config") or model.generation_config
    stop_strings = arguments.get("stop_strings", config.stop_strings)
    if tokenizer is None or not stop_strings:
        return arguments
    criteria = StoppingCriteriaList(arguments.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    return arguments | {"stopping_criteria": criteria, "stop_strings": None}


def _check_cached_prefix(draft: Eagle3DraftModel, input_ids: torch.Tensor, generation_config, model_kwargs) -> None:
    """A cache that holds a prefix is continued as plain decoding continues it: `input_ids` is the whole sequence,
    the cache holds its first tokens, and the call feeds the rest."""
    cached, length = int(model_kwargs[CACHE].get_seq_length()), input_ids.shape[1]
    if not cached:
        return
    attention_mask = model_kwargs.get("attention_mask")
    mask_length = attention_mask.shape[1] if attention_mask is not None else recorded_mask_length(generation_config,
                                                                                                  length)
    if mask_length != length or cached >= length:
        raise ValueError(
            f"The cache holds {cached} tokens and input_ids {length} (attention_mask {mask_length}): EAGLE-3 decoding "
            "continues a cache from the whole sequence. Pass input_ids holding the cached tokens followed by at least "
            "one new token (the sequences a previous generate returned, then the next turn), with a mask as long."
        )
    if draft.config.sliding_window is not None:
        raise ValueError(
            f"This draft's sliding-window layers read a sequence from its first token, and the cache holds its first "
            f"{cached}: generate without the cache, or with a draft without sliding-window layers."
        )


def _check_device(draft: Eagle3DraftModel, model) -> None:
    """The draft runs in its own dtype (the target's features are cast to it, as transformers runs an assistant in
    the dtype it was loaded in), but on the target's device: it reads the target's hidden states every cycle."""
    embedding = model.get_input_embeddings().weight
    if embedding.device.type != "meta" and draft.device != embedding.device:
        raise ValueError(
            f"The draft is on {draft.device} and the target on {embedding.device}: EAGLE-3 drafts from the target's "
            "hidden states and shares its embedding. Move the draft with `draft.to(target.device)`."
        )


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
            "hf_eagle3 routes EAGLE-3 decoding through: install a supported transformers "
            "(hf_eagle3.utils.transformers_api.SUPPORTED)."
        )
    hooked = _wrap_generate(original)
    hooked._hf_eagle3_hook = True
    GenerationMixin.generate = hooked
