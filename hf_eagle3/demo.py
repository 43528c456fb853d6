"""`hf-eagle3 demo`: the main job. EAGLE-3 with the shipped draft on the embedded SmolLM2 target, against plain
`generate`, measured with interleaved repetitions after a warm-up of every shape."""

import argparse
import statistics
import time
from pathlib import Path

import torch

from .modeling_eagle3 import Eagle3DraftModel
from .smollm2 import load_smollm2

SHIPPED_DRAFT = Path(__file__).parent / "assets" / "smollm2-eagle3"
DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."


def load_shipped_draft(dtype: torch.dtype = torch.float32) -> Eagle3DraftModel:
    """The EAGLE-3 draft trained for the embedded SmolLM2-135M-Instruct target and shipped with the package."""
    if not (SHIPPED_DRAFT / "model.safetensors").exists():
        raise FileNotFoundError(
            f"No shipped draft at {SHIPPED_DRAFT}: train one with `hf-eagle3 train` (see the README)."
        )
    return Eagle3DraftModel.from_pretrained(SHIPPED_DRAFT, dtype=dtype).eval()


def _timed(function) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    output = function()
    return time.perf_counter() - start, output


def run_demo(
    prompt: str, max_new_tokens: int, dtype: torch.dtype, repetitions: int, threads: int | None,
    exact_attention: bool = False,
) -> dict:
    if threads:
        torch.set_num_threads(threads)
    target, tokenizer = load_smollm2(dtype=dtype)
    draft = load_shipped_draft(dtype=dtype)
    messages = [{"role": "user", "content": prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt_length = inputs["input_ids"].shape[1]

    def plain():
        return target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)

    def eagle():
        return target.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=draft,
            exact_attention=exact_attention,
        )

    plain(), eagle()  # warm-up: every kernel shape of both methods
    plain_seconds, eagle_seconds, acceptance = [], [], []
    for _ in range(repetitions):  # interleaved, so that machine noise hits both alike
        seconds, plain_output = _timed(plain)
        plain_seconds.append(seconds)
        seconds, eagle_output = _timed(eagle)
        eagle_seconds.append(seconds)
        acceptance.append(draft.generation_stats.mean_acceptance_length)
    new_tokens = eagle_output.shape[1] - prompt_length
    return {
        "text": tokenizer.decode(eagle_output[0, prompt_length:], skip_special_tokens=True),
        "identical_to_plain": torch.equal(plain_output, eagle_output),
        "new_tokens": new_tokens,
        "plain_tokens_per_second": (plain_output.shape[1] - prompt_length) / statistics.median(plain_seconds),
        "eagle_tokens_per_second": new_tokens / statistics.median(eagle_seconds),
        "speedup": statistics.median(p / e for p, e in zip(plain_seconds, eagle_seconds)),
        "acceptance_length": statistics.median(acceptance),
        "settings": draft.generation_stats.settings,
    }


def _run(args: argparse.Namespace) -> None:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    result = run_demo(args.prompt, args.max_new_tokens, dtype, args.repetitions, args.threads, args.exact_attention)
    settings = result["settings"]
    print(result["text"])
    print()
    print(f"target: SmolLM2-135M-Instruct ({args.dtype}), draft: shipped EAGLE-3 "
          f"(tree depth {settings.depth}, top-k {settings.top_k}, {settings.total_tokens} tokens"
          f"{', exact attention' if args.exact_attention else ''})")
    print(f"plain generate : {result['plain_tokens_per_second']:7.1f} tokens/s")
    print(f"EAGLE-3        : {result['eagle_tokens_per_second']:7.1f} tokens/s")
    print(f"speedup        : {result['speedup']:.2f}x (median of {args.repetitions} interleaved runs)")
    print(f"acceptance length (tokens per target forward): {result['acceptance_length']:.2f}")
    print(f"output identical to plain greedy decoding: {result['identical_to_plain']}")
    if not result["identical_to_plain"] and dtype != torch.float32:
        print("(in reduced precision the multi-token verification forward rounds differently from one-token decoding, "
              "so near-ties can flip; --exact-attention or --dtype float32 give plain decoding's output bit for bit)")


def register_cli(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="EAGLE-3 vs plain generate on the embedded SmolLM2 target.")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--exact-attention", action="store_true",
                        help="verify with exact_attention=True (bf16 output identical to plain decoding, slower)")
    parser.set_defaults(run=_run)
