"""The benchmark's CPU-side parts: settings, statistics, the report, the JSON file, the history page."""

import json
import random
import statistics

import numpy as np
import pytest
from click.testing import CliRunner

from pynanoqwen import bench_report
from pynanoqwen.bench import BenchSettings
from pynanoqwen.cli import main
from pynanoqwen.config import PRESETS


def fake_mode(rng, itl=2.0):
    gaps = [itl + rng.random() * 0.1 for _ in range(50)]
    ttfts = [30 + rng.random() for _ in range(5)]
    summary = bench_report.summarize(gaps)
    return {"ttft_ms": bench_report.summarize(ttfts), "itl_ms": summary, "decode_tok_s": 1e3 / summary["median"],
            "e2e_tok_s": 400.0, **bench_report.bandwidth(3.65e9, summary["median"], 4.3e12)}


def fake_result(rng):
    return {
        "settings": {"model": "synthetic:7b", "prompt_tokens": 512, "gen_tokens": 128, "repeats": 5,
                     "gemv": "prmt", "git_commit": "abc123", "date": "2026-11-30T10:00:00+00:00"},
        "gpu": {"name": "NVIDIA H200", "driver": "580", "clocks_start": "345/3201", "clocks_end": "1980/3201",
                "copy_gbs": 4300.0},
        "bytes": {"weights": 3.65e9, "kv": 2.8e7, "context": 576},
        "graph": fake_mode(rng), "sampled": fake_mode(rng, itl=2.5), "eager": fake_mode(rng, itl=18.0),
        "kernels": [{"name": "gemv", "launches": 28, "us": 100.0, "bytes": 1e8, "gbs": 1000.0, "share": 1.0}],
        "gemv": [{"name": "qkv", "n": 4608, "k": 3584, "prmt_us": 5.9, "prmt_gbs": 1448, "dp4a_us": 6.8,
                  "dp4a_gbs": 1264}],
        "peak_memory_gib": 5.5,
        "baseline": {"name": "torch", **fake_mode(rng, itl=8.0)},
        "prefill": [{"tokens": 512, "ttft_ms": bench_report.summarize([30.0, 31.0]), "tok_s": 16800.0,
                     "tflops": 221.0, "peak_tflops": 790.0}],
        "gemm": [{"name": "gate_up", "n": 18944, "k": 3584, "m": 512, "tile": "large", "default": True,
                  "us": 516.0, "tflops": 269.4, "peak_tflops": 790.0}],
        "prefill_kernels": [{"rows": 512, "kernels": [
            {"name": "qkv gemm", "launches": 28, "us": 1215.2, "bytes": 2.6e8, "gbs": 214.0, "share": 0.25},
            {"name": "gate_up gemm", "launches": 28, "us": 3645.6, "bytes": 1.1e9, "gbs": 301.7, "share": 0.75}]}],
        "prefill_attention": [{"tokens": 8192, "chunks": 4, "us_per_layer": 3210.0, "ms_all_layers": 89.9,
                               "tflops": 150.4, "peak_tflops": 790.0}],
        "prefix_cache": {"prompt_tokens": 4006, "computed_tokens": 22, "ttft_ms": bench_report.summarize([8.2, 8.3]),
                         "cold_ttft_ms": bench_report.summarize([7.4, 7.5])},
    }


def test_summarize_matches_numpy_percentiles():
    rng = np.random.default_rng()
    samples = list(rng.exponential(2.0, size=101))
    s = bench_report.summarize(samples)
    assert s["median"] == pytest.approx(statistics.median(samples))
    assert s["p10"] == pytest.approx(np.percentile(samples, 10))
    assert s["p90"] == pytest.approx(np.percentile(samples, 90))
    with pytest.raises(ValueError):
        bench_report.summarize([])


def test_bandwidth_and_floor():
    out = bench_report.bandwidth(4.3e9, 2.0, 4.3e12)  # 4.3 GB in 2 ms on a 4.3 TB/s copy roofline
    assert out["gbs"] == pytest.approx(2150.0)
    assert out["roofline_share"] == pytest.approx(0.5)
    assert out["floor_ms"] == pytest.approx(1.0)


