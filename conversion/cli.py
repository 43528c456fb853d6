"""`hf-eagle3 convert SRC DST`: convert a draft checkpoint between formats."""

import argparse
from pathlib import Path

from ..utils.options import int_in
from .checkpoint import YARN_MSCALE_READINGS, TargetInfo
from .convert import EXPORT_FORMATS, FORMATS, convert
from .files import read_json

MAX_TARGET_LAYERS = 1024


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="convert an EAGLE-3 draft between checkpoint formats",
        description="Convert an EAGLE-3 draft checkpoint. Formats: "
        + "; ".join(f"{name}: {checkpoint_format.description}" for name, checkpoint_format in FORMATS.items())
        + ". Nothing is written unless the whole conversion succeeds.",
    )
    parser.add_argument("source", metavar="SRC", help="checkpoint folder, or Hub repo id (org/name)")
    parser.add_argument("destination", metavar="DST", type=Path, help="new folder to write the converted draft to")
    parser.add_argument(
        "--from", dest="from_format", choices=list(FORMATS), help="format of SRC (default: detected from its files)"
    )
    parser.add_argument("--to", dest="to_format", choices=EXPORT_FORMATS, default="hub", help="format of DST")
    target = parser.add_mutually_exclusive_group()
    target.add_argument(
        "--target-num-layers",
        type=int_in(1, MAX_TARGET_LAYERS),
        metavar="N",
        help="number of decoder layers of the target; needed when SRC does not record the tapped target layers",
    )
    target.add_argument(
        "--target-config",
        type=Path,
        metavar="PATH",
        help="the target's config.json (or its folder): layer count, hidden size, vocab size and model type",
    )
    parser.add_argument("--target-name-or-path", help="Hub id of the target, recorded for checks and model cards")
    parser.add_argument(
        "--share-target-embedding",
        action="store_true",
        help="SRC's embed_tokens is the target's input embedding: drop it and share the target's at run time",
    )
    parser.add_argument(
        "--target-embedding",
        metavar="TARGET",
        help="the target's folder or Hub id: its input embedding is written with a draft that shares it, for formats "
        "whose loaders need it (speculators)",
    )
    parser.add_argument(
        "--yarn-mscale",
        choices=YARN_MSCALE_READINGS,
        default="transformers",
        help="how a YaRN draft's mscale / mscale_all_dim are read: as transformers and SpecForge training do "
        "(default), or ignored, as SGLang and vLLM serve it",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    checkpoint, source_format = convert(
        args.source,
        args.destination,
        from_format=args.from_format,
        to_format=args.to_format,
        target=_target_info(args),
        share_target_embedding=args.share_target_embedding,
        yarn_mscale=args.yarn_mscale,
        target_embedding=args.target_embedding,
    )
    config = checkpoint.config
    print(
        f"Converted {args.source} ({source_format}) -> {args.destination} ({args.to_format}): draft vocabulary "
        f"{config.draft_vocab_size} of {config.vocab_size} target tokens, target hidden_states "
        f"{config.target_layer_ids}, {checkpoint.dtype}."
    )
    for note in (config.converted_from or {}).get("notes", []):
        print(f"  note: {note}")


def _target_info(args: argparse.Namespace) -> TargetInfo:
    if args.target_config is None:
        return TargetInfo(num_hidden_layers=args.target_num_layers, name_or_path=args.target_name_or_path)
    path = args.target_config / "config.json" if args.target_config.is_dir() else args.target_config
    return TargetInfo.from_config_dict(read_json(path), name_or_path=args.target_name_or_path)
