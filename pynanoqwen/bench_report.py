"""Benchmark results: statistics, the markdown table printed on stdout, and the JSON result file.

Pure CPU code, so CI tests it; the GPU measurements that fill a result live in bench.py and
bench_kernels.py. A result is a plain JSON-able dict (schema below, `SCHEMA` bumps when a field
changes meaning):

    settings   what was run (model, prompt/gen tokens, repeats, gemv path, git commit, date)
    gpu        name, driver, SM / memory clocks at start and end, measured copy bandwidth (GB/s)
    graph      ttft_ms, itl_ms {median, p10, p90}, decode_tok_s, e2e_tok_s, gbs, roofline_share, floor_ms
    sampled    graph, with bench.SAMPLED's top-k / top-p sampling instead of greedy (absent before 2026-12-06)
    eager      the same, fewer tokens; graph_over_eager = eager ITL / graph ITL
    bytes      weight bytes and KV bytes read per decode step
    kernels    per-kernel breakdown of one decode step: name, launches, us, bytes, gbs, share
    kernel_summary  launches_per_step, kernel_us (sum of the groups), itl_us, bubble_us (ITL - kernel_us)
    decode_contexts ITL at each context: context, itl_ms {median, p10, p90}, gbs, roofline_share, floor_ms
    gemv       every GEMV path (prmt, fixed16, dp4a) at each linear shape: us and GB/s of each
    prefill    TTFT per prompt length: tokens, ttft_ms {median, p10, p90}, tok_s, tflops, peak_tflops
    gemm       INT4 GEMM per linear shape, M (512, 2048) and tile: name, n, k, m, tile, default, us, tflops,
               peak_tflops
    prefill_kernels  per-stage breakdown of one prefill chunk (absent before 2026-12-06): a list of
               {rows, kernels}, kernels as in `kernels`; prefill_kernels_error instead, if it failed
    prefill_attention  one layer's causal prefill attention per prompt length, in the engine's chunks:
               tokens, chunks, us_per_layer, ms_all_layers, tflops, peak_tflops
    prefix_cache  a prompt most of which the prefix cache holds (bench.prefix_cache_ttft; run when the
               engine has room for bench.PREFIX_CONTEXT tokens): prompt_tokens, computed_tokens, ttft_ms and
               cold_ttft_ms (computed_tokens with nothing cached) {median, p10, p90}
    baseline   the same figures for transformers + torch (bf16, static cache, CUDA graph), or absent
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
from pathlib import Path

from .config import resolved
from .errors import NanoQwenError

SCHEMA = 1


def summarize(samples_ms: list[float]) -> dict:
    """Median, p10 and p90 (linear interpolation between closest ranks) of a list of times in ms."""
    if not samples_ms:
        raise ValueError("no samples to summarize")
    data = sorted(samples_ms)

    def pct(p: float) -> float:
        pos = (len(data) - 1) * p
        lo, hi = math.floor(pos), math.ceil(pos)
        return data[lo] + (data[hi] - data[lo]) * (pos - lo)

    return {"median": statistics.median(data), "p10": pct(0.10), "p90": pct(0.90), "n": len(data)}


def bandwidth(bytes_moved: float, ms: float, roofline_bytes_per_s: float | None) -> dict:
    """GB/s achieved for `bytes_moved` in `ms`, its share of the roofline (bytes/s) and the floor time."""
    bytes_per_s = bytes_moved / (ms * 1e-3)
    out = {"gbs": bytes_per_s / 1e9}
    if roofline_bytes_per_s:
        out["roofline_share"] = bytes_per_s / roofline_bytes_per_s
        out["floor_ms"] = bytes_moved / roofline_bytes_per_s * 1e3
    return out


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def share(value: float | None) -> str:
    """A share of the roofline as a percentage; above 100% it is flagged, since no kernel can read
    faster than a copy moves bytes: such a figure means the bytes were counted wrong or came from
    cache, not that the GPU beat its memory."""
    if value is None:
        return "-"
    return f"{100 * value:.0f}%" + (" (above the copy roofline: check the measurement)" if value > 1 else "")


def _peak_share(row: dict) -> str:
    """TFLOP/s as a share of the row's peak (results before peak_tflops was recorded: "-")."""
    return f"{100 * row['tflops'] / row['peak_tflops']:.0f}%" if row.get("peak_tflops") else "-"


def _mode_rows(name: str, mode: dict | None) -> list[str]:
    if not mode:
        return []
    itl = mode["itl_ms"]
    return [f"| {name} | {_fmt(mode['ttft_ms']['median'])} | {_fmt(itl['median'], '.3f')} "
            f"({_fmt(itl['p10'], '.3f')}-{_fmt(itl['p90'], '.3f')}) | {_fmt(mode['decode_tok_s'], '.1f')} | "
            f"{_fmt(mode.get('e2e_tok_s'), '.1f')} | {_fmt(mode.get('gbs'), '.0f')} | "
            f"{share(mode.get('roofline_share'))} |"]


