"""Publishing EAGLE-3 drafts on the Hugging Face Hub: model cards, uploads and `hf-eagle3 push DIR REPO_ID`.

A pushed folder is checked first (a complete `Eagle3DraftModel` checkpoint with `auto_map` and its modeling code, so
that `AutoModel.from_pretrained(repo, trust_remote_code=True)` works without hf-eagle3), then uploaded in one commit
together with a generated model card, unless the folder has a `README.md` of its own.

The card is filled from what was measured and recorded, never with placeholders: the draft's config (target, shape,
tree defaults and the serving settings they translate to, the acceptance profile `tune-tree` recorded), the training
run when the folder is a run's `draft` directory (`train_config.json`, `history.json` and the data's `manifest.json`
beside it), and measured results: `hf-eagle3 bench`'s `bench.json` (speedup, tokens/s, τ and the acceptance of each
drafted position, per prompt set and method, with the machine and settings it ran with), or a JSON list of rows
(objects with the same keys, e.g. `{"dataset": "mt-bench", "temperature": 0.0, "acceptance_length": 3.4,
"speedup": 2.1}`), passed as `results` or stored in the draft folder as `eagle3_results.json`.
"""

import argparse
import importlib.resources
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi, ModelCard, ModelCardData
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from ..conversion import ConversionError, DraftCheckpoint, read_checkpoint, sglang
from ..conversion.fields import dtype_name
from ..conversion.files import read_json
from ..modeling_eagle3 import Eagle3DraftModel
from .results import Results, load_results

CARD_TEMPLATE = importlib.resources.files("hf_eagle3.model_cards") / "eagle3_draft.md"
# The shipped draft's card (hf_eagle3/assets/smollm2-eagle3/README.md) carries the same library name and tags.
LIBRARY_NAME = "transformers"  # the draft loads with AutoModel (trust_remote_code where hf-eagle3 is not installed)
CARD_TAGS = ["eagle3", "speculative-decoding", "draft-model", "hf-eagle3"]
RESULTS_FILE = "eagle3_results.json"


def draft_model_card(
    checkpoint: DraftCheckpoint,
    repo_id: str,
    results: Results | list[dict[str, Any]] | None = None,
    *,
    base_model: str | None = None,
    license: str | None = None,
    datasets: list[str] | None = None,
    training: dict[str, Any] | None = None,
) -> ModelCard:
    """The model card of a draft published as `repo_id`: metadata, overview, usage, serving settings, measured
    acceptance and speed, training and citation.

    `base_model` defaults to the target the config records, when that is a Hub id or a Hub cache snapshot of one;
    `training` is what [`training_details`] read from the run that trained the draft.
    """
    config = checkpoint.config
    base_model = base_model or _hub_model_id(config.target_name_or_path)
    if base_model is None and config.target_name_or_path is None:
        raise ValueError(
            "The draft's config records no target (target_name_or_path), so its card could not say which model it "
            "drafts for: pass the target's Hub id as base_model (`hf-eagle3 push ... --base-model ORG/NAME`)."
        )
    if isinstance(results, list):
        results = Results(results)
    card_data = ModelCardData(base_model=base_model, library_name=LIBRARY_NAME, license=license,
                              datasets=datasets or None, tags=list(CARD_TAGS))
    return ModelCard.from_template(
        card_data,
        template_path=str(CARD_TEMPLATE),
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        base_model=base_model,
        target=base_model or config.target_name_or_path,
        config=config,
        dtype=dtype_name(checkpoint.dtype),
        parameters=sum(tensor.numel() for tensor in checkpoint.tensors.values() if tensor.is_floating_point()),
        license=license,
        results=results,
        results_table=_markdown_table(results.rows) if results else None,
        profile_table=_profile_table(config.acceptance_profile) if config.acceptance_profile else None,
        # vLLM and SGLang both serve the SpecForge / SGLang layout; the drafts it cannot express, vLLM serves as
        # speculators.
        serving_format="sglang" if sglang.refusal(config) is None else "speculators",
        training=training,
    )


def training_details(folder: str | Path) -> dict[str, Any] | None:
    """What the run that trained the draft in `folder` recorded, for the card: `None` unless `folder` is (or is the
    `draft` directory of) an `hf-eagle3 train` output directory.

    Returns the run's `train_config.json` settings (`config`), its last held-out evaluation (`eval`: n-α and chain
    τ), its last training step (`steps`) and the prepared data's manifest (`data`, when its directory is still there).
    """
    folder = Path(folder)
    run = next((path for path in (folder, folder.parent) if (path / "train_config.json").is_file()), None)
    if run is None:
        return None
    config = read_json(run / "train_config.json")
    history = read_json(run / "history.json") if (run / "history.json").is_file() else []
    evaluations = [entry["eval"] for entry in history if "eval" in entry]
    manifest = Path(config.get("data", "")) / "manifest.json"
    return {
        "config": config,
        "steps": max((entry["step"] for entry in history), default=None),
        "eval": evaluations[-1] if evaluations else None,
        "data": read_json(manifest) if manifest.is_file() else None,
    }


