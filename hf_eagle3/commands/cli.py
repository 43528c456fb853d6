"""`hf-eagle3`: one sub-command per feature; each feature module registers its own sub-command.

Every error reaches the user as one line, `hf-eagle3 COMMAND: error: what is wrong and what to do`; the traceback
only with `--debug` or `HF_EAGLE3_DEBUG=1`. `python -m hf_eagle3` is the same command.
"""

import argparse
import copy
import importlib
import os

# Modules that define `register_cli(subparsers)`; each adds one sub-command whose handler is `args.run(args)`.
COMMAND_MODULES = [
    "hf_eagle3.commands.demo",
    "hf_eagle3.commands.bench",
    "hf_eagle3.commands.bench_batches",
    "hf_eagle3.commands.bench_attention",
    "hf_eagle3.commands.bench_train_step",
    "hf_eagle3.commands.tune_tree",
    "hf_eagle3.commands.convert",
    "hf_eagle3.publishing.hub",
    "hf_eagle3.training.data",
    "hf_eagle3.training.code_tasks",
    "hf_eagle3.training.trainer",
]


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written (the modules' docstrings), and every option's default after its help, except where
    there is none to show (`None`: the help says what leaving it out does; an off switch)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.required:
            return action.help
        return super()._get_help_string(action)

    def _expand_help(self, action: argparse.Action) -> str:
        if isinstance(action.default, list | tuple):  # as it is typed: `--top-k 1 2 4 8`, not `[1, 2, 4, 8]`
            action = copy.copy(action)
            action.default = " ".join(str(value) for value in action.default)
        return super()._expand_help(action)


def version() -> str:
    import torch
    import transformers

    from .. import __version__

    return f"hf-eagle3 {__version__} (transformers {transformers.__version__}, torch {torch.__version__})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-eagle3", description="EAGLE-3 speculative decoding for transformers.",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=version())
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (or HF_EAGLE3_DEBUG=1)")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register_cli(subparsers)
    for command in subparsers.choices.values():
        command.formatter_class = HelpFormatter
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.debug or os.environ.get("HF_EAGLE3_DEBUG") == "1":
        args.run(args)
        return
    try:
        args.run(args)
    except Exception as error:  # one sentence for the user; --debug shows the traceback
        raise SystemExit(f"hf-eagle3 {args.command}: error: {error}") from error


if __name__ == "__main__":
    main()
