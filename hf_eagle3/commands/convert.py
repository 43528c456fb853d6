"""`hf-eagle3 convert`: conversion's command (`conversion/cli.py`), where 'smollm2' names the embedded target as it
does in every other command. Conversion sits below the layer that knows the embedded target (`resources`), so the
name is resolved here, before conversion is called: to the cached safetensors folder (built on first use) for
`--target-config` and `--target-embedding`, to its Hub id for `--target-name-or-path`."""

import argparse

from ..conversion import cli as conversion_cli
from ..resources.smollm2 import SMOLLM2_NAME, smollm2_path

EMBEDDED = "smollm2"
TARGET_OPTIONS = ("target_config", "target_embedding", "target_name_or_path")


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    conversion_cli.register_cli(subparsers)
    parser = subparsers.choices["convert"]
    for action in parser._actions:
        if action.dest in TARGET_OPTIONS:
            action.help += f", or '{EMBEDDED}' for the embedded SmolLM2-135M-Instruct"
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    conversion_cli.run(resolve_embedded_target(args))


def resolve_embedded_target(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with each target option that names the embedded target ('smollm2') replaced by what it stands for."""
    named = {dest for dest in TARGET_OPTIONS if str(getattr(args, dest)) == EMBEDDED}
    resolved = {dest: smollm2_path() for dest in named & {"target_config", "target_embedding"}}
    if "target_name_or_path" in named:
        resolved["target_name_or_path"] = SMOLLM2_NAME
    return argparse.Namespace(**{**vars(args), **resolved})
