"""`hf-eagle3`: one sub-command per feature; each feature module registers its own sub-command.

Every error reaches the user as one line, `hf-eagle3 COMMAND: error: what is wrong and what to do`; the traceback
only with `--debug` or `HF_EAGLE3_DEBUG=1`.
"""

import argparse
import importlib
import os

# Modules that define `register_cli(subparsers)`; each adds one sub-command whose handler is `args.run(args)`.
COMMAND_MODULES = [
    "hf_eagle3.demo",
    "hf_eagle3.bench",
    "hf_eagle3.batch_bench",
    "hf_eagle3.tree_sizing",
    "conversion.cli",
    "hf_eagle3.hub",
    "hf_eagle3.data",
    "hf_eagle3.trainer",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-eagle3", description="EAGLE-3 speculative decoding for transformers.")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (or HF_EAGLE3_DEBUG=1)")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register_cli(subparsers)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.debug or os.environ.get("HF_EAGLE3_DEBUG") == "1":
        args.run(args)
        return
    try:
        args.run(args)
    except Exception as error:  # noqa: BLE001: one sentence for the user; --debug shows the traceback
        raise SystemExit(f"hf-eagle3 {args.command}: error: {error}") from error


if __name__ == "__main__":
    main()
