"""`make device-check`: what hf-eagle3 does on one GPU (an H100 or H200), in one run of a few minutes.

1. The tests marked `cuda` (`pytest -m cuda`).
2. Host-device synchronisations: an EAGLE-3 `generate` and a plain one under `torch.cuda.set_sync_debug_mode("warn")`,
   the warnings it raises counted, per cycle (the cycles from the call's statistics) and per plain token.
3. Costs of a target shaped as Llama-3.1-8B (its config, `--layers` of its 32 decoder layers) with random weights in
   bfloat16, and a random EAGLE-3 draft of its shape (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's: 32,000 draft tokens),
   nothing downloaded: the draft / verify / other milliseconds of an EAGLE-3 cycle with the official tree (7x10x60),
   from the statistics of a greedy `generate`, and the decode step of plain greedy `generate`, eager with a dynamic
   cache and with a static cache (which transformers compiles on a GPU), the median time between its tokens.
4. The speedup those costs predict at τ 3, 4, 5 and 6 (a trained draft's acceptance; a random draft accepts
   nothing): `τ * plain_step / cycle`.

Writes device-check.json and device-check.md under `--out`, after each step, so that a run cut short leaves what it
measured. `--dry-run` runs every step on the CPU with tiny shapes (no synchronisation to count there), in well under a
minute: tests/test_device_check.py runs it, so that this script cannot rot.

On the GPU machine the script first makes its environment: where its transformers is not 5.24.x, or hf-eagle3 is not
installed, it installs the wheels carried in `.whl/` (`make device-wheels` downloads them here) and this tree into a
folder of its own, without an index, and runs again there. The device tool's call (docs/device-check.md):
`run(command="make device-check", carry=[".whl"], timeout_s=540)`.
"""

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / ".whl"
SITE = Path(tempfile.gettempdir()) / "hf-eagle3-device-check"
SUPPORTED_TRANSFORMERS = "5.24."
TAUS = (3, 4, 5, 6)
# Llama-3.1-8B's shapes (meta-llama/Llama-3.1-8B-Instruct config.json); the weights are random
LLAMA_31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192})
# plain decoding's paths, by name: through a static cache (which transformers compiles on a GPU) or not
PLAIN_PATHS = {"plain (eager, dynamic cache)": False, "plain (static cache, compiled on a GPU)": True}
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024)


@dataclass(frozen=True)
class Plan:
    """What one run measures: the target's shapes, the draft's vocabulary, where and in which dtype, the prompt's and
    the answer's lengths."""

    target: dict
    draft_vocab_size: int
    device: str
    dtype: str
    prompt_tokens: int
    new_tokens: int


GPU_PLAN = Plan(LLAMA_31_8B, 32000, "cuda", "bfloat16", prompt_tokens=512, new_tokens=128)
DRY_PLAN = Plan(TINY, 64, "cpu", "float32", prompt_tokens=32, new_tokens=16)


def prepare_environment() -> None:
    """Where transformers is not a supported version or hf-eagle3 is not importable, install the carried wheels and
    this tree into `SITE` (no index: the GPU machine reaches none) and run this script again with it on the path."""
    try:
        transformers_version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers_version = None
    supported = transformers_version is not None and transformers_version.startswith(SUPPORTED_TRANSFORMERS)
    if (supported and importlib.util.find_spec("hf_eagle3")) or os.environ.get("HF_EAGLE3_DEVICE_SITE"):
        return
    wheels = sorted(WHEELS.glob("*.whl"))
    if not supported and not any(wheel.name.startswith("transformers-") for wheel in wheels):
        sys.exit(f"transformers {transformers_version} is installed here and hf-eagle3 needs "
                 f"{SUPPORTED_TRANSFORMERS}x: run `make device-wheels` where a package index is reachable and carry "
                 f"{WHEELS.name}/ along.")
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile", "--upgrade",
           "--target", str(SITE)]
    environment = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")])),
                                "HF_EAGLE3_DEVICE_SITE": str(SITE)}
    if wheels:
        subprocess.run([*pip, *map(str, wheels)], check=True)
    subprocess.run([*pip, "--no-build-isolation", str(ROOT)], check=True, env=environment)  # setuptools: a wheel
    os.execve(sys.executable, [sys.executable, *sys.argv], environment)


def run_cuda_tests(out: Path) -> dict:
    """The tests marked `cuda` (all skipped without a GPU), their log under `out`."""
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", str(ROOT / "tests")]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    (out / "cuda-tests.log").write_text(result.stdout + result.stderr)
    lines = result.stdout.strip().splitlines()
    return {"returncode": result.returncode, "summary": lines[-1] if lines else result.stderr.strip()[-300:]}


