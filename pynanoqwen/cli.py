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


@main.command()
@click.argument("prompt")
@click.option("--model", "model", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="The .nanoqwen model to run (required).")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None,
              help="Run on the GPU engine or the numpy reference. [default: cuda if a GPU is found]")
@click.option("--max-new-tokens", type=int, default=256, show_default=True,
              help="Stop after this many generated tokens.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="Sample among the K most probable (0: all).")
@click.option("--top-p", type=float, default=1.0, show_default=True,
              help="Sample among the fewest tokens whose probability reaches P.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the sampler.")
@click.option("--chat/--raw", default=False, show_default=True,
              help="Wrap the prompt as a ChatML user turn, or feed it as is (completion).")
@click.option("--system", default=None, metavar="TEXT", help="System message for --chat.")
@click.option("--fim-suffix", default=None, metavar="TEXT",
              help="Fill in the middle: PROMPT is the code before the hole, TEXT the code after it.")
@click.option("--max-context", type=int, default=32768, show_default=True,
              help="KV cache size in tokens (capped by the model's max_position_embeddings).")
@click.option("--gemv", type=click.Choice(["prmt", "dp4a"]), default="prmt", show_default=True,
              help="INT4 unpack variant of the GPU GEMV kernels.")
@click.option("--eager", is_flag=True, help="Launch GPU kernels one by one instead of replaying a CUDA graph.")
def generate(prompt, model, device, max_new_tokens, temperature, top_k, top_p, seed, chat, system,
             fim_suffix, max_context, gemv, eager):
    """Generate text after PROMPT, streaming it to stdout; a summary goes to stderr."""
    from .generate import GenerateOptions, run
    from .sampling import SamplingParams

    options = GenerateOptions(prompt=prompt, model=model, device=device, max_new_tokens=max_new_tokens,
                              sampling=SamplingParams(temperature, top_k, top_p, seed), chat=chat,
                              system=system, fim_suffix=fim_suffix, max_context=max_context, gemv=gemv,
                              eager=eager)
    run(options, on_text=lambda text: click.echo(text, nl=False),
        on_status=lambda line: click.echo(line, err=True))
