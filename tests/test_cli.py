"""The `hf-eagle3` command line: every sub-command is registered and documents itself."""

import pytest

from hf_eagle3.cli import build_parser

COMMANDS = ["demo", "bench", "tune-tree", "prepare-data", "train", "convert", "push"]


def test_every_command_is_registered():
    assert set(COMMANDS) <= set(build_parser()._subparsers._group_actions[0].choices)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0 and command in capsys.readouterr().out
