"""Checkpoint files: sharded, malformed or damaged input is refused and a failed conversion writes nothing."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conversion_fixtures import (
    DRAFT_VOCAB,
    TARGET_LAYERS,
    VOCAB,
    official_fixture,
    sglang_fixture,
    sglang_sharded_fixture,
    write_json,
)
from helpers import tiny_draft
from hf_eagle3.conversion import ConversionError, TargetInfo, convert
from safetensors.torch import load_file, save_file

from hf_eagle3 import Eagle3DraftModel
from hf_eagle3.commands import cli


def test_sharded_checkpoint_is_read_whole(tmp_path):
    tiny_draft().save_pretrained(tmp_path / "hub", max_shard_size="20KB")
    assert (tmp_path / "hub" / "model.safetensors.index.json").is_file()
    checkpoint, _ = convert(tmp_path / "hub", tmp_path / "out", to_format="sglang")
    assert set(load_file(tmp_path / "out" / "model.safetensors")) == set(checkpoint.tensors)


def _drop(name):
    return lambda config, tensors: tensors.pop(name)


def _set_tensor(name, make):
    return lambda config, tensors: tensors.__setitem__(name, make(tensors))


def _set_config(path, value):
    def mutate(config, tensors):
        *parents, key = path.split(".")
        for parent in parents:
            config = config[parent]
        config[key] = value

    return mutate


def _count_one_more_token(tensors):
    t2d = tensors["t2d"].clone()
    t2d[(~t2d).nonzero()[0]] = True
    return t2d


MALFORMED = {
    "missing key": (_drop("midlayer.mlp.up_proj.weight"), r"missing \['midlayer.mlp.up_proj.weight'\]"),
    "unknown key": (_set_tensor("midlayer.extra.weight", lambda t: torch.zeros(3)), r"unknown \['midlayer.extra"),
    "wrong shape": (
        _set_tensor("fc.weight", lambda t: t["fc.weight"].T.contiguous()),
        r"fc.weight \(144, 32\) \(expected \(32, 144\)\)",
    ),
    "d2t out of range": (
        _set_tensor("d2t", lambda t: t["d2t"].clone().index_fill(0, torch.tensor([DRAFT_VOCAB - 1]), VOCAB)),
        "outside the target vocabulary",
    ),
    "duplicate d2t": (
        _set_tensor("d2t", lambda t: torch.zeros(DRAFT_VOCAB, dtype=torch.long).index_fill(0, torch.tensor([1]), -1)),
        "same target id",
    ),
    "t2d count": (_set_tensor("t2d", _count_one_more_token), f"marks {DRAFT_VOCAB + 1} target tokens"),
    "missing d2t": (_drop("d2t"), "no d2t"),
    "d2t dtype": (_set_tensor("d2t", lambda t: t["d2t"].int()), "d2t has dtype torch.int32"),
    "t2d dtype": (_set_tensor("t2d", lambda t: t["t2d"].to(torch.uint8)), "t2d has dtype torch.uint8"),
    "mixed weight dtypes": (_set_tensor("norm.weight", lambda t: t["norm.weight"].float()), "one floating-point dtype"),
    "layer ids outside the target": (
        _set_config("eagle_config.eagle_aux_hidden_state_layer_ids", [1, 5, 12]),
        r"outside a target with 12 layers",
    ),
    "fc_norm without its weights": (_set_config("fc_norm", True), r"missing \['fc_norm.0.weight'"),
    "no aux hidden states": (_set_config("eagle_config.use_aux_hidden_state", False), "EAGLE-1/2"),
    "invalid config": (_set_config("draft_vocab_size", VOCAB + 1), "draft_vocab_size"),
}


@pytest.mark.parametrize("mutation, message", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_checkpoint_is_refused_and_nothing_is_written(tmp_path, mutation, message):
    source = tmp_path / "specforge"
    source.mkdir()
    sglang_fixture(source)
    config = json.loads((source / "config.json").read_text())
    tensors = load_file(source / "model.safetensors")
    mutation(config, tensors)
    write_json(source / "config.json", config)
    save_file(tensors, source / "model.safetensors")

    with pytest.raises(ConversionError, match=message):
        convert(source, tmp_path / "out" / "draft", target=TargetInfo(num_hidden_layers=TARGET_LAYERS))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["specforge"]


def test_bin_files_are_never_unpickled_beyond_tensors(tmp_path):
    source = tmp_path / "official"
    source.mkdir()
    fixture = official_fixture(source)
    torch.save({**fixture.tensors, "hook": print}, source / "pytorch_model.bin")
    with pytest.raises(ConversionError, match="weights_only=True refuses"):
        convert(source, tmp_path / "out", target=fixture.target)
    assert not (tmp_path / "out").exists()


def test_existing_destination_is_not_overwritten(tmp_path):
    tiny_draft().save_pretrained(tmp_path / "hub", served_layout=False)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="already exists"):
        convert(tmp_path / "hub", tmp_path / "out", to_format="sglang")
    assert [path.name for path in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_non_finite_weights_are_refused(tmp_path):
    draft = tiny_draft()
    with torch.no_grad():
        draft.fc.weight[0, 0] = float("inf")
    draft.save_pretrained(tmp_path / "hub", served_layout=False)
    with pytest.raises(ConversionError, match="NaN or infinite values in fc.weight"):
        convert(tmp_path / "hub", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage, message", [
    ("no weight_map", "has no weight_map"),
    ("shard outside", "lies outside"),
    ("missing shard", "is missing from"),
    ("truncated safetensors", "not a readable safetensors file"),
    ("bin holding a list", "holds a list, not a state dict"),
    ("bin holding a tensor", "holds a Tensor, not a state dict"),
    ("garbage bin", "damaged, or holds objects other than tensors"),
])
def test_damaged_weight_files_are_named_not_tracebacks(tmp_path, damage, message):
    source = tmp_path / "hub"
    tiny_draft().save_pretrained(source, max_shard_size="20KB" if "shard" in damage or "map" in damage else "1GB")
    index = source / "model.safetensors.index.json"
    if damage == "no weight_map":
        index.write_text(json.dumps({"metadata": {}}))
    elif damage == "shard outside":
        weight_map = json.loads(index.read_text())["weight_map"]
        (tmp_path / "elsewhere.safetensors").write_bytes((source / next(iter(weight_map.values()))).read_bytes())
        index.write_text(json.dumps({"weight_map": {name: "../elsewhere.safetensors" for name in weight_map}}))
    elif damage == "missing shard":
        (source / next(iter(json.loads(index.read_text())["weight_map"].values()))).unlink()
    elif damage == "truncated safetensors":
        weights = source / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    else:
        (source / "model.safetensors").unlink()
        contents = {"bin holding a list": [torch.zeros(2)], "bin holding a tensor": torch.zeros(2)}.get(damage)
        if contents is None:
            (source / "pytorch_model.bin").write_bytes(b"garbage, not a pickle")
        else:
            torch.save(contents, source / "pytorch_model.bin")
    with pytest.raises(ConversionError, match=message):
        convert(source, tmp_path / "out")


def hub_cache_snapshot(folder: Path, cache: Path) -> Path:
    """`folder`'s files as the Hub cache stores a download: `snapshots/<revision>/<name>` links to
    `../../blobs/<sha>`."""
    repo = cache / "models--org--draft"
    snapshot, blobs = repo / "snapshots" / "0123abcd", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for file in folder.iterdir():
        blob = hashlib.sha256(file.read_bytes()).hexdigest()
        file.rename(blobs / blob)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob))
    return snapshot


def test_a_sharded_foreign_checkpoint_in_the_hub_cache_converts_and_loads(tmp_path):
    (tmp_path / "download").mkdir()
    fixture = sglang_sharded_fixture(tmp_path / "download")
    snapshot = hub_cache_snapshot(tmp_path / "download", tmp_path / "hub-cache")
    cli.main(["convert", str(snapshot), str(tmp_path / "out")])
    draft = Eagle3DraftModel.from_pretrained(snapshot)
    assert torch.equal(draft.fc.weight.to(fixture.tensors["fc.weight"].dtype), fixture.tensors["fc.weight"])
    # a link that leaves the repo's cache folder is still refused
    shard = snapshot / "model-00001-of-00002.safetensors"
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(outside)
    with pytest.raises(SystemExit, match="lies outside"):
        cli.main(["convert", str(snapshot), str(tmp_path / "out2")])


def test_a_killed_conversions_staging_folder_is_removed_by_the_next_run(tmp_path):
    tiny_draft().save_pretrained(tmp_path / "hub", served_layout=False)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True, capture_output=True,
                          text=True)
    abandoned = tmp_path / f".hf-eagle3-convert-{dead.stdout.strip()}-abc123"
    (abandoned / "out").mkdir(parents=True)
    running = tmp_path / f".hf-eagle3-convert-{os.getpid()}-def456"  # a conversion still running: kept
    running.mkdir()
    convert(tmp_path / "hub", tmp_path / "out")
    assert not abandoned.exists() and running.exists()


def test_a_converted_folder_has_the_modes_of_a_folder_written_in_place(tmp_path):
    tiny_draft().save_pretrained(tmp_path / "hub", served_layout=False)
    convert(tmp_path / "hub", tmp_path / "out")
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask
    assert all(path.stat().st_mode & 0o777 == 0o666 & ~umask for path in (tmp_path / "out").iterdir())


FULL_DISK = """
import resource, signal, sys
sys.path.insert(0, {tests!r})
from hf_eagle3.conversion import ConversionError, convert
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
try:
    convert({source!r}, {destination!r})
except ConversionError as error:
    print(error)
"""


@pytest.mark.parametrize("limit", [8_000, 30_000])  # the failure lands in the code files / in the weights
def test_a_full_destination_writes_nothing_and_says_so(tmp_path, limit):
    tiny_draft().save_pretrained(tmp_path / "hub", served_layout=False)
    script = FULL_DISK.format(tests=str(Path(__file__).parent), limit=limit, source=str(tmp_path / "hub"),
                              destination=str(tmp_path / "out"))
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert "Nothing was written; free space" in result.stdout, result.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".hf-eagle3-convert-*"))
