"""`python -m pynanoqwen ...`: the command line. Each command parses options and calls one function
of the module that owns the work; user errors (NanoQwenError) become one line and exit code 1, and
a bad option value or a missing argument one line and exit code 2."""

from __future__ import annotations

import sys

import click

from .device import library_warnings
from .errors import NanoQwenError
from .kernels import GEMV_PATHS


class _Group(click.Group):
    """A click group that turns NanoQwenError into `error: ...` and exit code 1, never a traceback,
    and click's usage errors (`--seed abc`, a missing PROMPT) into one such line too."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as err:
            where = f"; see '{err.ctx.command_path} --help'" if err.ctx is not None else ""
            click.echo(f"error: {err.format_message().rstrip('.')}{where}", err=True)
            sys.exit(err.exit_code)
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
@click.option("--force", is_flag=True, help="Replace OUT if it exists (never an input file of the conversion).")
def convert(hf_dir, out, lm_head, force):
    """Convert a Hugging Face Qwen2 checkpoint directory HF_DIR into the .nanoqwen file OUT.

    The last line gives the time taken, the peak memory (RSS) and the size of OUT."""
    from .convert import convert_checkpoint

    convert_checkpoint(hf_dir, out, lm_head_int4=(lm_head == "int4"), overwrite=force)


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
def info(file):
    """Print the header, config and tensor summary of a .nanoqwen FILE."""
    from .fileformat import describe

    click.echo(describe(file))


def verbose_option(command):
    """--verbose: show the warnings numba-cuda prints while kernels compile and launch."""
    return click.option("--verbose", is_flag=True, help="Show numba-cuda's warnings (hidden by default).")(command)


def lookup_options(command):
    """--prompt-lookup K and --lookup-ngram MIN:MAX (prompt_lookup.py), for generate and serve."""
    command = click.option("--lookup-ngram", default="1:3", show_default=True, metavar="MIN:MAX",
                           help="The n-gram lengths prompt lookup matches, longest first.")(command)
    return click.option("--prompt-lookup", type=int, default=0, show_default=True, metavar="K",
                        help="Prompt-lookup speculative decoding: draft up to K tokens from the context and verify "
                             "them in one pass (0: off). Lossless; CPU reference only so far.")(command)


@main.command()
@click.argument("prompt", required=False)
@click.option("--prompt-file", metavar="FILE", default=None,
              help="Read the prompt from FILE (UTF-8, verbatim) instead of PROMPT; '-' reads standard input.")
@click.option("--model", "model", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="The .nanoqwen model to run. [default: the embedded tiny-coder]")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None,
              help="Run on the GPU engine or the numpy reference. [default: cuda if a GPU is found]")
@click.option("--max-new-tokens", type=int, default=256, show_default=True,
              help="Stop after this many generated tokens.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="Sample among the K most probable (0: all).")
@click.option("--top-p", type=float, default=1.0, show_default=True,
              help="Sample among the fewest tokens whose probability reaches P.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the sampler.")
@lookup_options
@click.option("--chat/--raw", default=False, show_default=True,
              help="Wrap the prompt as a ChatML user turn, or feed it as is (completion).")
@click.option("--system", default=None, metavar="TEXT", help="System message for --chat.")
@click.option("--fim-suffix", default=None, metavar="TEXT",
              help="Fill in the middle: PROMPT is the code before the hole, TEXT the code after it.")
@click.option("--max-context", type=int, default=32768, show_default=True,
              help="KV cache size in tokens (capped by the model's max_position_embeddings).")
@click.option("--gemv", type=click.Choice(GEMV_PATHS), default="auto", show_default=True,
              help="Arithmetic of the GPU's INT4 GEMVs: auto (the faster of fixed16 and prmt at each shape), "
                   "prmt, or dp4a (INT8 activations, the comparison path).")
@click.option("--eager", is_flag=True, help="Launch GPU kernels one by one instead of replaying a CUDA graph.")
@click.option("--skip-selfcheck", is_flag=True,
              help="On the GPU, skip the check of one decode step and one prefill chunk against float64 before "
                   "generating.")
@verbose_option
def generate(prompt, prompt_file, model, device, max_new_tokens, temperature, top_k, top_p, seed, prompt_lookup,
             lookup_ngram, chat, system, fim_suffix, max_context, gemv, eager, skip_selfcheck, verbose):
    """Generate text after PROMPT, streaming it to stdout; a summary goes to stderr. The prompt
    itself is not printed again."""
    from .generate import GenerateOptions, run
    from .prompt_lookup import lookup_params
    from .sampling import SamplingParams

    options = GenerateOptions(prompt=prompt, prompt_file=prompt_file, model=model, device=device,
                              max_new_tokens=max_new_tokens,
                              sampling=SamplingParams(temperature, top_k, top_p, seed),
                              lookup=lookup_params(prompt_lookup, lookup_ngram), chat=chat,
                              system=system, fim_suffix=fim_suffix, max_context=max_context, gemv=gemv,
                              eager=eager, self_check=not skip_selfcheck)
    with library_warnings(verbose):
        run(options, on_text=lambda text: click.echo(text, nl=False),
            on_status=lambda line: click.echo(line, err=True))


@main.command()
@click.option("--model", "model", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="The .nanoqwen model to check. [default: the embedded tiny-coder]")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="auto runs the GPU tiers when a GPU is found; cpu skips them; cuda fails without one.")
@click.option("--prompts", type=int, default=100, show_default=True,
              help="Code prompts continued in the greedy-token and graph checks.")
@click.option("--seed", type=int, default=None, help="Seed of the random inputs. [default: fresh, printed at the end]")
@verbose_option
def validate(model, device, prompts, seed, verbose):
    """Check the runtime on this machine against its references, tier by tier; exit 1 on any FAIL."""
    from .validate import validate as run_validate

    with library_warnings(verbose):
        report = run_validate(model, device, prompts, seed, on_line=click.echo)
    if report.failed:
        sys.exit(1)


def _token_counts(option: str, text: str) -> tuple[int, ...]:
    """'512,4096' -> (512, 4096); '' -> (); anything else is a NanoQwenError naming the option."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise NanoQwenError(f"{option} takes whole numbers separated by commas, got {text!r}") from None


