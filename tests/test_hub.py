"""Hub publishing with no network: remote code, a seeded local cache, and pushes against a mocked Hub client."""

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path
from unittest import mock

import huggingface_hub
import pytest
import torch
from helpers import tiny_draft
from hf_eagle3.conversion import ConversionError, convert
from huggingface_hub import CommitInfo, HfApi, ModelCard
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from hf_eagle3 import Eagle3DraftModel
from hf_eagle3.commands import cli
from hf_eagle3.commands.bench import draft_record, methods_from_names, run_benchmark
from hf_eagle3.publishing.hub import CARD_TAGS, LIBRARY_NAME, load_results, push_folder, upload_operations
from hf_eagle3.resources.loading import SHIPPED_DRAFT
from hf_eagle3.resources.smollm2 import smollm2_dir
from hf_eagle3.training.trainer import TrainConfig, train

REPO_ROOT = Path(__file__).resolve().parents[1]
SAVED_FILES = {"config.json", "model.safetensors", "modeling_eagle3.py", "configuration_eagle3.py"}
RESULTS = [
    {"dataset": "mt-bench", "temperature": 0.0, "acceptance_length": 3.41, "speedup": 2.13},
    {"dataset": "humaneval", "temperature": 0.0, "acceptance_length": 3.87, "speedup": 2.45},
]


