"""Write a random Hugging Face Qwen2 checkpoint (weights, config, trained tokenizer) for a preset.

    python scripts/make_checkpoint.py tiny /tmp/tiny
    python scripts/make_checkpoint.py 7b /tmp/ckpt7b --dtype bf16 --shard-size-mb 4000

See pynanoqwen/checkpoint.py for what is written and how.
"""

import sys
import time

import click

from pynanoqwen.checkpoint import DEFAULT_SHARD_BYTES, DTYPES, make_checkpoint
from pynanoqwen.config import PRESETS
from pynanoqwen.errors import NanoQwenError


@click.command()
@click.argument("preset", type=click.Choice(list(PRESETS), case_sensitive=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="bf16", show_default=True)
@click.option("--shard-size-mb", type=click.IntRange(min=1), default=DEFAULT_SHARD_BYTES // 10**6,
              show_default=True, help="Largest safetensors shard, in MB (10^6 bytes).")
def main(preset, out_dir, seed, dtype, shard_size_mb):
    start = time.perf_counter()
    try:
        cfg = make_checkpoint(preset, out_dir, seed=seed, dtype=dtype, shard_bytes=shard_size_mb * 10**6)
    except NanoQwenError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(1)
    click.echo(f"wrote {preset} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, {dtype}) to {out_dir} "
               f"in {time.perf_counter() - start:.1f} s", err=True)


if __name__ == "__main__":
    main()
