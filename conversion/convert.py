"""Reading, writing and converting EAGLE-3 drafts in any known format, through one `DraftCheckpoint`."""

import os
import shutil
import tempfile
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError
from safetensors import SafetensorError

from . import hub, modelopt, official, sglang, speculators
from .checkpoint import CheckpointFormat, ConversionError, DraftCheckpoint, ReadOptions, TargetInfo, UnknownFormatError
from .fields import refuse_last_layer_tap
from .files import input_embedding, load_source

FORMATS: dict[str, CheckpointFormat] = {
    checkpoint_format.name: checkpoint_format
    for checkpoint_format in (hub.FORMAT, official.FORMAT, sglang.FORMAT, speculators.FORMAT, modelopt.FORMAT)
}
STAGING_PREFIX = ".hf-eagle3-convert-"
# Formats a checkpoint detected as the key may be read as on request, because they read its files alike: a
# `LlamaForCausalLM` draft with `midlayer.*` weights that another project trained (e.g. with YaRN RoPE, which the
# official code lacks) is served by SGLang and vLLM with its config read as written.
READABLE_AS = {"official": ("sglang",)}
EXPORT_FORMATS = tuple(name for name, checkpoint_format in FORMATS.items() if checkpoint_format.write is not None)


def read_checkpoint(
    source: str | Path,
    format_name: str | None = None,
    target: TargetInfo | None = None,
    options: ReadOptions | None = None,
    download: dict | None = None,
) -> tuple[DraftCheckpoint, str]:
    """Read and validate the draft at `source` (a folder or a Hub repo id); return it and its format's name.

    Without `format_name` the format is detected from the files, and a `ConversionError` lists the candidates when
    they do not settle it. A foreign draft's config records the source format and every reading chosen where engines
    differ (`converted_from`). `download` holds `snapshot_download` arguments (`revision`, `token`, ...) for a Hub id.
    """
    files = load_source(_local_folder(source, download or {}))
    candidates = [name for name, checkpoint_format in FORMATS.items() if checkpoint_format.detect(files)]
    readable = {*candidates, *(alias for name in candidates for alias in READABLE_AS.get(name, ()))}
    if format_name is not None and format_name not in readable and candidates:
        # Read as another format, the same config keys mean other things (layer numbering, defaults): refuse.
        raise ConversionError(
            f"{source} is a {' or '.join(candidates)} checkpoint, not {format_name} "
            f"({_format(format_name).description}): pass --from {candidates[0]}, or drop --from."
        )
    if format_name is None:
        if len(candidates) != 1:
            found = f"could be any of {', '.join(candidates)}" if candidates else "matches no known format"
            choices = "; ".join(f"{name} ({FORMATS[name].description})" for name in candidates or FORMATS)
            error = ConversionError if candidates else UnknownFormatError
            raise error(f"{source} {found}. Pass --from (from_format=) with one of: {choices}.")
        format_name = candidates[0]
    checkpoint = _format(format_name).read(files, target or TargetInfo(), options or ReadOptions())
    if format_name != "hub":
        refuse_last_layer_tap(checkpoint.config, f"this {format_name} draft converted to hf-eagle3")
    return checkpoint, format_name



def write_checkpoint(checkpoint: DraftCheckpoint, destination: str | Path, format_name: str = "hub") -> None:
    """Write `checkpoint` as a new folder `destination`, in full or not at all."""
    write = _format(format_name).write
    if write is None:
        raise ConversionError(f"{format_name} is an import-only format; export to one of {', '.join(EXPORT_FORMATS)}.")
    destination = Path(destination).absolute()
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise ConversionError(f"{destination} already exists; choose a new folder.")
    # Staged next to the destination's nearest existing ancestor, so the final move is one rename.
    anchor = next(folder for folder in destination.parents if folder.exists())
    _remove_abandoned_staging(anchor)
    try:
        with tempfile.TemporaryDirectory(dir=anchor, prefix=f"{STAGING_PREFIX}{os.getpid()}-") as staging:
            staged = Path(staging) / destination.name
            staged.mkdir()
            write(checkpoint, staged)
            umask = os.umask(0)
            os.umask(umask)
            # tempfile makes the folder 0700 (and writers may make files 0600): the modes of a folder written in place
            for path in [staged, *staged.rglob("*")]:
                path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
            destination.parent.mkdir(parents=True, exist_ok=True)
            staged.replace(destination)
    except (OSError, SafetensorError) as error:
        raise ConversionError(f"Cannot write {destination}: {error}. Nothing was written; free space or choose a "
                              "writable folder.") from error


def _remove_abandoned_staging(folder: Path) -> None:
    """Remove the staging folders that killed conversions left in `folder` (their process is gone)."""
    for staging in folder.glob(f"{STAGING_PREFIX}*"):
        pid = staging.name.removeprefix(STAGING_PREFIX).split("-")[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(staging, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def convert(
    source: str | Path,
    destination: str | Path,
    *,
    from_format: str | None = None,
    to_format: str = "hub",
    target: TargetInfo | None = None,
    share_target_embedding: bool = False,
    yarn_mscale: str = "transformers",
    target_embedding: str | Path | None = None,
) -> tuple[DraftCheckpoint, str]:
    """Convert the draft at `source` into a new folder `destination`; return the checkpoint and the source format.

    `share_target_embedding=True` states that the checkpoint's own `embed_tokens` is the target's input embedding:
    it is dropped and the draft shares the target's at run time. `yarn_mscale` picks how a YaRN draft's `mscale`
    keys are read (see `ReadOptions`). `target_embedding` (the target's folder or Hub id) gives the input embedding
    that formats whose loaders need it (speculators) store with a draft sharing it. Nothing is written when anything
    fails.
    """
    checkpoint, source_format = read_checkpoint(source, from_format, target, ReadOptions(yarn_mscale=yarn_mscale))
    if share_target_embedding:
        checkpoint = checkpoint.sharing_target_embedding()
    if target_embedding is not None and checkpoint.config.share_target_embedding:
        folder = _local_folder(target_embedding, {"allow_patterns": ["*.safetensors", "*.json"]})
        embedding = input_embedding(folder, checkpoint.config.vocab_size, checkpoint.config.hidden_size)
        checkpoint = checkpoint.with_target_embedding(embedding)
    write_checkpoint(checkpoint, destination, to_format)
    return checkpoint, source_format


def _format(name: str) -> CheckpointFormat:
    if name not in FORMATS:
        raise ConversionError(f"Unknown checkpoint format {name!r}; known formats: {', '.join(FORMATS)}.")
    return FORMATS[name]


def _local_folder(source: str | Path, download: dict) -> Path:
    """`source` itself when it is a folder; otherwise the Hub repo it names, from the cache or downloaded."""
    folder = Path(source)
    if folder.is_dir():
        return folder
    if isinstance(source, Path) or str(source).count("/") != 1 or str(source).startswith((".", "/")):
        raise ConversionError(f"{source} is not a folder (nor a Hub repo id of the form org/name).")
    try:
        return Path(snapshot_download(str(source), **download))
    except (EntryNotFoundError, HfHubHTTPError) as error:
        raise ConversionError(
            f"{source} is not a folder, and no Hub repo of that name could be fetched: {error}"
        ) from error