def run_python(script: str, cwd: Path, python: str | Path = sys.executable, **env: str) -> str:
    """Run `script` in a fresh `python` interpreter with only `env` (and PATH) set; return its stdout."""
    result = subprocess.run(
        [python, "-c", textwrap.dedent(script)],
        check=False,
        cwd=cwd,
        env={"PATH": os.environ["PATH"], "HF_HUB_OFFLINE": "1", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture
def saved_draft(tmp_path) -> Path:
    folder = tmp_path / "draft"
    tiny_draft(target_name_or_path="org/target").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def python_without_hf_eagle3(tmp_path_factory) -> Path:
    """The interpreter of a fresh virtualenv that has this environment's packages (torch, transformers, ...) but not
    hf-eagle3, as on a machine where it was never installed: neither importable nor known to `importlib.metadata`
    (transformers checks a `requirements.txt` against the installed distributions).

    `venv --without-pip` (a second), whose site-packages holds one `.pth` line naming a folder of links to every entry
    of this environment's site-packages but hf-eagle3's (its `.dist-info` and editable-install finder). A `.pth` line
    only puts that folder on `sys.path`: the `.pth` files inside it are not run; nor is the repository on it, since
    the scripts run elsewhere."""
    root = tmp_path_factory.mktemp("venv-without-hf-eagle3")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True, timeout=120)
    python = root / "venv" / "bin" / "python"
    packages = root / "packages"
    packages.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(("hf_eagle3", "__editable__")):
            (packages / entry.name).symlink_to(entry)
    site_packages = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    (Path(site_packages) / "packages-of-the-test-environment.pth").write_text(f"{packages}\n")
    return python


def test_saved_and_shipped_drafts_load_with_trust_remote_code_where_hf_eagle3_is_not_installed(
    tmp_path, saved_draft, python_without_hf_eagle3
):
    assert SAVED_FILES <= {path.name for path in saved_draft.iterdir()}
    assert SAVED_FILES <= {path.name for path in SHIPPED_DRAFT.iterdir()}
    # The served layout (the shipped draft's too) names no AutoConfig: the engines read its config as the LlamaConfig
    # it is, with trust_remote_code too.
    for folder in (saved_draft, SHIPPED_DRAFT):
        assert json.loads((folder / "config.json").read_text())["auto_map"] == {
            "AutoModel": "modeling_eagle3.Eagle3DraftModel",
        }
    shipped = tmp_path / "smollm2-eagle3"  # as downloaded from the Hub: custom_generate/ included
    shutil.copytree(SHIPPED_DRAFT, shipped)
    output = run_python(
        f"""
        import importlib.metadata, importlib.util
        assert importlib.util.find_spec("hf_eagle3") is None  # not installed here
        assert not any(d.metadata["Name"] == "hf-eagle3" for d in importlib.metadata.distributions())
        import torch
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModel

        for folder in ({str(saved_draft)!r}, {str(shipped)!r}):
            draft = AutoModel.from_pretrained(folder, trust_remote_code=True)
            state = draft.state_dict()
            saved = load_file(folder + "/model.safetensors")
            assert all(torch.equal(state[name], tensor) for name, tensor in saved.items())
            print(type(draft).__module__.split(".")[0], type(draft).__name__, draft.dtype, draft.config.tree_depth)
        print(type(AutoConfig.from_pretrained({str(saved_draft)!r}, trust_remote_code=True)).__name__)
        """,
        cwd=tmp_path,
        python=python_without_hf_eagle3,
        HF_HOME=str(tmp_path / "hf_home"),
    )
    shipped_depth = json.loads((shipped / "config.json").read_text())["hf_eagle3"]["tree_depth"]
    assert output.splitlines() == [
        "transformers_modules Eagle3DraftModel torch.float32 4",
        f"transformers_modules Eagle3DraftModel torch.bfloat16 {shipped_depth}",
        "LlamaConfig",
    ]


def test_the_remote_code_class_without_hf_eagle3_reads_no_foreign_format_and_pushes_as_transformers_does(
    tmp_path, saved_draft, python_without_hf_eagle3
):
    """The foreign-format reader and the card-writing pusher are registered by `import hf_eagle3`, not built in."""
    output = run_python(
        f"""
        from transformers import AutoModel

        draft = AutoModel.from_pretrained({str(saved_draft)!r}, trust_remote_code=True)
        cls = type(draft)
        print(cls._checkpoint_reader, cls._pusher)
        try:
            cls.from_pretrained({str(saved_draft)!r}, from_format="sglang")
        except ValueError as error:
            print(error)
        """,
        cwd=tmp_path,
        python=python_without_hf_eagle3,
        HF_HOME=str(tmp_path / "hf_home"),
    )
    assert output.splitlines() == [
        "None None",
        "from_format='sglang' reads another project's checkpoint, which needs hf-eagle3 (no package index serves it: "
        "`pip install ./hf-eagle3` in a clone of its repository), then `from hf_eagle3 import Eagle3DraftModel` and "
        "load with it.",
    ]


def test_generate_with_a_draft_where_hf_eagle3_is_not_installed_says_to_install_it(
    tmp_path, saved_draft, python_without_hf_eagle3
):
    output = run_python(
        f"""
        import torch
        from transformers import AutoModel, LlamaConfig, LlamaForCausalLM

        draft = AutoModel.from_pretrained({str(saved_draft)!r}, trust_remote_code=True)
        target = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                                              num_attention_heads=4, num_key_value_heads=2))
        try:
            target.generate(torch.tensor([[3, 5, 7]]), assistant_model=draft, max_new_tokens=5, do_sample=False)
        except TypeError as error:
            print(error)
        """,
        cwd=tmp_path,
        python=python_without_hf_eagle3,
        HF_HOME=str(tmp_path / "hf_home"),
    )
    assert "needs hf-eagle3 (no package index serves it: `pip install ./hf-eagle3` in a clone" in output


def test_the_shipped_custom_generate_where_hf_eagle3_is_not_installed_says_how_to_install_it(
    tmp_path, python_without_hf_eagle3
):
    shipped = tmp_path / "smollm2-eagle3"
    shutil.copytree(SHIPPED_DRAFT, shipped)
    output = run_python(
        f"""
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        target = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                                              num_attention_heads=4, num_key_value_heads=2))
        try:
            target.generate(torch.tensor([[3, 5, 7]]), custom_generate={str(shipped)!r}, trust_remote_code=True,
                            max_new_tokens=5)
        except ImportError as error:
            print(error)
        """,
        cwd=tmp_path,
        python=python_without_hf_eagle3,
        HF_HOME=str(tmp_path / "hf_home"),
    )
    assert "EAGLE-3 decoding needs hf-eagle3, which no package index serves" in output
    assert "`pip install ./hf-eagle3`" in output


def test_with_hf_eagle3_imported_trust_remote_code_loads_its_class_and_one_loaded_before_is_named(
    saved_draft, llama_target, tmp_path
):
    own_layout = tmp_path / "hf-eagle3-layout"
    Eagle3DraftModel.from_pretrained(saved_draft).save_pretrained(own_layout, served_layout=False)
    draft = AutoModel.from_pretrained(own_layout, trust_remote_code=True)  # a registered class wins over remote code
    assert type(draft) is Eagle3DraftModel
    llama_target.generate(torch.tensor([[3, 5, 7]]), assistant_model=draft, max_new_tokens=5, do_sample=False)
    assert draft.generation_stats.num_cycles > 0
    # The served layout's config is a LlamaConfig, for which no registered class wins: the checkpoint's own class.
    assert type(AutoModel.from_pretrained(saved_draft, trust_remote_code=True)).__module__.startswith(
        "transformers_modules.")

    output = run_python(  # loaded as remote code before hf_eagle3 was imported: the checkpoint's own class
        f"""
        import torch
        from transformers import AutoModel, LlamaConfig, LlamaForCausalLM

        draft = AutoModel.from_pretrained({str(saved_draft)!r}, trust_remote_code=True)
        import hf_eagle3
        target = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                                              num_attention_heads=4, num_key_value_heads=2))
        try:
            target.generate(torch.tensor([[3, 5, 7]]), assistant_model=draft, max_new_tokens=5, do_sample=False)
        except TypeError as error:
            print(type(draft).__module__.split(".")[0], error)
        """,
        cwd=tmp_path,
        HF_HOME=str(tmp_path / "hf_home"),
        PYTHONPATH=str(REPO_ROOT),
    )
    assert output.startswith("transformers_modules ") and "load the draft after the import" in output


def test_the_remote_code_shipped_with_the_draft_is_the_packages_code():
    for name in ("configuration_eagle3.py", "modeling_eagle3.py"):
        assert (SHIPPED_DRAFT / name).read_text() == (REPO_ROOT / "hf_eagle3" / name).read_text(), (
            f"re-copy hf_eagle3/{name} to {SHIPPED_DRAFT.relative_to(REPO_ROOT)}/"
        )


def test_from_pretrained_and_convert_resolve_a_repo_id_from_the_local_cache(tmp_path, saved_draft):
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo_cache = tmp_path / "hf_home" / "hub" / "models--org--name"
    snapshot = repo_cache / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for path in saved_draft.iterdir():
        (snapshot / path.name).write_bytes(path.read_bytes())
    (repo_cache / "refs").mkdir()
    (repo_cache / "refs" / "main").write_text(revision)

    output = run_python(
        f"""
        import torch
        from safetensors.torch import load_file
        from hf_eagle3.conversion import convert
        from hf_eagle3 import Eagle3DraftModel

        draft = Eagle3DraftModel.from_pretrained("org/name")
        state = draft.state_dict()
        assert all(torch.equal(state[n], t) for n, t in load_file({str(saved_draft / "model.safetensors")!r}).items())
        convert("org/name", {str(tmp_path / "sglang")!r}, to_format="sglang")
        print("resolved", draft.config.target_name_or_path)
        """,
        cwd=tmp_path,
        HF_HOME=str(tmp_path / "hf_home"),
        PYTHONPATH=str(REPO_ROOT),
    )
    assert output.split() == ["resolved", "org/target"]
    assert (tmp_path / "sglang" / "model.safetensors").is_file()


@pytest.fixture
def mocked_hub(monkeypatch):
    """`HfApi.create_repo` / `create_commit` mocked; each commit's files are read while they still exist."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    commits = []

    def create_commit(repo_id, operations, **kwargs):
        files = {operation.path_in_repo: _content(operation.path_or_fileobj) for operation in operations}
        commits.append({"repo_id": repo_id, "files": files, **kwargs})
        return CommitInfo(commit_url=f"https://huggingface.co/{repo_id}/commit/1", commit_message="",
                          commit_description="", oid="1")

    with (
        mock.patch.object(HfApi, "create_repo", side_effect=lambda repo_id, **_: mock.Mock(repo_id=repo_id)) as repo,
        mock.patch.object(HfApi, "create_commit", side_effect=create_commit),
    ):
        yield repo, commits


def _content(path_or_bytes) -> bytes:
    return path_or_bytes if isinstance(path_or_bytes, bytes) else Path(path_or_bytes).read_bytes()


def test_push_to_hub_sends_the_checkpoint_and_a_model_card(mocked_hub, saved_draft):
    create_repo, commits = mocked_hub
    draft = tiny_draft(target_name_or_path="org/target")

    url = draft.push_to_hub("org/eagle3-draft", private=True, results=RESULTS, commit_message="First draft",
                            commit_description="Trained for 4 steps.", tags=["my-tag"])

    assert isinstance(url, str) and url == "https://huggingface.co/org/eagle3-draft/commit/1"  # as transformers returns
    create_repo.assert_called_once_with("org/eagle3-draft", private=True, exist_ok=True)
    (commit,) = commits
    assert commit["repo_id"] == "org/eagle3-draft" and set(commit["files"]) == SAVED_FILES | {"README.md"}
    assert commit["commit_message"] == "First draft" and commit["commit_description"] == "Trained for 4 steps."
    assert commit["files"]["model.safetensors"] == (saved_draft / "model.safetensors").read_bytes()
    card = ModelCard(commit["files"]["README.md"].decode())
    assert card.data.base_model == "org/target" and card.data.library_name == "transformers"
    assert {"eagle3", "speculative-decoding", "my-tag"} <= set(card.data.tags)
    assert 'Eagle3DraftModel.from_pretrained("org/eagle3-draft"' in card.text
    assert "apply_chat_template` as above" in card.text  # the chat-template note
    assert "generate(**inputs, assistant_model=" in card.text
    assert "| mt-bench | 0.00 | 3.41 | 2.13 |" in card.text and "| humaneval | 0.00 | 3.87 | 2.45 |" in card.text


@pytest.fixture
def only_our_commands(monkeypatch):
    monkeypatch.setattr(cli, "COMMAND_MODULES", ["hf_eagle3.conversion.cli", "hf_eagle3.publishing.hub"])


def test_push_command_dry_run_lists_the_upload_prints_the_card_and_sends_nothing(
    mocked_hub, saved_draft, capsys, only_our_commands
):
    create_repo, commits = mocked_hub
    cli.main(["push", str(saved_draft), "org/eagle3-draft", "--dry-run", "--license", "apache-2.0"])
    printed = capsys.readouterr()
    listed, card_text = printed.out.split("\nREADME.md:\n")
    assert all(f"  {name} (" in listed for name in SAVED_FILES) and "README.md (" in listed and "generated" in listed
    card = ModelCard(card_text)
    assert card.data.license == "apache-2.0" and card.data.base_model == "org/target"
    assert "# eagle3-draft" in card.text and "## Serving" in card.text and "## Citation" in card.text
    assert "no datasets (--dataset)" in printed.err  # what the card lacks is named, with the option that adds it
    assert not create_repo.called and not commits


def test_push_dry_run_of_a_draft_saved_in_hf_eagle3s_layout_lists_the_served_layouts_config(
    mocked_hub, tmp_path, capsys, only_our_commands
):
    tiny_draft(target_name_or_path="org/target").save_pretrained(tmp_path, served_layout=False)
    cli.main(["push", str(tmp_path), "org/eagle3-draft", "--dry-run"])
    listed = capsys.readouterr().out.split("\nREADME.md:\n")[0]
    assert re.search(r"  config\.json \(\d+ bytes, generated\)", listed)
    assert all(f"  {name} (" in listed for name in SAVED_FILES)
    cli.main(["push", str(tmp_path), "org/eagle3-draft", "--dry-run", "--hf-eagle3-layout"])
    assert not re.search(r"config\.json \(\d+ bytes, generated\)", capsys.readouterr().out)


@pytest.mark.parametrize("served_layout", [True, False])
def test_push_uploads_one_repository_in_the_served_layout_unless_asked_for_hf_eagle3s(
    mocked_hub, tmp_path, served_layout
):
    _, commits = mocked_hub
    draft = tiny_draft(target_name_or_path="org/target")
    draft.push_to_hub("org/eagle3-draft", served_layout=served_layout)
    tiny_draft(target_name_or_path="org/target").save_pretrained(tmp_path, served_layout=False)
    push_folder(tmp_path, "org/eagle3-draft", served_layout=served_layout)
    for commit in commits:
        config = json.loads(commit["files"]["config.json"])
        assert config["model_type"] == ("llama" if served_layout else "eagle3")
        assert SAVED_FILES <= set(commit["files"]) and "README.md" in commit["files"]
        if served_layout:
            assert config["architectures"] == ["LlamaForCausalLMEagle3"] and "hf_eagle3" in config
    assert commits[0]["files"]["model.safetensors"] == commits[1]["files"]["model.safetensors"]


def test_push_command_uploads_with_the_folder_results(mocked_hub, saved_draft, capsys, only_our_commands):
    _, commits = mocked_hub
    (saved_draft / "eagle3_results.json").write_text(json.dumps(RESULTS))
    cli.main(["push", str(saved_draft), "org/eagle3-draft", "--revision", "dev"])
    (commit,) = commits
    assert commit["revision"] == "dev" and "eagle3_results.json" in commit["files"]
    assert "## Measured acceptance and speedup" in commit["files"]["README.md"].decode()
    assert "https://huggingface.co/org/eagle3-draft/commit/1" in capsys.readouterr().out


def _card(folder: Path, **kwargs) -> ModelCard:
    return ModelCard(upload_operations(folder, "org/eagle3-draft", **kwargs)[-1].path_or_fileobj.decode())


def _record_target(folder: Path, target_name_or_path: str | None) -> None:
    """Record another target in a draft saved in the served layout (hf-eagle3's settings under `hf_eagle3`)."""
    config = json.loads((folder / "config.json").read_text())
    config["hf_eagle3"]["target_name_or_path"] = target_name_or_path
    (folder / "config.json").write_text(json.dumps(config))


def test_card_without_results_has_no_results_section(saved_draft):
    assert "Measured acceptance" not in _card(saved_draft).text


def test_the_cards_acceptance_profile_says_how_many_prompts_and_cycles_it_rests_on(tmp_path):
    rows = [{"tree_depth": 2, "tree_top_k": top_k, "tree_total_tokens": 4, "tau": 1.5, "prompts": 8, "cycles": cycles}
            for top_k, cycles in ((2, 61), (4, 48))]
    tiny_draft(target_name_or_path="org/target", acceptance_profile=rows).save_pretrained(tmp_path / "draft")
    assert "Measured over 8 prompts: 48 to 61 decoding cycles per top-k" in _card(tmp_path / "draft").text
    rows = [{key: value for key, value in row.items() if key not in ("prompts", "cycles")} for row in rows]
    tiny_draft(target_name_or_path="org/target", acceptance_profile=rows).save_pretrained(tmp_path / "earlier")
    assert "## Acceptance profile" in (card := _card(tmp_path / "earlier").text) and "Measured over" not in card


def test_a_draft_made_from_a_local_target_gets_its_hub_id_where_known_and_never_its_path(saved_draft, tmp_path):
    _record_target(saved_draft, "/home/me/.cache/huggingface/hub/models--org--Llama-Tiny/snapshots/0123abcd")
    assert _card(saved_draft).data.base_model == "org/Llama-Tiny"  # a Hub cache snapshot names its repo

    target = tmp_path / "local-target"  # a folder saved by an older transformers, which recorded `_name_or_path`
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "llama", "_name_or_path": "org/Llama-Tiny"}))
    _record_target(saved_draft, str(target))
    card = _card(saved_draft)
    assert card.data.base_model == "org/Llama-Tiny" and str(target) not in card.text

    (target / "config.json").write_text(json.dumps({"model_type": "llama"}))  # saved by transformers 5: no Hub id
    card = _card(saved_draft)
    assert card.data.base_model is None and str(target) not in card.text and "TARGET_MODEL_ID" not in card.text
    assert "for a model with 8 layers, hidden size 32 and a 96-token vocabulary (trained from a local copy" in card.text
    assert "# tokenizer, target: the model this draft was trained for" in card.text
    assert "--model-path $TARGET" in card.text and "`$TARGET` is the folder or Hub id of the target" in card.text
    card = _card(saved_draft, base_model="org/Llama-Tiny")  # `push --base-model`
    assert card.data.base_model == "org/Llama-Tiny" and '--model-path org/Llama-Tiny' in card.text