def test_markdown_report_has_every_section():
    rng = random.Random(7)
    result = fake_result(rng)
    text = bench_report.render_markdown(result)
    graph_itl = result["graph"]["itl_ms"]["median"]
    assert f"{graph_itl:.3f}" in text
    assert "| graph |" in text and "| eager |" in text and "| torch |" in text
    assert f"| graph, sampled | {result['sampled']['ttft_ms']['median']:.2f} | {result['sampled']['itl_ms']['median']:.3f} " in text
    assert "GEMV shape" in text and "kernel (one decode step)" in text
    assert "| 512 | 30.5 (30.1-30.9) | 16800 | 221 | 28% |" in text
    assert "| gate_up 18944x3584 | 512 | large (default) | 516.0 | 269 | 34% |" in text
    assert "| 8192 | 4 | 3210.0 | 89.9 | 150 | 19% |" in text
    assert "| kernel (one prefill chunk of 512 rows) | launches | us total | share of chunk |" in text
    assert "| gate_up gemm | 28 | 3645.6 | 75.0% |" in text
    assert "The stages sum to 4.86 ms of the 30.50 ms TTFT of a 512-token prompt" in text
    assert "TTFT 8.25 (8.21-8.29) ms for 4006 prompt tokens, 22 of them computed; 7.45 (7.41-7.49) ms" in text
    ratio = result["baseline"]["itl_ms"]["median"] / graph_itl
    assert f"ITL {ratio:.2f}x" in text


def test_json_is_atomic_and_complete(tmp_path):
    result = fake_result(random.Random(3))
    path = tmp_path / "sub" / "run.json"
    bench_report.write_json(result, path)
    back = json.loads(path.read_text())
    assert back["schema"] == bench_report.SCHEMA and back["graph"] == result["graph"]
    assert [p.name for p in path.parent.iterdir()] == ["run.json"]  # no temp file left
    with pytest.raises(TypeError):
        bench_report.write_json({"bad": object()}, path)
    assert json.loads(path.read_text()) == back  # a failed write leaves the old file intact
    assert [p.name for p in path.parent.iterdir()] == ["run.json"]


def test_json_that_cannot_be_written_is_one_error_after_the_run_and_caught_before_it(tmp_path):
    """After a run a file that cannot be made is one NanoQwenError (it was an OSError traceback);
    before it, check_json_target tries the temporary file write_json will make, so a name that
    fits the file system alone but not with the temporary suffix is refused first, and the probe
    leaves nothing behind."""
    from pynanoqwen.errors import NanoQwenError

    (tmp_path / "file").write_text("x")
    with pytest.raises(NanoQwenError, match="cannot write .*file/run.json"):
        bench_report.write_json(fake_result(random.Random(4)), tmp_path / "file" / "run.json")
    longest = "j" * (255 - bench_report.TEMP_NAME_EXTRA)
    bench_report.check_json_target(str(tmp_path / longest))
    with pytest.raises(NanoQwenError, match="File name too long"):
        bench_report.check_json_target(str(tmp_path / (longest + "j")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of"),
    ({"model": "a", "synthetic": "7b"}, "exactly one of"),
    ({"synthetic": "7b", "gen_tokens": 2}, "at least 3"),
    ({"synthetic": "7b", "eager_tokens": 2}, "at least 3"),  # gave an ITL of 0.005 ms and "21795%"
    ({"synthetic": "7b", "contexts": (512, 0)}, "positive"),
    ({"synthetic": "7b", "repeats": 0}, "at least 1"),
    ({"synthetic": "7b", "gemv": "x"}, "prmt or dp4a"),
])
def test_settings_refused(kwargs, message):
    from pynanoqwen.errors import NanoQwenError

    with pytest.raises(NanoQwenError, match=message):
        BenchSettings(**kwargs).validate()


