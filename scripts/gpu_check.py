"""Everything the GPU engine needs checked and timed on the H200, in one run, with printed results.

    PYTHONPATH=$PWD python scripts/gpu_check.py [--out DIR] [--model FILE] [--prompts 100]
                                                 [--sections build,unit,layer,...]

Sections, in order (each in try/except: a failure is logged with its traceback and the run goes on):

  build        write a random 7B-shaped .nanoqwen (pynanoqwen/synthetic.py) unless --model exists
  unit         pytest, rung 1: tests/test_engine_gpu.py's kernel tests at 7B shapes
  layer        rung 2: one 7B-dimension decoder layer against transformers, prmt and dp4a
  model        rung 3: teacher-forced logits over 64 tokens against the numpy ReferenceModel
  graph_eager  rung 3: --prompts prompts x 32 tokens, graph and eager, tokens identical
  alloc        rung 3: device allocations and free memory over 128 decode steps
  decode       ms/token and GB/s at context 512, graph and eager (prmt, then dp4a)
  kernels      each kernel group of a step (CudaBackend.kernel_groups) replayed in its own graph:
               us per launch, bytes, GB/s, for both GEMV paths, plus the candidates sampler

Logs go to $OUT (env var; --out; default ./out): gpu_check.log (everything printed),
gpu_check.json (every section's numbers), pytest_unit.log. A summary table is printed last.
Each command on the lent machine may run 10 minutes, and all sections together take longer
(estimated from the 170 us per eager launch of GPU-NOTES: the eager half of graph_eager alone
is ~40 steps x ~40 ms x 100 prompts): split them, e.g.
--sections build,unit,layer,model then --sections graph_eager,alloc,decode,kernels, with the same
--model (the file stays on the machine's disk while it is held).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("build", "unit", "layer", "model", "graph_eager", "alloc", "decode", "kernels")
ROOFLINE_GBS = 4300.0  # H200 read bandwidth measured with 16-byte loads (../shared/GPU-NOTES.md)
DECODE_CONTEXT = 512


class Log:
    """Print and append to $OUT/gpu_check.log at the same time."""

    def __init__(self, path: Path):
        self.file = open(path, "a", buffering=1)

    def __call__(self, *parts) -> None:
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        self.file.write(line + "\n")


def load_ladder():
    """tests/test_engine_gpu.py as a module: its helpers compute what the tests assert on."""
    spec = importlib.util.spec_from_file_location("test_engine_gpu", REPO / "tests" / "test_engine_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("numpy", "numba", "numba_cuda", "torch", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except Exception as err:  # a missing package is a finding, not a crash
            out[name] = f"unavailable ({err})"
    try:
        from numba import cuda

        device = cuda.get_current_device()
        out["device"] = device.name.decode() if isinstance(device.name, bytes) else device.name
        out["compute_capability"] = device.compute_capability
        free, total = cuda.current_context().get_memory_info()
        out["memory_free_total_gib"] = (round(free / 2**30, 1), round(total / 2**30, 1))
    except Exception as err:
        out["device"] = f"unavailable ({err})"
    return out


# ------------------------------------------------------------------------------------------------
# Sections. Each returns a dict of results and raises on failure.

def section_build(ctx) -> dict:
    from pynanoqwen.config import PRESETS
    from pynanoqwen.synthetic import write_synthetic_nanoqwen

    if ctx.model.exists() and not ctx.args.rebuild:
        return {"model": str(ctx.model), "reused": True, "bytes": ctx.model.stat().st_size}
    start = time.perf_counter()
    write_synthetic_nanoqwen(ctx.model, PRESETS["7b"], seed=0)
    return {"model": str(ctx.model), "seconds": round(time.perf_counter() - start, 1),
            "bytes": ctx.model.stat().st_size, "cpus": os.cpu_count()}


def section_unit(ctx) -> dict:
    log_path = ctx.out / "pytest_unit.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-m", "gpu and not slow",
           str(REPO / "tests" / "test_engine_gpu.py")]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))))
    log_path.write_text(proc.stdout + proc.stderr)
    tail = [line for line in proc.stdout.splitlines() if line.startswith(("PASSED", "FAILED", "ERROR", "SKIPPED"))]
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    if proc.returncode != 0:
        raise RuntimeError(f"pytest failed ({summary}); see {log_path}")
    return {"summary": summary, "tests": tail, "seconds": round(time.perf_counter() - start, 1)}


def section_layer(ctx) -> dict:
    ladder = ctx.ladder
    results = {}
    for gemv in ("prmt", "dp4a"):
        result = ladder.layer_vs_transformers(str(ctx.scratch), gemv)
        result["bound"] = ladder.LAYER_REL_BOUND[gemv]
        result["pass"] = result["update_max_row_rel_l2"] < result["bound"]
        results[gemv] = result
    if not all(r["pass"] for r in results.values()):
        raise AssertionError(f"layer error above the bound: {results}")
    return results


def section_model(ctx) -> dict:
    ladder = ctx.ladder
    start = time.perf_counter()
    result = ladder.teacher_forced_vs_reference(ctx.backend(), str(ctx.model))
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["bound_max_row_rel_l2"] = ladder.SEVEN_B.num_layers * ladder.LAYER_REL_BOUND["prmt"]
    result["pass"] = (result["max_row_rel_l2"] < result["bound_max_row_rel_l2"]
                      and result["top1_agreement_clear_rows"] in (None, 1.0))
    if not result["pass"]:
        raise AssertionError(str(result))
    return result


def section_graph_eager(ctx) -> dict:
    start = time.perf_counter()
    result = ctx.ladder.graph_vs_eager(ctx.backend(), ctx.args.prompts)
    result["seconds"] = round(time.perf_counter() - start, 1)
    if not result["identical"]:
        raise AssertionError(str(result))
    return result


def section_alloc(ctx) -> dict:
    result = ctx.ladder.allocations_during_decode(ctx.backend(), 128)
    if any(r["memalloc_calls"] or r["free_bytes_change"] or r["tokens"] != 128 for r in result.values()):
        raise AssertionError(str(result))
    return result


def time_decode(backend, steps: int, context: int = DECODE_CONTEXT, eager: bool = False) -> dict:
    """Fill the KV cache to `context` with a random prompt (through the graphs), then time `steps`
    greedy steps back to back, graph or eager (GPU time, one sync at the end); in graph mode also
    the streaming loop of generate() (a 4-byte copy and an event per token)."""
    from numba import cuda

    from pynanoqwen.sampling import SamplingParams

    rng = np.random.default_rng(1)
    prompt = rng.integers(0, backend.config.vocab_size, context).tolist()
    backend.reset(prompt, SamplingParams())
    for position in range(context - 1):
        backend.step(position, "prompt")
    backend.step(context - 1, "argmax")
    backend.stream.synchronize()
    start, end = cuda.event(), cuda.event()
    backend.eager = eager
    try:
        start.record(backend.stream)
        for i in range(steps):
            backend.step(context + i, "argmax")
        end.record(backend.stream)
        end.synchronize()
    finally:
        backend.eager = False
    ms = cuda.event_elapsed_time(start, end) / steps
    step_bytes = backend.bytes_per_step(context + steps // 2)
    result = {"context": f"{context}..{context + steps}", "steps": steps, "ms_per_token": round(ms, 4),
              "tokens_per_s": round(1000 / ms, 1), "bytes_per_step": step_bytes,
              "GB_per_s": round(step_bytes / ms / 1e6, 1),
              "roofline_fraction": round(step_bytes / ms / 1e6 / ROOFLINE_GBS, 3)}
    if not eager:
        stamps = []
        for _ in backend.generate(prompt, SamplingParams(), steps + 1, frozenset()):
            stamps.append(time.perf_counter())
        result["streamed_ms_per_token_median"] = round(float(np.median(np.diff(stamps))) * 1000, 4)
    return result


def section_decode(ctx) -> dict:
    results = {}
    backend = ctx.backend()
    results["prmt graph"] = time_decode(backend, 128)
    results["prmt eager"] = time_decode(backend, 8, eager=True)
    results["dp4a graph"] = time_decode(ctx.backend("dp4a"), 128)
    return results


def kernel_timings(backend, method: str = "argmax") -> dict:
    """Each kernel group of a step (CudaBackend.kernel_groups) replayed in its own CUDA graph."""
    from pynanoqwen.gpu_timing import time_graph

    results = {}
    for name, enqueue, launches, nbytes in backend.kernel_groups(DECODE_CONTEXT, method):
        seconds = time_graph(backend.stream, enqueue)
        results[name] = {"launches": launches, "us_per_launch": round(seconds * 1e6 / launches, 2),
                         "bytes_per_launch": nbytes // launches, "GB_per_s": round(nbytes / seconds / 1e9, 1)}
    results["step (sum of groups)"] = {"us": round(sum(r["us_per_launch"] * r["launches"]
                                                       for r in results.values()), 1)}
    return results


def section_kernels(ctx) -> dict:
    results = {gemv: kernel_timings(ctx.backend(gemv)) for gemv in ("prmt", "dp4a")}
    results["sampling candidates"] = kernel_timings(ctx.backend(), "candidates")["sampling candidates"]
    return results


# ------------------------------------------------------------------------------------------------

class Context:
    def __init__(self, args, out: Path, log: Log):
        self.args, self.out, self.log = args, out, log
        self.model = Path(args.model)
        self.scratch = Path(tempfile.mkdtemp(prefix="gpu_check_"))  # 1-layer model files, not results
        self._backends = {}
        self._ladder = None

    @property
    def ladder(self):
        if self._ladder is None:
            self._ladder = load_ladder()
        return self._ladder

    def backend(self, gemv: str = "prmt"):
        if gemv not in self._backends:
            from pynanoqwen.engine import CudaBackend

            start = time.perf_counter()
            self._backends[gemv] = CudaBackend(self.model, max_context=4096, gemv=gemv)
            self.log(f"  loaded {self._backends[gemv].name} in {time.perf_counter() - start:.1f} s")
        return self._backends[gemv]


def short(result) -> str:
    """A one-line digest of a section's result for the final table."""
    if not isinstance(result, dict):
        return str(result)[:150]
    keys = ("seconds", "summary", "rel_l2", "max_row_rel_l2", "update_max_row_rel_l2", "bound", "top1_agreement",
            "top1_agreement_clear_rows", "identical", "memalloc_calls", "free_bytes_change", "ms_per_token",
            "streamed_ms_per_token_median", "GB_per_s", "roofline_fraction", "us_per_launch", "us")
    parts = []
    for key, value in result.items():
        if isinstance(value, dict):
            inner = ", ".join(f"{k}={value[k]}" for k in keys if k in value)
            parts.append(f"{key}: {inner}" if inner else f"{key}: {json.dumps(value, default=str)[:80]}")
        elif key in keys:
            parts.append(f"{key}={value}")
    return "; ".join(parts)[:400]


