"""The engines users deploy, run on this machine as `hf-eagle3 bench` methods and by `make engines`: vLLM, llama.cpp and
OpenVINO GenAI, each plainly (`vllm`) and with an EAGLE-3 draft (`vllm+eagle3`), greedy, float32. Each engine's module
has `build()` (what `make engines` runs: its environment under the user cache, from the package registry),
`require_built()` (`EngineNotBuilt`, which names `make engines`, where that environment is missing) and `start(target,
draft, work, tree, tokenizer)`, which converts the folders into `work` once and returns the method's runner: `engine`
(its name and version), `generate(prompt, max_new_tokens)` -> `EngineOutput`, and `close()`.
"""

from . import llama_cpp, openvino, vllm
from .process import EngineNotBuilt, EngineOutput

ENGINES = {"vllm": vllm, "llama.cpp": llama_cpp, "openvino": openvino}
EAGLE3_SUFFIX = "+eagle3"
ENGINE_METHODS = [name + suffix for name in ENGINES for suffix in ("", EAGLE3_SUFFIX)]

__all__ = ["EAGLE3_SUFFIX", "ENGINES", "ENGINE_METHODS", "EngineNotBuilt", "EngineOutput", "engine_method"]


def engine_method(name: str) -> tuple[str, bool] | None:
    """`("vllm", True)` for `vllm+eagle3`, `("vllm", False)` for `vllm`; None for a name that is not an engine's."""
    engine = name.removesuffix(EAGLE3_SUFFIX)
    return (engine, name != engine) if engine in ENGINES else None