def test_the_card_takes_the_license_of_the_target_when_its_card_is_at_hand(saved_draft, tmp_path):
    target = tmp_path / "local-target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (target / "README.md").write_text("---\nlicense: llama3.1\n---\n# Llama\n")
    _record_target(saved_draft, str(target))
    card = _card(saved_draft)
    assert card.data.license == "llama3.1" and "| License | llama3.1 |" in card.text
    assert _card(saved_draft, license="apache-2.0").data.license == "apache-2.0"  # `push --license` wins


def test_a_draft_of_the_embedded_smollm2_gets_its_hub_id_and_license_and_no_local_path(saved_draft, tmp_path,
                                                                                       monkeypatch):
    monkeypatch.setenv("HF_EAGLE3_CACHE", str(tmp_path / "cache"))
    _record_target(saved_draft, str(smollm2_dir()))  # as `hf-eagle3 train --target smollm2` records it
    card = _card(saved_draft)
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and card.data.license == "apache-2.0"
    assert str(tmp_path / "cache") not in card.text


def test_a_card_for_a_draft_that_records_no_target_needs_base_model(saved_draft):
    _record_target(saved_draft, None)
    with pytest.raises(ValueError, match="records no target .* --base-model ORG/NAME"):
        upload_operations(saved_draft, "org/eagle3-draft")
    assert _card(saved_draft, base_model="org/Llama-Tiny").data.base_model == "org/Llama-Tiny"


