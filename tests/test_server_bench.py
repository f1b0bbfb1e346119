"""bench/server_latency.py runs end to end on the CPU with the embedded model and writes its JSON
(the GPU figures come from the same script on the GPU machine); bench/server_overhead.py runs too."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "server_latency.py"


def load(script: Path):
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_server_bench_measures_all_three_figures(tmp_path, capsys):
    bench = load(SCRIPT)
    out = tmp_path / "server.json"
    bench.main(["--device", "cpu", "--prompt-tokens", "32", "--gen-tokens", "6", "--context-tokens", "150",
                "--repeats", "2", "--json", str(out)])
    result = json.loads(out.read_text())
    for side in ("direct", "server"):
        assert result[side]["ttft_ms"] > 0 and result[side]["itl_ms"] > 0
    # The server's stamps nest: the client sends before the route starts, which is before the job starts.
    phases = result["server_ttft_phases_ms"]
    assert result["server"]["ttft_ms"] > phases["route_to_first_token"] > phases["job_to_first_token"] > 0
    assert phases["route_to_first_token"] > phases["route_to_job_start"] > 0
    assert phases["direct_lease"] > 0
    infill = result["infill_prefix_cache"]
    assert infill["prompt_tokens"] >= 140 and 0 < infill["computed_tokens"] < infill["prompt_tokens"] - 100
    assert result["cancellation"]["cancelled"] == 2 and result["cancellation"]["server_ms"] > 0
    assert "| /infill TTFT" in capsys.readouterr().out


def test_the_server_overhead_bench_runs_with_a_backend_that_costs_nothing(capsys):
    result = load(SCRIPT.parent / "server_overhead.py").main(["--requests", "5"])
    assert all(result[name] > 0 for name in ("health_ms", "first_event_ms", "first_event_16_ms", "event_gap_ms"))
    assert "| /infill, first event (n_predict 1) |" in capsys.readouterr().out


def test_serve_parses_http_in_c_on_libuv():
    """httptools and uvloop are dependencies because uvicorn takes them when present: the server's
    first event comes ~0.3 ms sooner with them (bench/server_overhead.py, docs/PERFORMANCE.md)."""
    import uvloop  # noqa: F401 (installed with the package on Linux)

    from pynanoqwen.server.run import uvicorn_server

    config = uvicorn_server(lambda scope, receive, send: None).config
    config.load()
    assert config.http_protocol_class.__name__ == "HttpToolsProtocol"
    assert config.get_loop_factory().__module__ == "uvloop"
