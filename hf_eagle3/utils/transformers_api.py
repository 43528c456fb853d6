"""Every private or renamed part of transformers that hf-eagle3 uses, and how the supported releases differ in it.

hf-eagle3 supports transformers from `SUPPORTED[0]` up to (not including) `SUPPORTED[1]`; docs/compatibility.md
has what was checked on each release of `TESTED`. The rest of the package speaks the newest releases' dialect
and reaches transformers' private parts only through the names below, so that a new release is adapted here alone.

What differs between the supported releases:

- The generation cache's name. transformers 5.24 renamed `past_key_values` to `cache` in a model's forward keywords,
  in `generate`'s model kwargs (what `_sample` and `prepare_inputs_for_generation` take) and in the fields of
  `GenerateDecoderOnlyOutput`. From 5.24 on the old name is still accepted, with a deprecation warning, so every
  release is given its own name: `CACHE`.
- Cropping a static cache. Before 5.24 a `StaticLayer` has no `crop`: `crop_cache` sets its length back as 5.24's
  `StaticLayer.crop` does (the entries past it are overwritten by the next update).

What is private but the same in every supported release, named here so that a change is found in one place:
`generation_config._pad_token_tensor` and `._mask_length` (set by `generate`), `_valid_auto_compile_criteria` and
`_sample` of `GenerationMixin`, `CompileConfig._compile_all_devices`, `config._attn_implementation`,
`_keys_to_ignore_on_save`, and `transformers.pipelines.base.load_assistant_model` (`decoding/pipelines.py`).
"""

import functools
import warnings

import torch
import transformers
from packaging.version import Version
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

# The releases tested (docs/compatibility.md; CI runs the `compat` tests under the first and the last), and the range
# supported: from the oldest tested to one minor past the newest (pyproject.toml says the same). Below the range an
# API hf-eagle3 needs is missing; above it a release imports with a warning.
TESTED = ("5.16.1", "5.17.0", "5.19.0", "5.20.0", "5.22.0", "5.24.0", "5.25.0")
NEWEST_TESTED = ".".join(TESTED[-1].split(".")[:2])
SUPPORTED = (Version(TESTED[0]), Version(f"{Version(TESTED[-1]).major}.{Version(TESTED[-1]).minor + 1}"))
# The keyword and output field of the generation cache (`past_key_values` before transformers 5.24)
CACHE = "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"


def check_version(version: str = transformers.__version__) -> None:
    """Refuse a transformers older than the supported range; warn once about a newer one."""
    low, high = SUPPORTED
    if Version(version) < low:
        raise ImportError(
            f"hf_eagle3 needs transformers >={low} (it reads parts of transformers' generation loop that older "
            f"releases lack); found {version}. Upgrade: pip install 'transformers>={low},<{high}'."
        )
    if Version(version) >= high:
        warnings.warn(
            f"hf_eagle3 is tested with transformers >={low},<{high} (newest tested: {NEWEST_TESTED}); found "
            f"{version}. It reads private parts of transformers' generation loop: if decoding fails, install a "
            f"tested release: pip install 'transformers>={low},<{high}'.",
            stacklevel=2,
        )


def crop_cache(cache, tokens_to_remove: int) -> None:
    """`cache.crop(tokens_to_remove)` (`<= 0`: drop the last `-tokens_to_remove` entries), also for a static cache of a
    release whose `StaticLayer` cannot crop."""
    if all(hasattr(layer, "crop") for layer in cache.layers):
        cache.crop(tokens_to_remove)
        return
    for layer in cache.layers:  # `StaticLayer` before transformers 5.24
        layer.cumulative_length.sub_(abs(tokens_to_remove))


def output_cache(output):
    """The cache a `generate` output (`GenerateDecoderOnlyOutput`) or a forward's output carries."""
    return getattr(output, CACHE)


def pad_token_tensor(generation_config) -> torch.Tensor | None:
    """The pad token `generate` pads finished rows with, as it prepared it for the call."""
    return generation_config._pad_token_tensor


def recorded_mask_length(generation_config, default: int) -> int:
    """The attention mask's length that `generate` recorded for the call, else `default`."""
    return getattr(generation_config, "_mask_length", default)


def compiles_forwards(model, model_kwargs: dict, generation_config) -> bool:
    """Whether `generate` compiles the decoding forwards of this call (a static cache on an accelerator, or
    `compile_config` told to compile on every device), as `_sample` decides."""
    return model._valid_auto_compile_criteria(model_kwargs, generation_config)


def compile_on_every_device(compile_config):
    """`compile_config`, told to compile on CPU too (transformers compiles on accelerators only by default)."""
    compile_config._compile_all_devices = True
    return compile_config


def sample(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer, model_kwargs: dict):
    """`generate`'s own loop for greedy decoding and sampling, on prepared inputs."""
    return model._sample(input_ids, logits_processor, stopping_criteria, generation_config, streamer=streamer,
                         **model_kwargs)


def attention_implementation(config) -> str:
    """The attention function a model's layers look up (`AttentionInterface` names: "sdpa", "eager", ...)."""
    return config._attn_implementation


def keys_not_saved(model) -> set[str]:
    """The state-dict names `save_pretrained` leaves out of `model`'s checkpoint."""
    return set(model._keys_to_ignore_on_save or ())


def wrap_sdpa(attention, marker: str) -> None:
    """Register `attention` as transformers' "sdpa" attention function, over the one registered now (it is called as
    `attention(sdpa, module, query, key, value, ...)`), once: an entry that already carries `marker` stays (markers
    carry over to the wrappers registered above it)."""
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if getattr(sdpa, marker, False):
        return
    hooked = functools.wraps(sdpa)(functools.partial(attention, sdpa))
    setattr(hooked, marker, True)
    AttentionInterface.register("sdpa", hooked)
