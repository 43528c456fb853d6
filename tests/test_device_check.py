"""`make device-check` (tests/device/run.py) in its dry mode: every step on the CPU with tiny shapes, so that the
script the GPU machine runs cannot rot where CI has no GPU."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("device") / "run.py"


def test_the_device_check_dry_run_measures_every_step_and_writes_its_results(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    results = json.loads((tmp_path / "device-check.json").read_text())
    assert results["cuda_tests"]["returncode"] == 0  # every test marked cuda skipped here, none failed
    cycle = results["cycle"]
    assert cycle["tree"] == [7, 10, 60] and cycle["cycles"] > 0 and cycle["tau"] >= 1
    assert cycle["cycle_ms"] > 0 and all(cycle[f"{part}_ms"] >= 0 for part in ("draft", "verify", "other"))
    assert results["syncs"] is None  # nothing synchronises on the CPU
    assert len(results["plain_step_ms"]) == 2 and all(ms > 0 for ms in results["plain_step_ms"].values())
    for name, step in results["plain_step_ms"].items():
        assert results["predicted_speedup"][name]["4"] == 4 * step / cycle["cycle_ms"]
    table = (tmp_path / "device-check.md").read_text()
    assert "Tests marked cuda:" in table and "tree 7x10x60" in table and "| 6 |" in table
