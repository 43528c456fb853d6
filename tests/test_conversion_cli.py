"""`hf-eagle3 convert` on the command line."""

import json

import pytest
import torch
from conversion_fixtures import (
    DEFAULT_TAPS,
    HIDDEN,
    TARGET_LAYERS,
    VOCAB,
    _rewrite,
    official_fixture,
    sglang_fixture,
    write_json,
)
from hf_eagle3.conversion import ConversionError, convert
from safetensors.torch import load_file, save_file

from hf_eagle3.commands import cli
from hf_eagle3.resources.loading import SHIPPED_DRAFT
from hf_eagle3.resources.smollm2 import SMOLLM2_NAME, smollm2_path


@pytest.fixture
def only_our_commands(monkeypatch):
    monkeypatch.setattr(cli, "COMMAND_MODULES", ["hf_eagle3.conversion.cli", "hf_eagle3.publishing.hub"])


def test_ambiguous_source_asks_for_the_format(tmp_path, capsys, only_our_commands):
    source = tmp_path / "bare"
    source.mkdir()
    official_fixture(source)
    _rewrite(source, lambda config: config.pop("architectures"))

    with pytest.raises(SystemExit, match="could be any of official, sglang.*Pass --from"):
        cli.main(["convert", str(source), str(tmp_path / "out"), "--target-num-layers", str(TARGET_LAYERS)])
    assert not (tmp_path / "out").exists()

    cli.main(["convert", str(source), str(tmp_path / "out"), "--from", "official", "--target-num-layers", "12"])
    assert "(official) ->" in capsys.readouterr().out


def test_unknown_source_lists_every_format(tmp_path):
    source = tmp_path / "gpt2"
    source.mkdir()
    write_json(source / "config.json", {"model_type": "gpt2"})
    save_file({"wte.weight": torch.zeros(4, 4)}, source / "model.safetensors")
    with pytest.raises(
        ConversionError, match="matches no known format.*hub .*official .*sglang .*speculators .*modelopt"
    ):
        convert(source, tmp_path / "out")


def test_cli_reads_the_target_config(tmp_path, capsys, only_our_commands):
    source = tmp_path / "official"
    source.mkdir()
    official_fixture(source)
    target_config = tmp_path / "target.json"
    write_json(
        target_config, {"model_type": "llama", "num_hidden_layers": 12, "hidden_size": HIDDEN, "vocab_size": VOCAB}
    )

    cli.main(["convert", str(source), str(tmp_path / "out"), "--target-config", str(target_config)])

    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["target_layer_ids"] == DEFAULT_TAPS and config["target_model_type"] == "llama"
    assert f"target hidden_states {DEFAULT_TAPS}" in capsys.readouterr().out

    write_json(target_config, {"num_hidden_layers": 12, "hidden_size": HIDDEN, "vocab_size": VOCAB + 1})
    with pytest.raises(SystemExit, match="vocab_size"):
        cli.main(["convert", str(source), str(tmp_path / "out2"), "--target-config", str(target_config)])


def test_cli_picks_the_yarn_reading_and_prints_the_notes(tmp_path, capsys, only_our_commands):
    (tmp_path / "src").mkdir()
    sglang_fixture(tmp_path / "src")
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "mscale": 1.0}
    _rewrite(tmp_path / "src", lambda config: config.update(rope_scaling=yarn))

    cli.main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--yarn-mscale", "serving"])

    assert "note: YaRN mscale dropped (yarn_mscale='serving')" in capsys.readouterr().out
    assert "mscale" not in json.loads((tmp_path / "out" / "config.json").read_text())["rope_parameters"]


@pytest.mark.slow  # reads the embedded SmolLM2 (its safetensors cache, built from the GGUF on first use)
def test_convert_takes_smollm2_for_the_embedded_target_as_every_other_command_does(tmp_path, capsys):
    cli.main(["convert", str(SHIPPED_DRAFT), str(tmp_path / "vllm"), "--to", "speculators",
              "--target-embedding", "smollm2", "--target-config", "smollm2", "--target-name-or-path", "smollm2"])

    assert "(sglang) -> " in capsys.readouterr().out
    exported = load_file(tmp_path / "vllm" / "model.safetensors")
    embedding = load_file(smollm2_path() / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(exported["embed_tokens.weight"], embedding.to(exported["embed_tokens.weight"].dtype))
    assert SMOLLM2_NAME in (tmp_path / "vllm" / "config.json").read_text()
    with pytest.raises(SystemExit):
        cli.main(["convert", "--help"])
    assert " ".join(capsys.readouterr().out.split()).count("or 'smollm2' for the embedded") == 3
