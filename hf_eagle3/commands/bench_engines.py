"""The engines as `hf-eagle3 bench` methods (`vllm`, `vllm+eagle3`, `llama.cpp`, `llama.cpp+eagle3`, `openvino`,
`openvino+eagle3`): checked before anything loads, started once each in a process of their own (`hf_eagle3.engines`),
and their records and summary entries. An engine decodes greedily in float32; its EAGLE-3 method drafts a chain of the
bench's `--tree-depth` (the `chain` method's length) and is checked against the same engine's plain output, from which
it also takes its speedup over that engine."""

import statistics
from contextlib import ExitStack, closing
from pathlib import Path
from typing import NamedTuple

import torch

from ..engines import ENGINES, EngineOutput, engine_method
from ..resources.loading import save_draft


def check_engine_methods(names: list[str], greedy: bool) -> None:
    """Refuses, before anything loads, engine methods that cannot run: sampled decoding, an EAGLE-3 method without its
    engine's plain one, an engine not built here (`EngineNotBuilt`, which names `make engines`)."""
    engines = {engine for engine, _ in filter(None, map(engine_method, names))}
    if engines and not greedy:
        raise ValueError(f"The engine methods ({', '.join(sorted(engines))}) decode greedily: drop them or use "
                         "--temperature 0.")
    for name in names:
        if (parsed := engine_method(name)) and parsed[1] and parsed[0] not in names:
            raise ValueError(f"{name} is checked against its engine's plain greedy output: add `{parsed[0]}` to "
                             "--methods.")
    for engine in sorted(engines):
        ENGINES[engine].require_built()


class EngineMethod(NamedTuple):
    """A started engine method: its runner (`generate`, `close`), its engine's name and version (`vLLM 0.32.0`), and
    the shape its draft's chain has (`3x1x3`; None for plain decoding)."""

    runner: object
    label: str
    shape: str | None


def start_engines(names: list[str], target, tokenizer, draft, depth: int, work: Path,
                  stack: ExitStack) -> dict[str, EngineMethod]:
    """Every engine method in `names`, by name, started and closed with `stack`: each gets the target's folder (where
    it was loaded from, else saved into `work`) and the draft as `save_pretrained` writes it (float32), which each
    engine converts into `work` once; EAGLE-3 drafts a chain of `depth`."""
    names = [name for name in names if engine_method(name)]
    if not names:
        return {}
    save_draft(draft, work / "draft", torch.float32)
    target_folder = Path(target.name_or_path)
    if not (target_folder / "config.json").exists():
        target_folder = work / "target"
        target.save_pretrained(target_folder)
        tokenizer.save_pretrained(target_folder)
    chain = {"tree_depth": depth, "tree_top_k": 1, "tree_total_tokens": depth}
    methods = {}
    for name in names:
        engine, eagle3 = engine_method(name)
        runner = ENGINES[engine].start(target_folder, work / "draft" if eagle3 else None, work, chain, tokenizer)
        stack.enter_context(closing(runner))
        methods[name] = EngineMethod(runner, f"{runner.engine['engine']} {runner.engine['version']}",
                                     f"{depth}x1x{depth}" if eagle3 else None)
    return methods


def engine_record(name: str, outputs: dict[str, EngineOutput], max_new_tokens: int, method: EngineMethod) -> dict:
    """What an engine method's record holds beside the set, prompt, method, seconds and prompt tokens of every record:
    its new tokens; for an EAGLE-3 method whether its output equals its engine's plain one (a plain method's is None:
    it is the reference), its chain and its engine's counters (target forwards that verified drafted tokens,
    drafted tokens accepted)."""
    engine, eagle3 = engine_method(name)
    output = outputs[name]
    record = {"new_tokens": output.new_tokens, "engine": method.label, "compared_with": engine if eagle3 else None,
              "identical_to_plain": output.same_as(outputs[engine], max_new_tokens) if eagle3 else None}
    if eagle3:
        record |= {"shape": method.shape, "cycles": output.cycles, "accepted": output.accepted}
    return record


def engine_entry(name: str, rows: list[dict], tokens_per_second) -> dict:
    """An engine method's summary entry beside the speedup, tokens/s and mismatches of every method: its engine; for
    an EAGLE-3 method its chain, τ (tokens per target forward, from the engine's counters) and its median speedup over
    the engine's plain decoding on the same prompt, whose rows are among `rows`."""
    engine, eagle3 = engine_method(name)
    mine = [row for row in rows if row["method"] == name]
    entry = {"engine": mine[0]["engine"], "compared_with": engine if eagle3 else None}
    if eagle3:
        plain = {row["prompt"]: tokens_per_second(row) for row in rows if row["method"] == engine}
        cycles = sum(row["cycles"] for row in mine)
        entry |= {"shapes": sorted({row["shape"] for row in mine}),
                  "tau": (cycles + sum(row["accepted"] for row in mine)) / cycles if cycles else 1.0,
                  "speedup_over_engine": statistics.median(tokens_per_second(row) / plain[row["prompt"]]
                                                           for row in mine)}
    return entry