def build_models(plan: Plan, layers: int):
    """A target of `plan`'s shapes with `layers` decoder layers and a matching draft, random weights, on its device."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_eagle3 import Eagle3Config, Eagle3DraftModel

    dtype = getattr(torch, plan.dtype)
    torch.manual_seed(0)
    config = LlamaConfig(**(plan.target | {"num_hidden_layers": layers}))
    with torch.device(plan.device):
        target = LlamaForCausalLM._from_config(config, dtype=dtype).eval()
        draft_config = Eagle3Config(
            vocab_size=config.vocab_size, draft_vocab_size=plan.draft_vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads, target_num_hidden_layers=layers,
            max_position_embeddings=config.max_position_embeddings)
        draft = Eagle3DraftModel(draft_config).to(dtype).eval()
    draft.set_draft_vocabulary(torch.randperm(config.vocab_size, device=plan.device)[:plan.draft_vocab_size])
    return target, draft


def eagle3_generate(target, draft, prompt, new_tokens: int):
    """A greedy EAGLE-3 `generate` with the official tree, its statistics."""
    from hf_eagle3.decoding.settings import ACCELERATOR_TREE

    return target.generate(prompt, attention_mask=prompt.new_ones(prompt.shape), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, assistant_model=draft,
                           return_dict_in_generate=True, **ACCELERATOR_TREE).eagle3_stats


def plain_step_ms(target, prompt, new_tokens: int, static: bool) -> float:
    """The median milliseconds between the tokens of a plain greedy `generate` (after one call that warms it up and,
    with `static`, compiles it), through a dynamic cache or a static one."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Clock(StoppingCriteria):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())  # generate reads its stop flag on the host: the step is done
            return input_ids.new_zeros(input_ids.shape[0], dtype=torch.bool)

    path = {"cache_implementation": "static"} if static else {}
    for _ in range(2):
        clock = Clock()
        target.generate(prompt, attention_mask=prompt.new_ones(prompt.shape), max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens, do_sample=False, stopping_criteria=StoppingCriteriaList([clock]),
                        **path)
    return 1000 * statistics.median(later - earlier for earlier, later in zip(clock.times, clock.times[1:]))


def cycle_ms(target, draft, prompt, new_tokens: int) -> dict:
    """An EAGLE-3 cycle's draft / verify / other milliseconds and τ (after one call that warms it up)."""
    eagle3_generate(target, draft, prompt, new_tokens // 4)
    stats = eagle3_generate(target, draft, prompt, new_tokens)
    cycles = max(stats.num_cycles, 1)
    parts = {"draft": stats.draft_seconds, "verify": stats.verify_seconds, "other": stats.other_seconds}
    return {f"{name}_ms": 1000 * seconds / cycles for name, seconds in parts.items()} | {
        "cycle_ms": 1000 * sum(parts.values()) / cycles, "cycles": stats.num_cycles,
        "tau": stats.mean_acceptance_length,
        "tree": [stats.settings.depth, stats.settings.top_k, stats.settings.total_tokens]}


def count_syncs(target, draft, prompt, new_tokens: int) -> dict | None:
    """Synchronisations `torch.cuda.set_sync_debug_mode` reports per EAGLE-3 cycle and per plain token (`None` off a
    GPU, where nothing synchronises)."""
    import torch

    if prompt.device.type != "cuda":
        return None

    def counted(call) -> tuple[int, object]:
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                result = call()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(warning.message) for warning in caught), result

    eagle3_syncs, stats = counted(lambda: eagle3_generate(target, draft, prompt, new_tokens))
    plain_syncs, _ = counted(lambda: target.generate(prompt, attention_mask=prompt.new_ones(prompt.shape),
                                                     max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                     do_sample=False))
    return {"eagle3_syncs": eagle3_syncs, "eagle3_cycles": stats.num_cycles,
            "per_cycle": eagle3_syncs / max(stats.num_cycles, 1), "plain_syncs": plain_syncs,
            "per_plain_token": plain_syncs / new_tokens}


def predicted_speedups(cycle: dict, plain: dict) -> dict:
    """`τ * plain_step / cycle` at each of `TAUS`, against each plain decoding measured."""
    return {name: {str(tau): tau * step / cycle["cycle_ms"] for tau in TAUS} for name, step in plain.items()}


