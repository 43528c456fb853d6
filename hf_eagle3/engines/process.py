"""An engine method's decoding, one prompt a call, in a process of its own that loads the engine once: the side
scripts of `sides/` run under each engine's own Python and answer over stdin and stdout (`sides/protocol.py`).
"""

import json
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SIDES = Path(__file__).with_name("sides")


class EngineNotBuilt(RuntimeError):
    """An engine's environment (its virtualenv, or llama.cpp's build) is missing: `make engines` builds it."""

    def __init__(self, engine: str, missing: Path):
        super().__init__(f"{engine} is not built here ({missing} is missing): run `make engines` in an hf-eagle3 "
                         "checkout, which builds every engine under the user cache, then run again.")


@dataclass(frozen=True)
class EngineOutput:
    """One greedy decoding by an engine: the new tokens' ids (llama.cpp: their text), the engine's time for the call
    (the prompt's forward included, the model's loading not), how many tokens it generated, and from its own counters
    the target forwards that verified drafted tokens (`cycles`) and the drafted tokens they accepted."""

    output: list[int] | str
    seconds: float
    new_tokens: int
    cycles: int = 0
    accepted: int = 0

    def same_as(self, plain: "EngineOutput", max_new_tokens: int) -> bool:
        """Whether this output equals the engine's `plain` one; an output that ran past `max_new_tokens` (llama.cpp's
        last speculative step can) is compared up to the plain output's length."""
        if self.new_tokens > max_new_tokens:
            return self.output[: len(plain.output)] == plain.output
        return self.output == plain.output


class SideProcess:
    """A side script of `sides/` under an engine's `python`, started with its `settings`; `generate` sends it one
    prompt. Its stderr (the engine's logs) goes to a temporary file, whose end an error shows."""

    def __init__(self, python: Path, side: str, settings: dict, env: dict | None = None):
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen([python, SIDES / side, json.dumps(settings)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self.side = side
        self.engine = self._read()  # {"engine": NAME, "version": VERSION}, once the engine has loaded

    def generate(self, prompt: list[int], max_new_tokens: int) -> EngineOutput:
        self.process.stdin.write(json.dumps({"prompt": prompt, "max_new_tokens": max_new_tokens}) + "\n")
        self.process.stdin.flush()
        result = self._read()
        return EngineOutput(result["tokens"], result["seconds"], len(result["tokens"]), result["cycles"],
                            result["accepted"])

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            self.log.seek(0)
            raise RuntimeError(f"{self.side} stopped (exit status {self.process.returncode}):\n"
                               + self.log.read()[-4000:])
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()
        self.log.close()