def render_markdown(result: dict) -> str:
    """The human-readable report: a llama-bench-like table, then the breakdowns."""
    s, gpu = result["settings"], result.get("gpu", {})
    lines = [
        f"## pynanoqwen bench: {s['model']} ({s['prompt_tokens']} prompt + {s['gen_tokens']} generated tokens, "
        f"batch 1, gemv={s['gemv']})",
        "",
        f"GPU: {gpu.get('name', '?')}, driver {gpu.get('driver', '?')}, clocks SM/mem "
        f"{gpu.get('clocks_start', '?')} -> {gpu.get('clocks_end', '?')} MHz; copy bandwidth "
        f"{_fmt(gpu.get('copy_gbs'), '.0f')} GB/s; commit {s.get('git_commit', '?')}; {s.get('date', '?')}",
        "",
        "| mode | TTFT ms | ITL ms median (p10-p90) | decode tok/s | e2e tok/s | GB/s | roofline |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += _mode_rows("graph", result.get("graph"))
    lines += _mode_rows("graph, sampled", result.get("sampled"))
    lines += _mode_rows("eager", result.get("eager"))
    base = result.get("baseline")
    if base:
        lines += _mode_rows(base.get("name", "baseline"), base)
    lines.append("")
    by = result.get("bytes")
    if by:
        lines.append(f"Bytes per decode step: {by['weights'] / 1e9:.3f} GB weights + {by['kv'] / 1e6:.1f} MB KV "
                     f"at {by['context']} tokens of context.")
    if result.get("graph") and result.get("eager"):
        lines.append(f"Graph vs eager: {result['eager']['itl_ms']['median'] / result['graph']['itl_ms']['median']:.1f}x "
                     "faster per token.")
    if base and result.get("graph"):
        lines.append(f"vs {base.get('name', 'baseline')}: ITL {base['itl_ms']['median'] / result['graph']['itl_ms']['median']:.2f}x, "
                     f"TTFT {base['ttft_ms']['median'] / result['graph']['ttft_ms']['median']:.2f}x "
                     "(their time / ours; > 1 means we are faster).")
    if result.get("peak_memory_gib") is not None:
        lines.append(f"Peak GPU memory: {result['peak_memory_gib']:.2f} GiB.")
    if result.get("decode_contexts"):
        lines += ["", "| decode at context | ITL ms median (p10-p90) | floor ms | GB/s | roofline |",
                  "| ---: | ---: | ---: | ---: | ---: |"]
        for r in result["decode_contexts"]:
            itl = r["itl_ms"]
            lines.append(f"| {r['context']} | {itl['median']:.3f} ({itl['p10']:.3f}-{itl['p90']:.3f}) | "
                         f"{_fmt(r.get('floor_ms'), '.3f')} | {_fmt(r.get('gbs'), '.0f')} | "
                         f"{share(r.get('roofline_share'))} |")
    if result.get("kernels"):
        copy_gbs = result.get("gpu", {}).get("copy_gbs")
        lines += ["", "| kernel (one decode step) | launches | us total | bytes | GB/s | of copy | share of step |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for k in result["kernels"]:
            of_copy = k["gbs"] / copy_gbs if k.get("gbs") and copy_gbs else None
            lines.append(f"| {k['name']} | {k['launches']} | {k['us']:.1f} | {k['bytes'] / 1e6:.1f} MB | "
                         f"{_fmt(k.get('gbs'), '.0f')} | {share(of_copy)} | {100 * k['share']:.1f}% |")
        summary = result.get("kernel_summary")
        if summary:
            lines.append(f"\n{summary['launches_per_step']:.2f} launches per step; the kernels sum to "
                         f"{summary['kernel_us']:.0f} us of the {summary['itl_us']:.0f} us ITL: a bubble of "
                         f"{summary['bubble_us']:.0f} us (ITL minus the kernels timed back to back).")
    if result.get("gemv"):
        lines += ["", "| GEMV shape (N x K) | prmt us | prmt GB/s | fixed16 us | fixed16 GB/s | dp4a us | dp4a GB/s |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for g in result["gemv"]:
            lines.append(f"| {g['name']} {g['n']}x{g['k']} | {g['prmt_us']:.1f} | {g['prmt_gbs']:.0f} | "
                         f"{_fmt(g.get('fixed16_us'), '.1f')} | {_fmt(g.get('fixed16_gbs'), '.0f')} | "
                         f"{_fmt(g.get('dp4a_us'), '.1f')} | {_fmt(g.get('dp4a_gbs'), '.0f')} |")
    if result.get("prefill"):
        lines += ["", "| prefill (prompt tokens) | TTFT ms median (p10-p90) | prompt tok/s | TFLOP/s | share of "
                      f"{result['prefill'][0]['peak_tflops']:.0f} |", "| ---: | ---: | ---: | ---: | ---: |"]
        for r in result["prefill"]:
            t = r["ttft_ms"]
            lines.append(f"| {r['tokens']} | {t['median']:.1f} ({t['p10']:.1f}-{t['p90']:.1f}) | {r['tok_s']:.0f} | "
                         f"{r['tflops']:.0f} | {100 * r['tflops'] / r['peak_tflops']:.0f}% |")
    ttft_of = {r["tokens"]: r["ttft_ms"]["median"] for r in result.get("prefill") or []}
    for chunk in result.get("prefill_kernels") or []:
        rows = chunk["rows"]
        lines += ["", f"| kernel (one prefill chunk of {rows} rows) | launches | us total | share of chunk |",
                  "| --- | ---: | ---: | ---: |"]
        for k in chunk["kernels"]:
            lines.append(f"| {k['name']} | {k['launches']} | {k['us']:.1f} | {100 * k['share']:.1f}% |")
        total = sum(k["us"] for k in chunk["kernels"])
        ttft = ttft_of.get(rows)
        lines.append(f"\nThe stages sum to {total / 1e3:.2f} ms" + (
            f" of the {ttft:.2f} ms TTFT of a {rows}-token prompt (the rest: between the kernels, the first "
            "token's way to the host)." if ttft is not None else "."))
    if result.get("gemm"):
        lines += ["", "| INT4 GEMM (N x K) | M | tile | us | TFLOP/s | share of peak |",
                  "| --- | ---: | --- | ---: | ---: | ---: |"]
        for g in result["gemm"]:
            lines.append(f"| {g['name']} {g['n']}x{g['k']} | {g['m']} | {g['tile']}"
                         f"{' (default)' if g['default'] else ''} | {g['us']:.1f} | {g['tflops']:.0f} | "
                         f"{_peak_share(g)} |")
    if result.get("prefix_cache"):
        p = result["prefix_cache"]
        spread = lambda t: f"{t['median']:.2f} ({t['p10']:.2f}-{t['p90']:.2f})"  # noqa: E731
        lines += ["", f"prefix cache (serve's engine, no HTTP): TTFT {spread(p['ttft_ms'])} ms for "
                      f"{p['prompt_tokens']} prompt tokens, {p['computed_tokens']} of them computed; "
                      f"{spread(p['cold_ttft_ms'])} ms for {p['computed_tokens']} tokens with nothing cached"]
    if result.get("prefill_attention"):
        lines += ["", "| prefill attention (prompt tokens) | chunks | us a layer | ms, all layers | TFLOP/s | "
                      "share of peak |", "| ---: | ---: | ---: | ---: | ---: | ---: |"]
        for a in result["prefill_attention"]:
            lines.append(f"| {a['tokens']} | {a['chunks']} | {a['us_per_layer']:.1f} | {a['ms_all_layers']:.1f} | "
                         f"{a['tflops']:.0f} | {_peak_share(a)} |")
    return "\n".join(lines) + "\n"


TEMP_NAME_EXTRA = 12  # bytes mkstemp adds to the name: 8 random characters and ".tmp"


def _temp_file(path: Path) -> tuple[int, str]:
    """The temporary file beside `path` that write_json writes and then renames over it."""
    return tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")


def check_json_target(json_path: str) -> None:
    """Refuse, before a run, a --json path that write_json could not write after it: a missing
    directory, something that is not a regular file (the rename would replace /dev/null or a
    FIFO), or a directory where the temporary file cannot be made (not writable, or a name that
    is within the file system's limit itself but not with TEMP_NAME_EXTRA more bytes)."""
    target = Path(json_path)
    try:
        if not resolved(target).parent.is_dir():
            raise NanoQwenError(f"--json {json_path}: its directory does not exist")
        if target.exists() and not target.is_file():
            raise NanoQwenError(f"--json {json_path} is not a regular file; give the path of the JSON file to write")
    except OSError as err:  # a name too long for the file system raises, where a missing one is just False
        raise NanoQwenError(f"--json {json_path}: {err.strerror or err}") from None
    try:
        fd, tmp = _temp_file(target)
    except OSError as err:
        raise NanoQwenError(f"--json {json_path}: {err.strerror or err} (the results go to a temporary file "
                            f"beside it first, whose name is {TEMP_NAME_EXTRA} bytes longer)") from None
    os.close(fd)
    os.unlink(tmp)


def write_json(result: dict, path: str | Path) -> None:
    """Write atomically (temp file + rename), so an interrupted run never leaves half a JSON file."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _temp_file(path)
    except OSError as err:  # after a run: one line, the table already printed
        raise NanoQwenError(f"cannot write {path}: {err.strerror or err}") from None
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"schema": SCHEMA, **result}, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
