"""Importing hf_eagle3 changes nothing a user of transformers sees who never passes an EAGLE-3 draft."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("import_effects.py")


def test_importing_hf_eagle3_leaves_generate_pipelines_and_the_attention_registries_as_they_were():
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=True, timeout=300)
    observed = json.loads(run.stdout)
    before, after = observed["before"], observed["after"]
    assert observed["hf_eagle3"]
    assert not any(outcome.startswith("TypeError") for outcome in before["generate"].values()), before["generate"]
    for part in before:  # outputs of every call, the loader's answers, signatures and docs, registry entries
        assert after[part] == before[part], part