def test_a_share_above_the_copy_roofline_is_flagged_and_the_context_sweep_rendered():
    result = fake_result(random.Random(3))
    result["eager"]["roofline_share"] = 217.95  # what two eager tokens printed before they were refused
    result["decode_contexts"] = [{"context": 4096, "itl_ms": {"median": 2.5, "p10": 2.4, "p90": 2.6, "n": 62},
                                  **bench_report.bandwidth(3.7e9, 2.5, 4.28e12)}]
    result["kernel_summary"] = {"launches_per_step": 143.06, "kernel_us": 2000.0, "itl_us": 2200.0, "bubble_us": 200.0}
    text = bench_report.render_markdown(result)
    assert "21795% (above the copy roofline: check the measurement)" in text
    assert "| 4096 | 2.500 (2.400-2.600) | 0.864 | 1480 | 35% |" in text
    assert "143.06 launches per step" in text and "a bubble of 200 us" in text


def test_sweep_points_past_the_models_context_are_dropped():
    settings = BenchSettings(synthetic="7b").fitting(2048)
    assert settings.contexts == (512,) and settings.prefill_lengths == (16, 128, 512)
    assert settings.max_context <= 2048


def test_cli_without_gpu_is_one_line_error():
    runner = CliRunner()
    result = runner.invoke(main, ["bench", "--synthetic", "tiny"])
    assert result.exit_code == 1
    assert result.output.strip().startswith("error:") and "GPU" in result.output
    assert len(result.output.strip().splitlines()) == 1
    bad = runner.invoke(main, ["bench"])
    assert bad.exit_code == 1 and "exactly one of" in bad.output


def test_history_page_renders(tmp_path):
    from importlib.util import module_from_spec, spec_from_file_location
    from pathlib import Path

    spec = spec_from_file_location("render_results", Path(__file__).parents[1] / "bench" / "render_results.py")
    render = module_from_spec(spec)
    spec.loader.exec_module(render)
    rng = random.Random(11)
    results = tmp_path / "results"
    for i in range(3):
        r = fake_result(rng)
        r["settings"]["date"] = f"2026-11-3{i}T00:00:00"
        r["settings"]["git_commit"] = "0123456789abcdef" + ("-dirty" if i == 2 else "")
        bench_report.write_json(r, results / f"run{i}.json")
    page = tmp_path / "RESULTS.md"
    render.main(results, page)
    text = page.read_text()
    assert text.count("synthetic:7b") == 3 and "history.png" in text
    # A run of a tree with uncommitted changes says so; the others name their commit alone.
    assert text.count("| 01234567 |") == 2 and text.count("| 01234567 (uncommitted changes) |") == 1
    assert (tmp_path / "history.png").stat().st_size > 1000
    # A folder with no results (a mistyped path) is an error that leaves the page alone.
    with pytest.raises(SystemExit, match="no result files"):
        render.main(tmp_path / "no such folder", page)
    assert page.read_text() == text


def test_bf16_baseline_bytes_count_every_weight_once():
    from pynanoqwen.bench import step_bytes_bf16

    cfg = PRESETS["7b"]
    params = sum(n * k for n, k in cfg.linear_shapes.values()) * cfg.num_layers + cfg.vocab_size * cfg.hidden_size
    assert 2 * params < step_bytes_bf16(cfg, 0) < 2 * params * 1.001


def test_torch_baseline_model_computes_our_model():
    """The baseline runs transformers on our dequantized weights: on the CPU, in bf16, its logits
    must be those of the numpy reference up to bf16 rounding (8 bits of mantissa)."""
    torch = pytest.importorskip("torch")
    from pynanoqwen.bench_baseline import build_model
    from pynanoqwen.reference import InMemoryWeights, ReferenceModel
    from pynanoqwen.tensors import hf_tensors

    cfg = PRESETS["tiny"]
    rng = np.random.default_rng()
    hf = {name: (rng.standard_normal(shape) * (0.02 if len(shape) == 2 else 0.1)
                 + (1.0 if name.endswith("norm.weight") else 0.0)).astype(np.float32)
          for name, shape in hf_tensors(cfg).items()}
    weights = InMemoryWeights.quantize(cfg, hf, lm_head_int4=True)
    tokens = rng.integers(0, cfg.vocab_size, 16)
    ours = ReferenceModel(weights).forward(tokens.tolist())
    model = build_model(weights, device="cpu")
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens[None])).logits[0].float().numpy()
    rel = np.linalg.norm(theirs - ours) / np.linalg.norm(ours)
    print(f"bf16 baseline vs reference: rel {rel:.4f}")
    # bf16 keeps 8 bits (u = 2^-8 = 0.0039); weights, activations and the residual stream are each
    # rounded once per layer, measured 0.008 over many seeds: 0.02 allows 5u, not a tuned margin.
    assert rel < 0.02, rel
    assert np.mean(theirs.argmax(-1) == ours.argmax(-1)) >= 0.75