def upload_operations(
    folder: str | Path, repo_id: str, results: Results | list[dict[str, Any]] | None = None, **card: Any
) -> list[CommitOperationAdd]:
    """What pushing the draft in `folder` to `repo_id` uploads: every file (hidden ones excepted) and the card
    (`card`: the keyword arguments of [`draft_model_card`] besides `training`, which is read from the folder).

    Raises:
        ConversionError: `folder` does not hold a complete draft, or was saved without `auto_map`.
    """
    folder = Path(folder)
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ValueError(f"{repo_id!r} is not a Hub repo id (expected `org/name`): {error}") from error
    config = read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
    model_type = config.get("model_type")
    if model_type != "eagle3":
        raise ConversionError(
            f"{folder} is not an hf-eagle3 draft (config model_type {model_type!r}, expected 'eagle3'): convert it "
            f"first (`hf-eagle3 convert {folder} NEW_FOLDER`), then push NEW_FOLDER."
        )
    files = _files_to_upload(folder)
    checkpoint, _ = read_checkpoint(folder, "hub")
    auto_map = config.get("auto_map") or {}
    code_files = {folder / (reference.split(".")[0] + ".py") for reference in auto_map.values()}
    if "AutoModel" not in auto_map or not all(path.is_file() for path in code_files):
        raise ConversionError(
            f"{folder} lacks auto_map or the modeling code it names, so the draft would not load with "
            f"trust_remote_code. Re-save it with hf-eagle3 (`hf-eagle3 convert {folder} NEW_FOLDER --from hub`) and "
            "push NEW_FOLDER."
        )
    operations = [CommitOperationAdd(path.relative_to(folder).as_posix(), path) for path in files]
    if not (folder / "README.md").is_file():
        results_file = folder / RESULTS_FILE
        if results is None and results_file.is_file():
            results = load_results(results_file)
        card = draft_model_card(checkpoint, repo_id, results, training=training_details(folder), **card)
        operations.append(CommitOperationAdd("README.md", str(card).encode()))
    return operations


def _files_to_upload(folder: Path) -> list[Path]:
    """Every file of `folder` but hidden ones; refuses links to missing files or to files outside the folder."""
    visible = [path for path in sorted(folder.rglob("*"))
               if not any(part.startswith(".") for part in path.relative_to(folder).parts)]
    dangling = [str(path.relative_to(folder)) for path in visible if path.is_symlink() and not path.exists()]
    if dangling:
        raise ValueError(f"{', '.join(dangling)} in {folder} link to missing files: restore or remove them.")
    files = [path for path in visible if path.is_file()]
    inside = folder.resolve()
    outside = [str(path.relative_to(folder)) for path in files if inside not in path.resolve().parents]
    if outside:
        raise ValueError(f"{', '.join(outside)} in {folder} link to files outside it; pushing them would publish "
                         "those files. Copy what belongs to the draft into the folder, or remove the links.")
    return files


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    results: Results | list[dict[str, Any]] | None = None,
    commit_message: str = "Upload EAGLE-3 draft",
    private: bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    token: str | bool | None = None,
    **card: Any,
) -> CommitInfo:
    """Upload the draft saved in `folder` to the Hub repo `repo_id` (created if needed) in one commit; `card`: the
    keyword arguments of [`draft_model_card`] (`base_model`, `license`, `datasets`)."""
    operations = upload_operations(folder, repo_id, results, **card)
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    return api.create_commit(repo_id, operations, commit_message=commit_message, revision=revision, create_pr=create_pr)


