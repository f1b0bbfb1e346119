"""`python -m pynanoqwen ...`: the command line. Each command parses options and calls one function
of the module that owns the work; user errors (NanoQwenError) become one line and exit code 1."""

from __future__ import annotations

import sys

import click

from .errors import NanoQwenError


class _Group(click.Group):
    """A click group that turns NanoQwenError into `error: ...` and exit code 1, never a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except NanoQwenError as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)


@click.group(cls=_Group)
@click.version_option(package_name="pynanoqwen")
def main():
    """pynanoqwen: INT4 Qwen2.5 inference with readable Numba-CUDA kernels."""


@main.command()
@click.argument("hf_dir", type=click.Path(file_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--lm-head", type=click.Choice(["int4", "fp16"]), default="int4", show_default=True,
              help="Store lm_head as INT4 (faster decode) or FP16 (exact logits).")
def convert(hf_dir, out, lm_head):
    """Convert a Hugging Face Qwen2 checkpoint directory HF_DIR into the .nanoqwen file OUT."""
    from .convert import convert_checkpoint

    convert_checkpoint(hf_dir, out, lm_head_int4=(lm_head == "int4"))


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
def info(file):
    """Print the header, config and tensor summary of a .nanoqwen FILE."""
    from .fileformat import describe

    click.echo(describe(file))
