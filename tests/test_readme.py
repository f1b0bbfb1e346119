"""The README's command table stays true: every option it names for a command is an option of that
command (the table was written by hand, and options are renamed)."""

import re
from pathlib import Path

import click

from pynanoqwen.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


def table_rows() -> list[tuple[str, str]]:
    """(command, its row's text) of every row of the Commands table."""
    rows = re.findall(r"^\| `python -m pynanoqwen (\w+) ([^|]*(?:\\\|[^|]*)*)\|(.*)\|$", README.read_text(), re.M)
    return [(command, usage + description) for command, usage, description in rows]


def test_every_option_in_the_command_table_exists():
    rows = table_rows()
    assert {command for command, _ in rows} == set(main.commands), "the table lists every command once"
    checked = 0
    for command, text in rows:
        known = {name for param in main.commands[command].params if isinstance(param, click.Option)
                 for name in param.opts}
        named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
        assert named <= known, f"{command}: {sorted(named - known)} are not options of the command"
        checked += len(named)
    assert checked >= 30  # the regular expressions found the table's options