"""Where a prefill chunk's time goes that its stages, timed alone, do not account for.

bench's prefill breakdown times each stage of a chunk (all 28 launches of it) in a CUDA graph of
its own. On an H100 at a348b90 the stages summed to 13.95 of the 15.17 ms TTFT at 512 rows and to
51.08 of 56.57 at 2048: ~10% of a chunk lies outside them. This script takes the gap apart, on the
engine's own launch list (engine.probes.prefill_chunk_launches: the chunk from position 0, without
its page_alloc) at each chunk size:

- TTFT: bench's time to first token for a prompt of that many tokens (host work included);
- chunk, once: the chunk's graph launched alone after the GPU has idled (as a TTFT launches it),
  median of a few; chunk, replayed: the same graph back to back. TTFT minus "once" is the host's
  part; "once" minus "replayed" what an idle start costs;
- the same graph on a chunk of identical rows (token 0 at every position, as the probe's chunk was
  before 2026-12-07), twice, between the rest: what the rows' data changes;
- for each stage, the chunk's graph without that stage: whole minus that is what the stage costs
  in place, next to its time alone (its own graph, as bench times it). A stage that costs more in
  place than alone is where the gap lies;
- the SM clock and power (nvidia-smi) right after each measurement, since long prefills meet the
  H100's power cap (docs/HARDWARE.md).

Leaving a stage out leaves its output buffer as the previous replay wrote it: timings only, the
values are not checked (the tests do that).

Measured on an H100 at 4df2a3f (docs/PERFORMANCE.md, "2026-12-07"), when the probe's chunk was
token 0 at every position: the chunk's graph took what its stages take alone (14.0 against 13.65 ms
at 512 rows, 49.8 against 50.97 at 2048), and no stage cost much more in place than alone; the gap
lay between the TTFT of random ids and the graph of identical rows (16.0 against 14.2 ms, 56.0
against 49.5), growing with the rows. The probe now draws random ids, and the identical-row graph
is timed beside it. At c897411 (H100, "2026-12-07, morning") the random-row graph took the TTFT's
time (15.0 against 15.2 ms at 512 rows, 56.0 against 55.8 at 2048) and identical rows 6-14% less
(14.1, 49.3), at higher clocks under the power cap: the rows' data was the gap.

    python dev/prefill_stages.py [--rows 512,2048] [--replays 10] [--model 7b.nanoqwen]
"""

from __future__ import annotations

import argparse
import subprocess
import time

import numpy as np
from numba import cuda

from harness import print_table
from pynanoqwen.bench import time_generation
from pynanoqwen.engine import CudaBackend
from pynanoqwen.engine.probes import PROBE_IDS
from pynanoqwen.engine.schedule import run_all
from pynanoqwen.gpu_timing import time_graph
from pynanoqwen.graphs import capture
from pynanoqwen.sampling import SamplingParams
from pynanoqwen.synthetic import SyntheticWeights

ONCE_RUNS = 5  # single launches of the chunk graph, each after the GPU idled
IDLE_S = 0.05


def clocks() -> str:
    """The SM clock (MHz) and power draw (W) right now, as nvidia-smi reads them."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unread ({error})"
    return out.replace(", ", " MHz ") + " W"


def time_once(stream, enqueue) -> float:
    """Median seconds of single launches of enqueue's graph, each after IDLE_S of an idle GPU."""
    graph = capture(stream, enqueue)
    try:
        times = []
        for _ in range(ONCE_RUNS):
            stream.synchronize()
            time.sleep(IDLE_S)
            start, end = cuda.event(), cuda.event()
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            times.append(cuda.event_elapsed_time(start, end) / 1e3)
        return float(np.median(times))
    finally:
        graph.close()


def chunk_table(backend, rows: int, replays: int) -> list[dict]:
    stream = backend.stream
    launches = backend.prefill_chunk_launches(rows, "argmax")
    stages = list(dict.fromkeys(launch.stage for launch in launches))
    prompt = np.random.default_rng(rows).integers(0, PROBE_IDS, rows).tolist()  # the probe's id range
    time_generation(backend, prompt, 1)  # captures the bucket's graph
    ttft = float(np.median([time_generation(backend, prompt, 1)[0] for _ in range(3)]))
    table = [{"rows": rows, "what": "TTFT (bench)", "ms": ttft, "alone ms": "", "clocks": clocks()}]

    def timed(label, chosen, alone=None):
        whole = time_graph(stream, lambda: run_all(chosen, stream), replays) * 1e3
        backend.reset([0], SamplingParams())
        row = {"rows": rows, "what": label, "ms": whole, "alone ms": "" if alone is None else f"{alone:.3f}",
               "clocks": clocks()}
        table.append(row)
        print(row, flush=True)
        return whole

    once = time_once(stream, lambda: run_all(launches, stream)) * 1e3
    backend.reset([0], SamplingParams())
    table.append({"rows": rows, "what": "chunk graph, once after idle", "ms": once, "alone ms": "", "clocks": clocks()})
    whole = timed("chunk graph, replayed", launches)
    identical = backend.prefill_chunk_launches(rows, "argmax", token_ids=np.zeros(backend.max_context + 1, np.int32))
    timed("chunk graph of identical rows (token 0), replayed", identical)
    for stage in stages:
        group = [launch for launch in launches if launch.stage == stage]
        alone = time_graph(stream, lambda group=group: run_all(group, stream), replays) * 1e3
        backend.reset([0], SamplingParams())
        without = timed(f"without {stage} ({len(group)})", [launch for launch in launches if launch.stage != stage],
                        alone)
        table[-1]["in place ms"] = f"{whole - without:.3f}"
    timed("chunk graph, replayed again", launches)
    timed("chunk graph of identical rows (token 0), replayed again", identical)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="512,2048", help="chunk sizes (prefill buckets of the engine)")
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--model", help="a 7B .nanoqwen file (default: synthetic weights made in memory)")
    args = parser.parse_args()
    backend = CudaBackend(args.model or SyntheticWeights("7b", seed=0), verify_data=False, max_context=4096)
    try:
        for rows in (int(r) for r in args.rows.split(",")):
            table = chunk_table(backend, rows, args.replays)
            for row in table:
                row.setdefault("in place ms", "")
            print_table(f"prefill chunk of {rows} rows: each stage in place (whole - without) and alone, ms", table)
    finally:
        backend.close()


if __name__ == "__main__":
    main()
