"""Measured results as a model card shows them: the rows of `hf-eagle3 bench`'s `bench.json` (or of a JSON list of rows
with the same keys), and the settings they were measured with."""

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Results:
    """Measured results for a card: table rows with the same keys, how they were measured (`None`: unknown), the
    draft they were measured with (`bench.json`'s `draft`: its name, fingerprint and config digest; `None` for rows
    given as a list), the file they came from, and the fastest EAGLE-3 method's speedup over plain decoding (`None`
    where no row gives one)."""

    rows: list[dict[str, Any]]
    setup: str | None = None
    draft: dict[str, Any] | None = None
    source: str | None = None
    best_speedup: float | None = None


def load_results(path: str | Path) -> Results:
    """Read a results file: `hf-eagle3 bench`'s `bench.json`, or a JSON list of rows with the same keys."""
    try:
        content = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"Cannot read the results file {path}: {error}") from error
    if isinstance(content, dict) and isinstance(content.get("summary"), dict) and content["summary"]:
        if not isinstance(content.get("draft"), dict):
            raise ValueError(
                f"{path} does not record the draft it measured (written by an older hf-eagle3), so a card cannot show "
                "it as this draft's: run `hf-eagle3 bench --draft DIR` again and pass its bench.json."
            )
        return replace(_bench_results(content), draft=content["draft"], source=str(path))
    if not (isinstance(content, list) and content and all(isinstance(row, dict) for row in content)):
        raise ValueError(
            f"{path} must be the bench.json `hf-eagle3 bench` writes or a non-empty JSON list of objects (one per "
            "measured setting)."
        )
    return Results(content)


def _bench_results(bench: dict[str, Any]) -> Results:
    """One row per prompt set and method of a `bench.json`: speedup, tokens/s, τ and n-α for every drafted
    position measured; the setup names the machine, dtype, threads, decoding and sizes it ran with."""
    summary = bench["summary"]
    positions = max((len(entry.get("n_alpha") or []) for methods in summary.values() for entry in methods.values()),
                    default=0)
    rows, speedups = [], []
    for set_name, methods in summary.items():
        for method, entry in methods.items():
            if "tau" in entry:  # an EAGLE-3 method
                speedups.append(entry["speedup"])
            alphas = list(entry.get("n_alpha") or []) + [None] * positions
            rows.append({
                "prompts": set_name,
                "method": method,
                "tree (DxKxN)": ", ".join(entry.get("shapes", [])) or "-",
                "speedup": f"{entry['speedup']:.2f}x",
                "tokens/s": f"{entry['tokens_per_second']:.1f}",
                "τ": f"{entry['tau']:.2f}" if "tau" in entry else "-",
                **{f"{n}-α": "-" if alphas[n] is None else f"{alphas[n]:.2f}" for n in range(positions)},
            })
    settings = bench.get("settings")
    return Results(rows, settings_description(settings) if settings else None,
                   best_speedup=max(speedups) if speedups else None)


def settings_description(settings: dict) -> str:
    """What a benchmark ran with, from `bench.json`'s `settings`: machine, dtype, threads, decoding, lengths and
    repetitions (what is not recorded is left out)."""
    def count(number: int, noun: str) -> str:
        return f"{number} {noun}{'' if number == 1 else 's'}"

    decoding = "greedy" if not settings.get("temperature") else f"sampling at temperature {settings['temperature']}"
    parts = [
        settings.get("machine"),
        settings.get("dtype"),
        count(settings["torch_threads"], "torch thread") if settings.get("torch_threads") else None,
        decoding,
        f"{settings['max_new_tokens']} new tokens" if settings.get("max_new_tokens") else None,
        f"the first {count(settings['limit'], 'prompt')} of each set" if settings.get("limit") else None,
        f"median of {settings['repetitions']} interleaved repetitions" if settings.get("repetitions") else None,
    ]
    return ", ".join(part for part in parts if part)