def test_the_card_serves_the_repository_by_its_id_with_the_drafts_tree_defaults(saved_draft):
    card = _card(saved_draft)  # tiny_draft: depth 4, top-k 3, 12 drafted tokens
    assert "--speculative-draft-model-path org/eagle3-draft" in card.text
    assert "--speculative-num-steps 4 --speculative-eagle-topk 3 --speculative-num-draft-tokens 13" in card.text
    assert '"method": "eagle3", "model": "org/eagle3-draft", "num_speculative_tokens": 4' in card.text  # vLLM too
    assert "hf-eagle3 convert" not in card.text
    assert "`AutoModel` without `trust_remote_code=True` would build a plain `LlamaModel`" in card.text


def test_the_card_feeds_openvino_genai_the_drafts_target_layers_in_its_numbering(saved_draft):
    card = _card(saved_draft)
    layers = Eagle3DraftModel.from_pretrained(saved_draft).config.target_layer_ids  # hidden_states indices
    written = " ".join(str(layer - 1) for layer in layers)  # outputs of layers, as eagle_config numbers them
    assert f'<hidden_layers_list value="{written}" />' in card.text
    assert "branching_factor=1, num_assistant_tokens=4" in card.text  # a chain of the draft's depth


def test_the_card_of_a_draft_pushed_in_hf_eagle3s_own_layout_converts_it_for_serving(tmp_path):
    tiny_draft(target_name_or_path="org/target").save_pretrained(tmp_path, served_layout=False)
    card = _card(tmp_path, served_layout=False)
    assert "hf-eagle3 convert org/eagle3-draft draft-sglang --to sglang" in card.text
    assert '"method": "eagle3", "model": "draft-sglang", "num_speculative_tokens": 4' in card.text


