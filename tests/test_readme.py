"""The README's command table stays true: every option it names for a command is an option of that
command (the table was written by hand, and options are renamed). The measured convert figures have
one home, the README: convert.py's docstring points there instead of quoting its own."""

import re
from pathlib import Path

import click

from pynanoqwen import convert
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


def test_the_convert_docstring_quotes_no_measured_time_or_peak_of_its_own():
    """It said 161 s and a peak RSS of 1.17 GB for the 7B while the README's measured lines said 123.4 s
    (and 101.1 s) and 1.19 GB."""
    doc = convert.__doc__
    assert "README" in doc
    readme = README.read_text()
    for figure in re.findall(r"\b\d+(?:\.\d+)? s\b|peak RSS (?:of )?\d+(?:\.\d+)? [MG]B", doc):
        assert figure in readme, f"convert.py's docstring quotes {figure!r}, which the README does not"
