"""Prompt lookup on an editing workload: acceptance, tokens per forward pass, and the lossless check.

    python bench/prompt_lookup.py [--model FILE] [--prompts 100] [--gen-tokens 64] [--json out.json]

Workloads (pynanoqwen/data): "editing", a held-out function's first --source-tokens tokens followed
by its first --repeat-tokens again, so that what the model goes on to write is mostly in its
prompt; and "plain", the same functions' first --source-tokens tokens alone. Every prompt is
generated greedily with --prompt-lookup 0 and with each K of --draft-tokens; the tokens must be
identical (the script exits 1 otherwise). Reported per (workload, K): verify passes, plain steps
(passes where nothing matched), accepted / drafted tokens, and tokens per forward pass after the
prompt, which is the speedup of an engine whose verify pass costs what one decode step costs.

It runs on the CPU reference: the GPU engine's verify pass is not built yet (docs/SPECULATIVE.md),
so this measures acceptance, not GPU time. The CPU's own seconds are printed too; they are not a
speedup (the reference's verify pass computes its rows one at a time).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from pynanoqwen.backends import CpuBackend
from pynanoqwen.bench import git_commit
from pynanoqwen.data import editing_prompts, held_out_prompts
from pynanoqwen.fileformat import NanoQwenFile
from pynanoqwen.generate import resolve_model
from pynanoqwen.prompt_lookup import LookupParams
from pynanoqwen.reference import ReferenceModel
from pynanoqwen.sampling import SamplingParams
from pynanoqwen.tokenizer import Tokenizer


def run_workload(backend: CpuBackend, prompts: list[list[int]], gen_tokens: int, draft_tokens: list[int],
                 stop_ids: frozenset[int]) -> list[dict]:
    start = time.perf_counter()
    plain = [list(backend.generate(p, SamplingParams(), gen_tokens, stop_ids)) for p in prompts]
    rows = [{"draft_tokens": 0, "generated": sum(map(len, plain)), "passes": sum(map(len, plain)) - len(prompts),
             "cpu_seconds": time.perf_counter() - start}]
    for k in draft_tokens:
        totals = dict.fromkeys(["verify_passes", "plain_steps", "drafted", "accepted", "generated", "identical"], 0)
        start = time.perf_counter()
        for prompt, expected in zip(prompts, plain):
            tokens = list(backend.generate(prompt, SamplingParams(), gen_tokens, stop_ids, LookupParams(k)))
            for name, count in dataclasses.asdict(backend.lookup_stats).items():
                totals[name] += count
            totals["generated"] += len(tokens)
            totals["identical"] += tokens == expected
        passes = totals["verify_passes"] + totals["plain_steps"]
        rows.append({"draft_tokens": k, **totals, "passes": passes, "cpu_seconds": time.perf_counter() - start,
                     # The first token comes from the prompt's pass, which both counts leave out.
                     "tokens_per_pass": (totals["generated"] - len(prompts)) / passes})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .nanoqwen file [default: the embedded tiny-coder]")
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--source-tokens", type=int, default=None,
                        help="prompt tokens of source [default: half the model's context]")
    parser.add_argument("--repeat-tokens", type=int, default=16)
    parser.add_argument("--draft-tokens", default="4,8,12", help="the K values, comma-separated")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    path = resolve_model(args.model)
    f = NanoQwenFile(path)
    cfg = f.config
    tokenizer = Tokenizer.from_json_bytes(f.tokenizer_json, None, vocab_size=cfg.vocab_size,
                                          bos_token_id=cfg.bos_token_id,
                                          eos_token_id=cfg.eos_token_id, extra_eos_ids=f.extra_eos_ids)
    context = cfg.max_position_embeddings
    source = args.source_tokens or context // 2
    if source + args.repeat_tokens + args.gen_tokens > context:
        print(f"error: {source} + {args.repeat_tokens} prompt tokens + {args.gen_tokens} generated exceed the "
              f"model's context of {context}", file=sys.stderr)
        return 1
    draft_tokens = [int(k) for k in args.draft_tokens.split(",")]
    for k in draft_tokens:
        LookupParams(k).validate()
    backend = CpuBackend(ReferenceModel(f, max_context=context))
    workloads = {
        "editing": editing_prompts(tokenizer.encode, args.prompts, source, args.repeat_tokens),
        "plain": held_out_prompts(tokenizer.encode, args.prompts, source),
    }
    results = {name: run_workload(backend, prompts, args.gen_tokens, draft_tokens, tokenizer.stop_ids)
               for name, prompts in workloads.items()}

    print(f"{path.name}: {args.prompts} prompts of {source} source tokens (editing: + {args.repeat_tokens} "
          f"repeated), {args.gen_tokens} greedy tokens, CPU reference\n")
    print("| workload | K | verify passes | plain steps | accepted / drafted | tokens per pass | identical | CPU s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    lossless = True
    for name, rows in results.items():
        for row in rows:
            if row["draft_tokens"] == 0:
                print(f"| {name} | 0 | - | {row['passes']} | - | 1.00 | - | {row['cpu_seconds']:.1f} |")
                continue
            lossless &= row["identical"] == args.prompts
            print(f"| {name} | {row['draft_tokens']} | {row['verify_passes']} | {row['plain_steps']} | "
                  f"{row['accepted']} / {row['drafted']} ({100 * row['accepted'] / max(row['drafted'], 1):.0f}%) | "
                  f"{row['tokens_per_pass']:.2f} | {row['identical']}/{args.prompts} | {row['cpu_seconds']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps({
            "commit": git_commit(), "model": path.name, "device": "cpu (numpy reference)", "prompts": args.prompts,
            "source_tokens": source, "repeat_tokens": args.repeat_tokens, "gen_tokens": args.gen_tokens,
            "results": results}, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    if not lossless:
        print("error: prompt lookup changed the greedy tokens of some prompt", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