def test_prefill_flops_of_the_7b_model():
    """Counted by hand for Qwen2.5-7B at 512 tokens: per layer the linears hold 3584 x (4608 +
    3584) + 3 x 3584 x 18944 = 233,046,016 weights (2 FLOPs per weight and row), causal attention
    2 x 2 x 3584 x 512 x 513 / 2 FLOPs, and the last row's lm_head 2 x 152064 x 3584."""
    from pynanoqwen.bench import prefill_flops
    from pynanoqwen.config import PRESETS

    per_layer = 2 * 512 * 233_046_016 + 2 * 2 * 3584 * 512 * 513 // 2
    assert prefill_flops(PRESETS["7b"], 512) == 28 * per_layer + 2 * 152064 * 3584


def test_the_commit_comes_from_the_environment_when_given(monkeypatch):
    from pynanoqwen.bench import git_commit

    monkeypatch.setenv("PYNANOQWEN_COMMIT", "abc1234")
    assert git_commit() == "abc1234"
    monkeypatch.delenv("PYNANOQWEN_COMMIT")
    assert git_commit() != "abc1234"


def test_prefix_cache_ttft_reuses_all_but_the_edited_page_on_the_cpu_reference():
    """bench.prefix_cache_ttft on the embedded model (CPU reference, which has paged prompts too):
    of 100 tokens whose last 16 changed, the 80 in whole pages before the edit are reused."""
    from pynanoqwen.backends import load_backend
    from pynanoqwen.bench import prefix_cache_ttft
    from pynanoqwen.cpu_pages import PagedCpuBackend
    from pynanoqwen.generate import resolve_model

    backend = PagedCpuBackend(load_backend(resolve_model(None), "cpu", 256).model)  # as serve loads it
    vocab = backend.model.config.vocab_size
    got = prefix_cache_ttft(backend, vocab, 2, np.random.default_rng(0), context=100, changed=16)
    assert (got["prompt_tokens"], got["computed_tokens"]) == (100, 20)
    assert got["ttft_ms"]["n"] == got["cold_ttft_ms"]["n"] == 2
    assert got["ttft_ms"]["median"] > 0 and got["cold_ttft_ms"]["median"] > 0


def test_prefill_kernel_breakdown_times_each_group_and_resets_the_engine_after_it(monkeypatch):
    """bench_kernels.prefill_kernel_breakdown on a stand-in engine (its GPU test has not run yet):
    each group of the chunk is replayed in its own graph, its share is of the groups' sum, and the
    engine is reset after each group (the groups write the KV cache)."""
    from pynanoqwen import gpu_timing
    from pynanoqwen.bench_kernels import prefill_kernel_breakdown

    calls = []

    class Engine:
        stream = "stream"

        def prefill_kernel_groups(self, rows):
            return [(f"{stage} gemm", lambda stage=stage: calls.append(stage), 28, nbytes)
                    for stage, nbytes in (("qkv", 2.6e8), ("gate_up", 0))]

        def reset(self, prompt, params):
            calls.append("reset")

    def time_graph(stream, enqueue):
        enqueue()
        return 1e-3 if calls[-1] == "qkv" else 3e-3

    monkeypatch.setattr(gpu_timing, "time_graph", time_graph)
    rows = prefill_kernel_breakdown(Engine(), 512)
    assert calls == ["qkv", "reset", "gate_up", "reset"]
    assert [(r["name"], r["launches"], r["us"], r["share"]) for r in rows] == [
        ("qkv gemm", 28, 1000.0, 0.25), ("gate_up gemm", 28, 3000.0, 0.75)]
    assert rows[0]["gbs"] == 260.0 and rows[1]["gbs"] is None
