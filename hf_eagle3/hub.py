"""Publishing EAGLE-3 drafts on the Hugging Face Hub: model cards, uploads and `hf-eagle3 push DIR REPO_ID`.

A pushed folder is checked first (a complete `Eagle3DraftModel` checkpoint with `auto_map` and its modeling code, so
that `AutoModel.from_pretrained(repo, trust_remote_code=True)` works without hf-eagle3), then uploaded in one commit
together with a generated model card, unless the folder has a `README.md` of its own.

Measured results: a JSON list of rows (objects with the same keys, e.g.
`{"dataset": "mt-bench", "temperature": 0.0, "acceptance_length": 3.4, "speedup": 2.1}`) passed as `results` or
stored in the draft folder as `eagle3_results.json` becomes the card's "Measured acceptance and speedup" table.
"""

import argparse
import importlib.resources
import json
import tempfile
from pathlib import Path
from typing import Any

from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi, ModelCard, ModelCardData
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from .conversion import ConversionError, DraftCheckpoint, read_checkpoint
from .conversion.fields import dtype_name
from .conversion.files import read_json

from .modeling_eagle3 import Eagle3DraftModel

CARD_TEMPLATE = importlib.resources.files("hf_eagle3.model_cards") / "eagle3_draft.md"
CARD_TAGS = ["eagle3", "speculative-decoding", "hf-eagle3"]
RESULTS_FILE = "eagle3_results.json"


def draft_model_card(
    checkpoint: DraftCheckpoint, repo_id: str, results: list[dict[str, Any]] | None = None
) -> ModelCard:
    """The model card of a draft published as `repo_id`: its target as base model, tags, usage and results."""
    config = checkpoint.config
    base_model = _hub_model_id(config.target_name_or_path)
    card_data = ModelCardData(base_model=base_model, library_name="transformers", tags=list(CARD_TAGS))
    return ModelCard.from_template(
        card_data,
        template_path=str(CARD_TEMPLATE),
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        base_model=base_model,
        config=config,
        dtype=dtype_name(checkpoint.dtype),
        results_table=_markdown_table(results) if results else None,
    )


def upload_operations(
    folder: str | Path, repo_id: str, results: list[dict[str, Any]] | None = None
) -> list[CommitOperationAdd]:
    """What pushing the draft in `folder` to `repo_id` uploads: every file (hidden ones excepted) and the card.

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
        card = draft_model_card(checkpoint, repo_id, results)
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
    results: list[dict[str, Any]] | None = None,
    commit_message: str = "Upload EAGLE-3 draft",
    private: bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    token: str | bool | None = None,
) -> CommitInfo:
    """Upload the draft saved in `folder` to the Hub repo `repo_id` (created if needed) in one commit."""
    operations = upload_operations(folder, repo_id, results)
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


def load_results(path: str | Path) -> list[dict[str, Any]]:
    """Read a results file: a JSON list of rows with the same keys."""
    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"Cannot read the results file {path}: {error}") from error
    if not (isinstance(rows, list) and rows and all(isinstance(row, dict) for row in rows)):
        raise ValueError(f"{path} must hold a non-empty JSON list of objects (one per measured setting).")
    return rows


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "push",
        help="publish a saved EAGLE-3 draft on the Hugging Face Hub",
        description="Upload the draft saved in DIR to the Hub repo REPO_ID with a generated model card.",
    )
    parser.add_argument("folder", metavar="DIR", type=Path, help="folder written by save_pretrained or convert")
    parser.add_argument("repo_id", metavar="REPO_ID", help="Hub repo to push to (org/name); created if needed")
    parser.add_argument(
        "--results", type=Path, metavar="FILE", help=f"measured results for the card (default: DIR/{RESULTS_FILE})"
    )
    parser.add_argument("--private", action="store_true", default=None, help="create the repo as private")
    parser.add_argument("--revision", help="branch to push to")
    parser.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    parser.add_argument("--commit-message", default="Upload EAGLE-3 draft")
    parser.add_argument("--dry-run", action="store_true", help="list what would be uploaded; upload nothing")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    results = load_results(args.results) if args.results else None
    if args.dry_run:
        operations = upload_operations(args.folder, args.repo_id, results)
        print(f"Would upload to {args.repo_id}:")
        for operation in operations:
            source = operation.path_or_fileobj
            size = len(source) if isinstance(source, bytes) else Path(source).stat().st_size
            print(f"  {operation.path_in_repo} ({size} bytes{', generated' if isinstance(source, bytes) else ''})")
        return
    commit = push_folder(
        args.folder,
        args.repo_id,
        results=results,
        commit_message=args.commit_message,
        private=args.private,
        revision=args.revision,
        create_pr=args.create_pr,
    )
    print(f"Pushed {args.folder} to {commit.pr_url or commit.commit_url}")


def _hub_model_id(name_or_path: str | None) -> str | None:
    """`name_or_path` when it is a Hub model id (a local path is no base model), else None."""
    try:
        validate_repo_id(name_or_path)
    except (HFValidationError, TypeError):
        return None
    return name_or_path


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
