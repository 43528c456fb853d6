"""The embedded SmolLM2 target's earlier import path, `hf_eagle3.smollm2`, kept for scripts and checks written against
it; the module is `hf_eagle3.resources.smollm2`."""

from .resources.smollm2 import SMOLLM2_NAME, load_smollm2, smollm2_path

__all__ = ["SMOLLM2_NAME", "load_smollm2", "smollm2_path"]