def timing_table(results: dict) -> list[str]:
    """The decode and per-kernel figures as aligned rows (empty when those sections did not run)."""
    lines = []
    decode = results.get("decode", {})
    if "error" not in decode and decode:
        lines += ["", f"{'decode (7B, ctx 512)':<22} {'ms/token':>9} {'tok/s':>7} {'GB/s':>7} {'of 4.3TB/s':>10} "
                      f"{'streamed ms/tok':>15}"]
        for mode, r in decode.items():
            lines.append(f"{mode:<22} {r['ms_per_token']:>9.3f} {r['tokens_per_s']:>7.1f} {r['GB_per_s']:>7.0f} "
                         f"{r['roofline_fraction']:>10.1%} "
                         f"{r.get('streamed_ms_per_token_median', float('nan')):>15.3f}")
    kernels = results.get("kernels", {})
    if "error" not in kernels and kernels:
        lines += ["", f"{'kernel group':<24} {'launches':>8} {'prmt us':>8} {'GB/s':>6} {'dp4a us':>8} {'GB/s':>6}"]
        prmt, dp4a = kernels.get("prmt", {}), kernels.get("dp4a", {})
        for (name, a), b in zip(prmt.items(), dp4a.values()):
            if "launches" not in a:
                lines.append(f"{name:<24} {'':>8} {a['us']:>8.1f} {'':>6} {b['us']:>8.1f}")
                continue
            lines.append(f"{name.replace(' prmt', ''):<24} {a['launches']:>8} {a['us_per_launch']:>8.2f} "
                         f"{a['GB_per_s']:>6.0f} {b['us_per_launch']:>8.2f} {b['GB_per_s']:>6.0f}")
        c = kernels.get("sampling candidates")
        if c:
            lines.append(f"{'sampling candidates':<24} {c['launches']:>8} {c['us_per_launch']:>8.2f} "
                         f"{c['GB_per_s']:>6.0f}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--model", default="/tmp/pynanoqwen-random-7b.nanoqwen")
    parser.add_argument("--rebuild", action="store_true", help="write the model even if --model exists")
    parser.add_argument("--prompts", type=int, default=100, help="prompts in the graph-vs-eager check")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "gpu_check.log")
    ctx = Context(args, out, log)
    results = {"versions": versions()}
    log("gpu_check", time.strftime("%Y-%m-%d %H:%M:%S"), json.dumps(results["versions"], default=str))
    status = {}
    for name in args.sections.split(","):
        if name not in SECTIONS:
            log(f"unknown section {name!r}; choose from {', '.join(SECTIONS)}")
            status[name] = ("ERROR", "unknown section")
            continue
        log(f"== {name}")
        start = time.perf_counter()
        try:
            result = globals()[f"section_{name}"](ctx)
            status[name] = ("PASS", short(result))
            results[name] = result
            log(json.dumps(result, indent=1, default=str))
        except Exception as err:
            state = "FAIL" if isinstance(err, AssertionError) else "ERROR"
            status[name] = (state, f"{type(err).__name__}: {err}"[:400])
            results[name] = {"error": traceback.format_exc()}
            log(traceback.format_exc())
        log(f"   {name}: {status[name][0]} in {time.perf_counter() - start:.1f} s")
        (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    log("\n== summary")
    for name, (state, detail) in status.items():
        log(f"{name:<12} {state:<5} {detail}")
    for line in timing_table(results):
        log(line)
    return 0 if all(state == "PASS" for state, _ in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
