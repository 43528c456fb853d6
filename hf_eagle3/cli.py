"""`hf-eagle3`: one sub-command per feature; each feature module registers its own sub-command."""

import argparse
import importlib

# Modules that define `register_cli(subparsers)`; each adds one sub-command whose handler is `args.run(args)`.
COMMAND_MODULES = [
    "hf_eagle3.demo",
    "hf_eagle3.bench",
    "hf_eagle3.tree_sizing",
    "conversion.cli",
    "hf_eagle3.hub",
    "hf_eagle3.data",
    "hf_eagle3.trainer",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-eagle3", description="EAGLE-3 speculative decoding for transformers.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register_cli(subparsers)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