def markdown(results: dict) -> str:
    """The results as the tables docs/device-check.md shows."""
    setup = results["setup"]
    lines = [f"# hf-eagle3 device check: {setup['device_name']}", "",
             f"torch {setup['torch']}, transformers {setup['transformers']}, {setup['dtype']}; target: "
             f"{setup['target']}; prompt {setup['prompt_tokens']} tokens, {setup['new_tokens']} new.", ""]
    if "cuda_tests" in results:
        lines += [f"Tests marked cuda: {results['cuda_tests']['summary']} (exit {results['cuda_tests']['returncode']})",
                  ""]
    syncs = results.get("syncs", "missing")
    if syncs != "missing":
        lines += ["Synchronisations: " + ("not counted off a GPU" if syncs is None else
                  f"{syncs['per_cycle']:.1f} per EAGLE-3 cycle ({syncs['eagle3_syncs']} in {syncs['eagle3_cycles']} "
                  f"cycles), {syncs['per_plain_token']:.1f} per plain token"), ""]
    if "cycle" in results:
        cycle = results["cycle"]
        lines += ["| EAGLE-3 cycle, tree " + "x".join(map(str, cycle["tree"])) + " | ms |", "| --- | ---: |"]
        lines += [f"| {name} | {cycle[f'{name}_ms']:.2f} |" for name in ("draft", "verify", "other", "cycle")]
        lines += [f"| (τ of the random draft: {cycle['tau']:.2f} over {cycle['cycles']} cycles) | |", ""]
    if "plain_step_ms" in results:
        lines += ["| plain decode step | ms |", "| --- | ---: |"]
        lines += [f"| {name} | {ms:.2f} |" for name, ms in results["plain_step_ms"].items()] + [""]
    if "predicted_speedup" in results:
        speedups = results["predicted_speedup"]
        lines += ["| τ | " + " | ".join(f"speedup over {name}" for name in speedups) + " |",
                  "| ---: |" + " ---: |" * len(speedups)]
        lines += [f"| {tau} | " + " | ".join(f"{speedups[name][str(tau)]:.2f}x" for name in speedups) + " |"
                  for tau in TAUS]
    return "\n".join(lines) + "\n"


def write(out: Path, results: dict) -> None:
    (out / "device-check.json").write_text(json.dumps(results, indent=1))
    (out / "device-check.md").write_text(markdown(results))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "device-check"),
                        help="folder for the results (default: $OUT, else device-check/)")
    parser.add_argument("--dry-run", action="store_true", help="every step on the CPU with tiny shapes")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers of the Llama-3.1-8B-shaped target (default: its 32)")
    args = parser.parse_args(argv)
    if not args.dry_run:
        prepare_environment()
    import torch
    import transformers

    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    if plan.device == "cuda" and not torch.cuda.is_available():
        sys.exit("No GPU is visible to torch here: run with --dry-run for the CPU, or on the GPU machine.")
    layers = args.layers or plan.target["num_hidden_layers"]
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"setup": {
        "device_name": torch.cuda.get_device_name() if plan.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "dtype": plan.dtype,
        "target": f"Llama-3.1-8B shapes, {layers} of {plan.target['num_hidden_layers']} layers, random weights"
                  if plan is GPU_PLAN else f"tiny Llama, {layers} layers",
        "plan": asdict(plan) | {"layers": layers}, "prompt_tokens": plan.prompt_tokens,
        "new_tokens": plan.new_tokens}, "seconds": {}}
    steps = [("cuda_tests", lambda: run_cuda_tests(args.out))]
    models = {}

    def load():
        models["target"], models["draft"] = build_models(plan, layers)
        models["prompt"] = torch.randint(0, plan.target["vocab_size"], (1, plan.prompt_tokens), device=plan.device)

    steps += [
        ("models", load),
        ("cycle", lambda: cycle_ms(models["target"], models["draft"], models["prompt"], plan.new_tokens)),
        ("syncs", lambda: count_syncs(models["target"], models["draft"], models["prompt"], plan.new_tokens)),
        ("plain_step_ms", lambda: {name: plain_step_ms(models["target"], models["prompt"], plan.new_tokens, static)
                                   for name, static in PLAIN_PATHS.items()}),
        ("predicted_speedup", lambda: predicted_speedups(results["cycle"], results["plain_step_ms"])),
    ]
    for name, step in steps:
        start = time.perf_counter()
        value = step()
        results["seconds"][name] = round(time.perf_counter() - start, 1)
        if name != "models":
            results[name] = value
        write(args.out, results)
        print(f"{name}: {results['seconds'][name]} s", flush=True)
    print(markdown(results))
    return 0 if results["cuda_tests"]["returncode"] in (0, 5) else 1  # 5: no test ran (none is marked cuda here)


if __name__ == "__main__":
    sys.exit(main())