def test_the_card_of_a_draft_sglang_cannot_serve_gives_the_speculators_export_for_vllm(tmp_path):
    tiny_draft(norm_before_residual=True, target_name_or_path="org/Llama-Tiny").save_pretrained(tmp_path)
    card = _card(tmp_path)
    command = "hf-eagle3 convert org/eagle3-draft draft-vllm --to speculators --target-embedding org/Llama-Tiny"
    assert command in card.text
    assert "sglang.launch_server" not in card.text


def test_shipped_and_generated_cards_share_library_name_and_tags():
    shipped = ModelCard.load(SHIPPED_DRAFT / "README.md")
    assert shipped.data.library_name == LIBRARY_NAME and shipped.data.tags == CARD_TAGS
    assert shipped.data.license and shipped.data.datasets and shipped.data.base_model
    assert all(section in shipped.text for section in ("## Serving", "## Citation", "## Training"))


def test_bench_json_fills_the_card_with_per_position_acceptance_and_the_setup(
    saved_draft, tmp_path, llama_target, fitted_draft, mocked_hub, only_our_commands
):
    prompts = {"mt-bench": [torch.randint(1, 96, (1, 6), generator=torch.Generator().manual_seed(1))]}
    methods = methods_from_names(["plain", "chain", "tree"], 4, 3, 12)
    result = run_benchmark(llama_target, fitted_draft, prompts, methods, 24, 1, progress=False)
    result["settings"] = {"machine": "Test CPU (avx2)", "dtype": "float32", "torch_threads": 1, "temperature": 0.0,
                          "max_new_tokens": 24, "limit": 1, "repetitions": 1}  # as `hf-eagle3 bench` records them
    result["draft"] = draft_record("draft", fitted_draft)
    (tmp_path / "bench.json").write_text(json.dumps(result))
    _, commits = mocked_hub
    fitted_draft.config.target_name_or_path = "org/target"
    fitted_draft.save_pretrained(tmp_path / "fitted")
    cli.main(["push", str(tmp_path / "fitted"), "org/eagle3-draft", "--results", str(tmp_path / "bench.json")])
    card = ModelCard(commits[0]["files"]["README.md"].decode())
    tree = result["summary"]["mt-bench"]["tree"]
    assert ("Measured with hf-eagle3 on Test CPU (avx2), float32, 1 torch thread, greedy, 24 new tokens, the first 1 "
            "prompt of each set, median of 1 interleaved repetitions.") in card.text
    assert "| prompts | method | tree (DxKxN) | speedup | tokens/s | τ | 0-α | 1-α | 2-α | 3-α |" in card.text
    row = next(line for line in card.text.splitlines() if line.startswith("| mt-bench | tree |"))
    assert f"| {tree['tau']:.2f} | {tree['n_alpha'][0]:.2f} |" in row and "| 4x3x12 |" in row