@main.command()
@click.option("--model", type=click.Path(dir_okay=False), help="A .nanoqwen file to benchmark.")
@click.option("--synthetic", metavar="PRESET", help="Random weights of a preset's shape (tiny, 0.5b ... 32b), no file.")
@click.option("--prompt-tokens", type=int, default=512, show_default=True)
@click.option("--gen-tokens", type=int, default=128, show_default=True)
@click.option("--repeats", type=int, default=5, show_default=True, help="Timed runs after one warm-up.")
@click.option("--eager-tokens", type=int, default=16, show_default=True, help="Tokens timed in eager mode.")
@click.option("--gemv", type=click.Choice(GEMV_PATHS), default="auto", show_default=True)
@click.option("--baseline", type=click.Choice(["torch"]), help="Also run transformers + torch on the same weights.")
@click.option("--no-kernels", is_flag=True, help="Skip the per-kernel breakdown.")
@click.option("--no-gemv-paths", is_flag=True, help="Skip the table of GEMV paths (prmt, fixed16, dp4a) at each shape.")
@click.option("--no-prefill-sweep", is_flag=True,
              help="Skip the TTFT sweep over 16, 128, 512, 2048, 8192 and 32000-token prompts (those the model holds).")
@click.option("--contexts", default="512,4096,16384,32000", show_default=True, metavar="N,N,...",
              help="Contexts of the decode ITL sweep (those the model holds); '' skips it.")
@click.option("--no-gemm-tiles", is_flag=True, help="Skip the INT4 GEMM table (every tile shape at M = 512 and 2048).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write every figure to this JSON file.")
@verbose_option
def bench(model, synthetic, prompt_tokens, gen_tokens, repeats, eager_tokens, gemv, baseline, no_kernels,
          no_gemv_paths, no_prefill_sweep, contexts, no_gemm_tiles, json_path, verbose):
    """Measure TTFT, ITL, bandwidth and a kernel breakdown on the GPU; print a markdown table."""
    from .bench import BenchSettings, run_bench
    from .bench_report import check_json_target, render_markdown, write_json

    settings = BenchSettings(model=model, synthetic=synthetic, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens,
                             repeats=repeats, eager_tokens=eager_tokens, gemv=gemv, baseline=baseline,
                             kernels=not no_kernels, gemv_paths=not no_gemv_paths,
                             prefill_lengths=() if no_prefill_sweep else BenchSettings.prefill_lengths,
                             gemm_tiles=not no_gemm_tiles, contexts=_token_counts("--contexts", contexts)).validate()
    if json_path is not None and not json_path.strip():  # it would have written nothing, silently
        raise NanoQwenError("--json is empty; give the path of the JSON file to write")
    if json_path:  # what would keep the results from being written is found out now, not after the run
        check_json_target(json_path)
    with library_warnings(verbose):
        result = run_bench(settings, progress=lambda line: click.echo(f"[bench] {line}", err=True))
    click.echo(render_markdown(result))
    if json_path:
        write_json(result, json_path)
        click.echo(f"[bench] wrote {json_path}", err=True)


@main.command()
@click.option("--model", "model", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="The .nanoqwen model to serve. [default: the embedded tiny-coder]")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None,
              help="Run on the GPU engine or the numpy reference. [default: cuda if a GPU is found]")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; 0.0.0.0 opens the server to the network.")
@click.option("--port", type=int, default=8080, show_default=True, help="TCP port; 0 picks a free one.")
@click.option("--max-context", type=int, default=32768, show_default=True,
              help="Context of every request in tokens (capped by the model's max_position_embeddings).")
@click.option("--api-key", default=None, metavar="KEY", envvar="PYNANOQWEN_API_KEY",
              help="Require `Authorization: Bearer KEY` on every request but /health (or set PYNANOQWEN_API_KEY).")
@click.option("--max-queue", type=int, default=8, show_default=True,
              help="Requests that may wait behind the running one; beyond them, 503 with Retry-After.")
@click.option("--no-prefix-cache", is_flag=True, help="Reuse no KV pages of earlier requests: prefill every prompt.")
@click.option("--skip-selfcheck", is_flag=True,
              help="On the GPU, skip the check of one decode step against the numpy reference before serving.")
@lookup_options
@verbose_option
def serve(model, device, host, port, max_context, api_key, max_queue, no_prefix_cache, skip_selfcheck, prompt_lookup,
          lookup_ngram, verbose):
    """Serve the model over HTTP: OpenAI's /v1/completions and /v1/chat/completions, llama.cpp's /infill."""
    from .prompt_lookup import lookup_params
    from .server.run import ServeOptions, serve as run_server

    options = ServeOptions(model=model, device=device, host=host, port=port, max_context=max_context, api_key=api_key,
                           max_queue=max_queue, prefix_cache=not no_prefix_cache, self_check=not skip_selfcheck,
                           lookup=lookup_params(prompt_lookup, lookup_ngram))
    with library_warnings(verbose):  # the filter is the process's, so the server's worker thread has it too
        run_server(options, on_status=lambda line: click.echo(line, err=True))
