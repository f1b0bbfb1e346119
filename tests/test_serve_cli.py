"""`python -m pynanoqwen serve` as a user runs it: progress lines and the URL, requests answered, a
clean stop on Ctrl-C (exit 130, as every command), and one error line for what cannot start."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys

import httpx

SERVE = [sys.executable, "-m", "pynanoqwen", "serve", "--device", "cpu"]


def test_serve_prints_the_urls_answers_and_stops_on_ctrl_c():
    server = subprocess.Popen(SERVE + ["--port", "0"], stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not (lines and lines[-1].startswith("serving")):
            line = server.stderr.readline()
            assert line, "serve exited early:\n" + "".join(lines)
            lines.append(line)
        assert lines[0].startswith("loading ") and "tiny-coder.nanoqwen" in lines[0]
        url = re.search(r"at (http://127\.0\.0\.1:\d+):", lines[-1]).group(1)
        assert f"OpenAI base URL {url}/v1" in lines[-1] and f"/infill {url}/infill" in lines[-1]
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        answer = httpx.post(url + "/v1/completions", json={"model": "tiny-coder", "prompt": "def f(", "max_tokens": 3},
                            timeout=60)
        assert answer.json()["usage"]["completion_tokens"] == 3
    finally:
        server.send_signal(signal.SIGINT)
        code = server.wait(timeout=60)
    rest = server.stderr.read()
    assert code == 130 and "interrupted" in rest and "Traceback" not in rest  # the CLI's Ctrl-C, after a clean stop


def test_what_cannot_start_is_one_error_line(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    cases = [(["--port", "70000"], "error: --port must be between 0 and 65535, got 70000"),
             (["--port", str(port)], f"error: cannot listen on 127.0.0.1:{port}: Address already in use"),
             (["--model", str(tmp_path / "none.nanoqwen"), "--port", "0"], "no such file"),
             (["--prompt-lookup", "40", "--port", "0"], "error: --prompt-lookup must be between 0 (off) and 15, got 40")]
    env = {**os.environ, "PYNANOQWEN_API_KEY": ""}
    for args, message in cases:
        run = subprocess.run(SERVE + args, capture_output=True, text=True, timeout=120, env=env)
        assert run.returncode == 1 and message in run.stderr and "Traceback" not in run.stderr, run.stderr
    taken.close()


def test_serve_hides_numba_warnings_unless_verbose(monkeypatch):
    """Like generate, bench and validate, serve runs inside device.library_warnings: a numba-cuda
    warning raised while it serves (here by a stand-in for the server) is shown only with
    --verbose. serve had no --verbose and printed every such warning."""
    import warnings

    from click.testing import CliRunner
    from numba.core.errors import NumbaPerformanceWarning

    import pynanoqwen.server.run as run
    from pynanoqwen.cli import main

    def fake_serve(options, on_status):
        warnings.warn("grid size 1 will likely result in GPU under-utilization", NumbaPerformanceWarning)
        on_status("served")

    monkeypatch.setattr(run, "serve", fake_serve)
    for flags, shown in (([], False), (["--verbose"], True)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = CliRunner().invoke(main, ["serve", "--device", "cpu", *flags])
        assert result.exit_code == 0 and "served" in result.output, result.output
        assert any("under-utilization" in str(w.message) for w in caught) == shown, caught