def _bench_json(folder: Path, draft: Eagle3DraftModel, speedup: float) -> Path:
    """A `bench.json` of `draft` as `hf-eagle3 bench` writes it, its EAGLE-3 method at `speedup`."""
    tree = {"speedup": speedup, "tokens_per_second": 10 * speedup, "prompts": 1, "tau": 1.1, "n_alpha": [0.1],
            "shapes": ["2x8x12"]}
    bench = {"summary": {"mt-bench": {"plain": {"speedup": 1.0, "tokens_per_second": 10.0, "prompts": 1},
                                      "tree": tree}},
             "settings": {"machine": "Test CPU"}, "draft": draft_record("shipped", draft)}
    (folder / "bench.json").write_text(json.dumps(bench))
    return folder / "bench.json"


def test_push_refuses_results_measured_with_another_draft_naming_both(saved_draft, tmp_path):
    other = _bench_json(tmp_path, tiny_draft(seed=1), 2.0)
    own = draft_record("shipped", Eagle3DraftModel.from_pretrained(saved_draft))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["push", str(saved_draft), "org/x", "--results", str(other), "--dry-run"])
    error = str(exit_info.value)
    assert "measured with another draft (shipped: fingerprint " in error and own["fingerprint"] in error
    assert f"hf-eagle3 bench --draft {saved_draft}" in error
    assert upload_operations(saved_draft, "org/x", load_results(_bench_json(tmp_path, Eagle3DraftModel.from_pretrained(
        saved_draft), 2.0)))  # its own results, measured from the folder in another layout, are accepted