def push_draft(
    model: Eagle3DraftModel, repo_id: str, *, max_shard_size: int | str = "50GB", **push_kwargs
) -> CommitInfo:
    """Save `model` and push it with [`push_folder`]; this is `Eagle3DraftModel.push_to_hub`."""
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder, max_shard_size=max_shard_size)
        return push_folder(folder, repo_id, **push_kwargs)


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "push",
        help="publish a saved EAGLE-3 draft on the Hugging Face Hub",
        description="Upload the draft saved in DIR to the Hub repo REPO_ID with a generated model card.",
    )
    parser.add_argument("folder", metavar="DIR", type=Path, help="folder written by save_pretrained or convert")
    parser.add_argument("repo_id", metavar="REPO_ID", help="Hub repo to push to (org/name); created if needed")
    parser.add_argument(
        "--results", type=Path, metavar="FILE",
        help=f"measured results for the card: a bench.json of `hf-eagle3 bench`, or a JSON list of rows (default: "
             f"DIR/{RESULTS_FILE} when present)",
    )
    parser.add_argument("--base-model", metavar="REPO_ID",
                        help="Hub id of the target, for the card (default: the target the draft's config records, "
                             "when that is a Hub id or a Hub cache snapshot of one)")
    parser.add_argument("--license", help="license of the draft for the card (e.g. apache-2.0, llama3.1)")
    parser.add_argument("--dataset", action="append", dest="datasets", metavar="REPO_ID",
                        help="Hub dataset the draft was trained on, for the card (repeat for several)")
    parser.add_argument("--private", action="store_true", default=None, help="create the repo as private")
    parser.add_argument("--revision", help="branch to push to")
    parser.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    parser.add_argument("--commit-message", default="Upload EAGLE-3 draft")
    parser.add_argument("--dry-run", action="store_true",
                        help="list what would be uploaded and print the model card; upload nothing")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    results = load_results(args.results) if args.results else None
    card = {"base_model": args.base_model, "license": args.license, "datasets": args.datasets}
    if args.dry_run:
        operations = upload_operations(args.folder, args.repo_id, results, **card)
        print(f"Would upload to {args.repo_id}:")
        for operation in operations:
            source = operation.path_or_fileobj
            size = len(source) if isinstance(source, bytes) else Path(source).stat().st_size
            print(f"  {operation.path_in_repo} ({size} bytes{', generated' if isinstance(source, bytes) else ''})")
        readme = next(operation.path_or_fileobj for operation in operations if operation.path_in_repo == "README.md")
        print("\nREADME.md:\n" + (readme.decode() if isinstance(readme, bytes) else Path(readme).read_text()))
        _warn_about_missing_card_metadata(ModelCard(readme.decode() if isinstance(readme, bytes) else
                                                    Path(readme).read_text()))
        return
    commit = push_folder(
        args.folder,
        args.repo_id,
        results=results,
        commit_message=args.commit_message,
        private=args.private,
        revision=args.revision,
        create_pr=args.create_pr,
        **card,
    )
    print(f"Pushed {args.folder} to {commit.pr_url or commit.commit_url}")


def _warn_about_missing_card_metadata(card: ModelCard) -> None:
    missing = [f"{name} ({option})" for name, option in (
        ("base_model", "--base-model"), ("license", "--license"), ("datasets", "--dataset"))
        if not getattr(card.data, name, None)]
    if missing:
        print(f"The card has no {', '.join(missing)}: pass what applies.", file=sys.stderr)


def _hub_model_id(name_or_path: str | None) -> str | None:
    """The Hub model id `name_or_path` names: itself when it is one, `org/name` for a Hub cache snapshot
    (`.../models--org--name/snapshots/REVISION`); `None` for any other local path."""
    if name_or_path is None:
        return None
    snapshot = re.search(r"models--([^/]+?)--([^/]+)/snapshots/[^/]+/?$", str(name_or_path))
    if snapshot:
        return f"{snapshot[1]}/{snapshot[2]}"
    try:
        validate_repo_id(name_or_path)
    except HFValidationError:
        return None
    return name_or_path if not Path(name_or_path).exists() else None


def _profile_table(profile: list[dict[str, Any]]) -> str:
    """τ of the largest tree of each depth (columns) and top-k (rows) in an acceptance profile, with its number of
    drafted tokens in parentheses."""
    largest = {}
    for row in profile:
        key = (row["tree_top_k"], row["tree_depth"])
        if key not in largest or row["tree_total_tokens"] > largest[key]["tree_total_tokens"]:
            largest[key] = row
    depths = sorted({depth for _, depth in largest})
    lines = ["| top-k \\ depth | " + " | ".join(str(depth) for depth in depths) + " |",
             "|---|" + "---|" * len(depths)]
    for top_k in sorted({top_k for top_k, _ in largest}):
        cells = [largest.get((top_k, depth)) for depth in depths]
        lines.append(f"| {top_k} | " + " | ".join(
            f"{cell['tau']:.2f} ({cell['tree_total_tokens']})" if cell else "-" for cell in cells) + " |")
    return "\n".join(lines)


def _markdown_table(rows: list[dict[str, Any]]) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = [
        "| " + " | ".join(column.replace("_", " ") for column in columns) + " |",
        "|" + "---|" * len(columns),
        *("| " + " | ".join(_cell(row.get(column)) for column in columns) + " |" for row in rows),
    ]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    return "" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)
