"""llama.cpp as vendored in the `llama-cpp-python` sdist (the Python bindings have no EAGLE-3; the binaries do),
built by `make engines` under the user cache: plain greedy decoding (`llama-completion`) and EAGLE-3 drafting a chain
(`llama-speculative-simple --spec-type draft-eagle3`), float32 GGUFs made by llama.cpp's own converter.

Its tools are one-shot, so each prompt runs a process of its own; the times are each tool's own, taken after the model
has loaded: `llama-completion`'s `total time` and `llama-speculative-simple`'s encoding and decoding seconds.
"""

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

from ..utils.cache import cache_dir
from .process import EngineNotBuilt, EngineOutput

NAME = "llama.cpp"
SDIST = "llama-cpp-python==0.3.36"  # its sdist vendors llama.cpp with EAGLE-3 (`--spec-type draft-eagle3`)
# Plain greedy decoding, and the speculative loop with its acceptance counts; neither needs the server's web UI.
TARGETS = ["llama-completion", "llama-speculative-simple"]
CMAKE = ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
         "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF",
         "-DLLAMA_USE_PREBUILT_UI=OFF"]


def home() -> Path:
    """The sdist, its source, the build and the converter's virtualenv."""
    return cache_dir() / "engines" / "llama.cpp"


def _source() -> Path:
    return home() / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"


def _converter() -> Path:
    return home() / "convert-venv" / "bin" / "python"


def build() -> None:
    """`TARGETS`, built on first use (minutes) from the registry's sdist, and the converter's virtualenv, which adds
    `gguf` (from the source) and `sentencepiece` to this interpreter's packages."""
    if not all((home() / "build" / "bin" / name).exists() for name in TARGETS):
        if not _source().exists():
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                            "--dest", home(), SDIST], check=True)
            with tarfile.open(next(home().glob("llama_cpp_python-*.tar.gz"))) as sdist:
                sdist.extractall(home(), filter="data")
        subprocess.run(["cmake", "-S", _source(), "-B", home() / "build", *CMAKE], check=True)
        subprocess.run(["cmake", "--build", home() / "build", "--target", *TARGETS, "--parallel"], check=True)
    if not _converter().exists():
        venv = _converter().parents[1]
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        site_packages = next(venv.glob("lib/python*/site-packages"))
        (site_packages / "parent.pth").write_text("\n".join(p for p in sys.path if p.endswith("site-packages")))
        subprocess.run([_converter(), "-m", "pip", "install", "--quiet", "sentencepiece", _source() / "gguf-py"],
                       check=True)


def require_built() -> Path:
    """The folder of `TARGETS`; `EngineNotBuilt` where `make engines` has not built them and the converter."""
    binaries = home() / "build" / "bin"
    for path in [*(binaries / name for name in TARGETS), _converter()]:
        if not path.exists():
            raise EngineNotBuilt(NAME, path)
    return binaries


def gguf(model: Path, outfile: Path, target: Path | None = None) -> Path:
    """`model` converted to a float32 GGUF by llama.cpp's own converter, once (`outfile` is kept); a draft needs its
    `target` folder (the vocabulary, the target's layer count)."""
    if not outfile.exists():
        draft_args = [] if target is None else ["--target-model-dir", target]
        subprocess.run([_converter(), _source() / "convert_hf_to_gguf.py", model, *draft_args, "--outtype", "f32",
                        "--outfile", outfile], check=True, capture_output=True)
    return outfile


class LlamaCpp:
    """`llama-completion` (`draft` None) or `llama-speculative-simple` drafting a chain of `k` with `draft`, on GGUFs;
    a prompt's token ids are given to it as text (`tokenizer.decode`), which llama.cpp tokenizes with its special
    tokens."""

    def __init__(self, binaries: Path, target: Path, draft: Path | None, k: int, tokenizer):
        self.binaries, self.draft, self.k, self.tokenizer = binaries, draft, k, tokenizer
        self.threads = str(os.cpu_count())
        self.common = ["-m", target, "--temp", "0", "-t", self.threads, "-tb", self.threads, "-c", "2048", "--seed",
                       "0"]
        version = subprocess.run([self.binaries / TARGETS[0], "--version"], capture_output=True, text=True)
        self.engine = {"engine": NAME, "version": f"{SDIST} sdist, " + _logged(r"version: (.+)", version.stderr)[0]}

    def generate(self, prompt: list[int], max_new_tokens: int) -> EngineOutput:
        text = self.tokenizer.decode(prompt)
        if self.draft is None:
            run = _run([self.binaries / "llama-completion", *self.common, "-n", str(max_new_tokens), "-no-cnv",
                        "--no-display-prompt", "-p", text])
            milliseconds, = map(float, _logged(r"common_perf_print: +total time = +([\d.]+) ms", run.stderr))
            runs, = map(int, _logged(r"common_perf_print: +eval time = +[\d.]+ ms / +(\d+) runs", run.stderr))
            # the text alone; " [end of text]" marks an end-of-generation token; the prompt's forward makes the first
            output = run.stdout.removeprefix("\n").removesuffix("\n\n").removesuffix(" [end of text]\n")
            return EngineOutput(output, milliseconds / 1000, runs + 1)
        run = _run([self.binaries / "llama-speculative-simple", *self.common, "-md", self.draft, "--spec-type",
                    "draft-eagle3", "--spec-draft-n-max", str(self.k), "--spec-draft-n-min", "0",
                    "--spec-draft-p-min", "0", "-td", self.threads,
                    "-n", str(max_new_tokens - 1), "-p", text])  # it stops once it has produced more than -n tokens
        encoding, = map(float, _logged(r"encoded +\d+ tokens in +([\d.]+) seconds", run.stderr))
        predicted, decoding = map(float, _logged(r"decoded +(\d+) tokens in +([\d.]+) seconds", run.stderr))
        accepted, = map(int, _logged(r"n_accept += (\d+)", run.stderr))
        output = run.stdout.removeprefix("\n\n").removesuffix("\n\n\n\n").removeprefix(text)  # the prompt, the text
        # a target forward a step: its tokens are the accepted drafted ones and the target's own
        return EngineOutput(output, encoding + decoding, int(predicted), int(predicted) - accepted, accepted)

    def close(self) -> None:
        """Nothing to close: each prompt's process has ended."""


def start(target: Path, draft: Path | None, work: Path, tree: dict, tokenizer) -> LlamaCpp:
    """llama.cpp decoding with `target` (a transformers folder), plainly (`draft` None) or with the `draft` folder (as
    `save_pretrained` writes it) drafting a chain of `tree["tree_depth"]` tokens, both converted into `work` once."""
    binaries = require_built()
    target_gguf = gguf(target, work / "target.gguf")
    draft_gguf = None if draft is None else gguf(draft, work / "draft.gguf", target)
    return LlamaCpp(binaries, target_gguf, draft_gguf, tree["tree_depth"], tokenizer)


def _run(command: list) -> subprocess.CompletedProcess:
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"{Path(command[0]).name} failed:\n{run.stderr[-4000:]}")
    return run


def _logged(pattern: str, log: str) -> tuple[str, ...]:
    match = re.search(pattern, log)
    if match is None:
        raise RuntimeError(f"llama.cpp's log has no line matching {pattern!r}:\n{log[-2000:]}")
    return match.groups()