def test_a_bench_json_that_names_no_draft_is_refused(tmp_path):
    bench = json.loads(_bench_json(tmp_path, tiny_draft(), 2.0).read_text())
    (tmp_path / "bench.json").write_text(json.dumps({key: value for key, value in bench.items() if key != "draft"}))
    with pytest.raises(ValueError, match="does not record the draft it measured"):
        load_results(tmp_path / "bench.json")


def test_the_card_never_promises_faster_and_says_when_the_draft_decoded_slower(saved_draft, tmp_path):
    draft = Eagle3DraftModel.from_pretrained(saved_draft)
    slower = _card(saved_draft, results=load_results(_bench_json(tmp_path, draft, 0.8))).text
    faster = _card(saved_draft, results=load_results(_bench_json(tmp_path, draft, 1.5))).text
    unmeasured = _card(saved_draft).text
    assert "on the machine measured below, this draft decoded slower than plain\n`generate`** (its fastest EAGLE-3 " \
           "method at 0.80x)" in slower
    assert "slower" not in faster and "see the measurements below" in faster
    assert "no speed was measured with this draft" in unmeasured
    assert not any("generation is faster" in card for card in (slower, faster, unmeasured))


def test_the_card_of_a_trained_draft_describes_its_training(tmp_path, llama_target):
    data = tmp_path / "data"
    data.mkdir()
    torch.manual_seed(0)
    prompts = torch.randint(1, 96, (16, 6))
    sequences = llama_target.generate(prompts, max_new_tokens=18, do_sample=False,
                                      attention_mask=torch.ones_like(prompts))
    with open(data / "shard-00000.jsonl", "w") as file:
        for sequence in sequences.tolist():
            file.write(json.dumps({"messages": [], "input_ids": sequence, "loss_mask": [0] * 6 + [1] * 18}) + "\n")
    config = TrainConfig(data=str(data), output_dir=str(tmp_path / "run"), target="/models/local-llama",
                         draft_vocab_size=64, intermediate_size=64, batch_size=4, ttt_steps=3, max_steps=4,
                         eval_every=4, save_every=4, eval_fraction=0.25, profile_prompts=0,
                         eval_tree_prompts=0)
    train(config, target=llama_target, progress=False)
    card = _card(tmp_path / "run" / "draft")
    assert "## Training" in card.text and "training-time test, 3 unrolled steps" in card.text
    assert "| Steps | 4 of 4, 4 conversations per batch" in card.text
    assert "| Held-out acceptance (last evaluation) | n-α " in card.text
    assert card.data.base_model is None and "/models/local-llama" not in card.text

    # the data as `prepare-data --input sharegpt --input /home/me/chats.jsonl --target smollm2 --regenerate` records
    # it, and a run started from a local draft (`train --init-draft /home/me/drafts/base`)
    manifest = {"settings": {"inputs": ["sharegpt", "/home/me/chats.jsonl"], "regenerated_by": str(smollm2_dir())},
                "conversations": 16}
    (data / "manifest.json").write_text(json.dumps(manifest))
    recorded = json.loads((tmp_path / "run" / "train_config.json").read_text())
    (tmp_path / "run" / "train_config.json").write_text(json.dumps({**recorded, "init_draft": "/home/me/drafts/base"}))
    card = _card(tmp_path / "run" / "draft", base_model="org/target")
    sharegpt = "anon8231489123/ShareGPT_Vicuna_unfiltered"
    assert card.data.datasets == [sharegpt]
    assert (f"| Data | 16 conversations from {sharegpt}, chats.jsonl, answers regenerated by "
            "HuggingFaceTB/SmolLM2-135M-Instruct |") in card.text
    assert "| Started from | `base` |" in card.text and "/home/me" not in card.text and str(tmp_path) not in card.text
    assert _card(tmp_path / "run" / "draft", base_model="org/target", datasets=["org/chats"]).data.datasets == [
        "org/chats"]  # `push --dataset` wins


def test_a_folder_with_its_own_card_keeps_it_and_a_readme_that_is_no_card_is_left_out(saved_draft):
    (saved_draft / "README.md").write_text("---\nlicense: mit\n---\n# my card\n")
    operations = upload_operations(saved_draft, "org/eagle3-draft")
    assert [_content(op.path_or_fileobj) for op in operations if op.path_in_repo == "README.md"] == [
        b"---\nlicense: mit\n---\n# my card\n"]

    (saved_draft / "README.md").write_text("# Development log\n\nStep 200: loss 3.1 ...\n")  # notes, no card
    (card,) = [op.path_or_fileobj for op in upload_operations(saved_draft, "org/eagle3-draft")
               if op.path_in_repo == "README.md"]
    assert b"Development log" not in card and b"## Usage with transformers" in card


