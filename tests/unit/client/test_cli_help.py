"""``dpmtv-site --help`` lists every command the parser knows, each with a line of help."""

from __future__ import annotations

import argparse

import pytest

from client.cli.main import build_parser, main


def _commands(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each sub-command's name and its help line, as registered."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
    return {name: helps.get(name, "") for name in action.choices}


def test_help_lists_every_registered_command_with_its_help(capsys):
    # Arrange
    commands = _commands(build_parser())

    # Act
    code = main(["--help"])
    printed = capsys.readouterr().out

    # Assert
    assert code == 0
    assert len(commands) >= 12
    for name, line in commands.items():
        assert line, f"{name} has no help line"
        assert f"    {name}" in printed, name


@pytest.mark.parametrize("name", sorted(_commands(build_parser())))
def test_every_command_has_its_own_help(capsys, name):
    assert main([name, "--help"]) == 0
    assert "usage: dpmtv-site" in capsys.readouterr().out
