"""Where hf-eagle3 keeps what it builds on first use (the embedded target's safetensors, calibration records):
`$HF_EAGLE3_CACHE`, else `$XDG_CACHE_HOME/hf_eagle3`, else `~/.cache/hf_eagle3`."""

import os
from pathlib import Path


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hf_eagle3"
    return Path(os.environ.get("HF_EAGLE3_CACHE", default))