def test_push_dry_run_leaves_out_keys_credentials_and_training_state_and_says_why(
    mocked_hub, saved_draft, capsys, only_our_commands
):
    (saved_draft / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    (saved_draft / "credentials.json").write_text('{"token": "hf_xxx"}')
    torch.save({"state": {}}, saved_draft / "optimizer.pt")
    (saved_draft / "checkpoint-200").mkdir()
    torch.save({"step": 200}, saved_draft / "checkpoint-200" / "extra.pkl")

    cli.main(["push", str(saved_draft), "org/eagle3-draft", "--dry-run"])
    listed = capsys.readouterr().out.split("\nREADME.md:\n")[0]
    uploaded, left_out = listed.split("Left out:\n")
    assert all(name not in uploaded for name in ("id_rsa", "credentials.json", "optimizer.pt", "extra.pkl"))
    assert "  id_rsa: a private key; upload it with --include id_rsa" in left_out
    assert "  credentials.json: credentials;" in left_out
    assert "  optimizer.pt: training state, not the draft;" in left_out
    assert "  checkpoint-200/extra.pkl: a pickle, which can run code when loaded" in left_out

    cli.main(["push", str(saved_draft), "org/eagle3-draft", "--include", "optimizer.pt"])  # named explicitly
    (commit,) = mocked_hub[1]
    assert "optimizer.pt" in commit["files"] and not {"id_rsa", "credentials.json"} & set(commit["files"])


def test_push_of_a_draft_whose_weights_are_a_pickle_says_to_convert_or_include_them(saved_draft, tmp_path):
    torch.save(load_file(saved_draft / "model.safetensors"), saved_draft / "pytorch_model.bin")
    (saved_draft / "model.safetensors").unlink()
    with pytest.raises(ConversionError, match="weights are pytorch_model.bin, pickled .*hf-eagle3 convert.*"
                                              "--include pytorch_model.bin"):
        upload_operations(saved_draft, "org/eagle3-draft")
    paths = [op.path_in_repo for op in upload_operations(saved_draft, "org/eagle3-draft", include=["*.bin"])]
    assert "pytorch_model.bin" in paths


@pytest.mark.parametrize("damage", ["drop a weight", "drop auto_map"])
def test_push_refuses_an_incomplete_draft(mocked_hub, saved_draft, damage):
    create_repo, commits = mocked_hub
    if damage == "drop a weight":
        weights = load_file(saved_draft / "model.safetensors")
        weights.pop("fc.weight")
        save_file(weights, saved_draft / "model.safetensors", metadata={"format": "pt"})
    else:
        config = json.loads((saved_draft / "config.json").read_text())
        config.pop("auto_map")
        (saved_draft / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="missing \\['fc.weight'\\]" if damage == "drop a weight" else "auto_map"):
        push_folder(saved_draft, "org/eagle3-draft")
    assert not create_repo.called and not commits


def test_push_refuses_an_invalid_repo_id_even_in_a_dry_run(saved_draft):
    with pytest.raises(ValueError, match="not a Hub repo id"):
        upload_operations(saved_draft, "org/name/with/too/many/parts")


def test_push_refuses_links_to_files_outside_the_folder(saved_draft, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the Hub")
    (saved_draft / "notes.txt").symlink_to(secret)
    with pytest.raises(ValueError, match="notes.txt in .* link to files outside it"):
        upload_operations(saved_draft, "org/eagle3-draft")


def test_push_of_a_folder_that_is_no_draft_says_to_convert_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConversionError, match="is not a draft saved by hf-eagle3 .*hf-eagle3 convert"):
        upload_operations(tmp_path, "org/eagle3-draft")


def test_an_unreadable_results_file_is_named(saved_draft, tmp_path):
    results = tmp_path / "results.json"
    results.write_text("[{oops")
    with pytest.raises(ValueError, match=f"Cannot read the results file {results}"):
        upload_operations(saved_draft, "org/eagle3-draft", load_results(results))


def test_dangling_links_are_named(saved_draft, tmp_path):
    (saved_draft / "model.safetensors").rename(tmp_path / "moved.safetensors")
    (saved_draft / "model.safetensors").symlink_to(tmp_path / "gone.safetensors")
    with pytest.raises(ValueError, match="link to missing files"):
        upload_operations(saved_draft, "org/eagle3-draft")
    with pytest.raises(ConversionError, match="is a link to a missing file"):
        convert(saved_draft, tmp_path / "out")
