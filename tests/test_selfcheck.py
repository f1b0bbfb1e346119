"""The self-check's numpy side (pynanoqwen/selfcheck.py) on a stand-in for the GPU: a float32/FP16
numpy emulation of the engine's probes (tests/emulated_engine.py), written from its documented buffers.

It must pass what a correct engine produces, and fail, naming the kernel and layer, on each kind
of wrong result a broken kernel gives: a sign error in one layer's weights, RoPE at the wrong
angle, attention that ignores a key, a wrong embedding row, a wrong greedy token, a wrong norm;
in the decode step and in the prefill chunk.
"""

import dataclasses

import numpy as np
import pytest

from emulated_engine import EmulatedEngine, emulate_probed_prefill, emulate_probed_step, f16
from pynanoqwen.reference import InMemoryWeights
from pynanoqwen.selfcheck import check_probed_prefill, check_probed_step
from pynanoqwen.synthetic import SyntheticWeights
from pynanoqwen.tensors import SCALES, layer_prefix


def tiny_weights(lm_head_int4: bool, seed: int) -> InMemoryWeights:
    source = SyntheticWeights("tiny", seed=seed, lm_head_int4=lm_head_int4, workers=1)
    return InMemoryWeights(source.config, lm_head_int4, {name: source.tensor(name) for name in source.names})


def failures(checks):
    return [c.name for c in checks if c.status == "FAIL"]


@pytest.fixture(scope="module", params=[True, False], ids=["int4 lm_head", "fp16 lm_head"])
def weights(request):
    return tiny_weights(request.param, seed=int(np.random.default_rng().integers(1000)))


@pytest.mark.parametrize("path", ["auto", "prmt", "dp4a"])
@pytest.mark.parametrize("fused_norm", [True, False])
def test_a_correct_step_passes(weights, path, fused_norm):
    rng = np.random.default_rng()
    first, token = (int(t) for t in rng.integers(0, weights.config.vocab_size, 2))
    checks = check_probed_step(weights, emulate_probed_step(weights, first, token, fused_norm=fused_norm), token,
                               path, rng)
    assert failures(checks) == []
    # every kernel of every layer was checked, and the head
    names = {c.name for c in checks}
    for layer in range(weights.config.num_layers):
        for stage in ("qkv", "attention", "o_proj", "gate_up", "down"):  # decode's qkv includes RoPE and the KV write
            assert f"layer {layer} {stage}" in names
    assert {"embedding", "lm_head", "sampler"} <= names
    assert ("layer 0 input norm" in names) == (not fused_norm)


def negated_scales(weights, tensor: str) -> InMemoryWeights:
    tensors = dict(weights.tensors)
    tensors[tensor + SCALES] = -tensors[tensor + SCALES]
    return dataclasses.replace(weights, tensors=tensors)


@pytest.mark.parametrize("module, stage", [("self_attn.q_proj", "qkv"), ("self_attn.v_proj", "qkv"),
                                           ("self_attn.o_proj", "o_proj"), ("mlp.up_proj", "gate_up"),
                                           ("mlp.down_proj", "down")])
def test_a_sign_error_in_one_layers_weights_is_named(weights, module, stage):
    """The GPU computed the last layer with negated scales of one linear (a sign bug in one kernel)."""
    rng = np.random.default_rng()
    first, token = (int(t) for t in rng.integers(0, weights.config.vocab_size, 2))
    last = weights.config.num_layers - 1
    broken = negated_scales(weights, layer_prefix(last) + module + ".weight")
    checks = check_probed_step(weights, emulate_probed_step(broken, first, token), token, "prmt", rng)
    assert failures(checks)[0] == f"layer {last} {stage}"


def test_rope_at_the_wrong_angle_fails(weights):
    rng = np.random.default_rng()
    checks = check_probed_step(weights, emulate_probed_step(weights, 3, 5, rope_position=2), 5, "prmt", rng)
    assert {f"layer {i} qkv" for i in range(weights.config.num_layers)} <= set(failures(checks))


def test_attention_that_skips_a_key_fails(weights):
    rng = np.random.default_rng()
    checks = check_probed_step(weights, emulate_probed_step(weights, 3, 5, attend_all=False), 5, "prmt", rng)
    assert {f"layer {i} attention" for i in range(weights.config.num_layers)} <= set(failures(checks))


def test_wrong_embedding_row_and_wrong_token_fail(weights):
    rng = np.random.default_rng()
    captured = emulate_probed_step(weights, 3, 5)
    assert "embedding" in failures(check_probed_step(weights, captured, 6, "prmt", rng))
    tokens = captured[None, "sampler"]["tokens"]
    tokens[2] = (tokens[2] + 1) % weights.config.vocab_size
    assert failures(check_probed_step(weights, captured, 5, "prmt", rng)) == ["sampler"]


def test_a_wrong_rmsnorm_output_fails():
    weights = tiny_weights(True, seed=3)
    rng = np.random.default_rng()
    captured = emulate_probed_step(weights, 3, 5, fused_norm=False)
    captured[1, "post_attention_norm"]["xn"] = f16(captured[1, "post_attention_norm"]["xn"] * 1.01)
    assert "layer 1 post attention norm" in failures(check_probed_step(weights, captured, 5, "prmt", rng))


def random_prompt(weights, rng, length=24):
    return [int(t) for t in rng.integers(0, weights.config.vocab_size, length)]


@pytest.mark.parametrize("path", ["auto", "prmt", "dp4a"])
def test_a_correct_prefill_chunk_passes(weights, path):
    rng = np.random.default_rng()
    prompt = random_prompt(weights, rng)
    checks = check_probed_prefill(weights, emulate_probed_prefill(weights, prompt), prompt, path, rng)
    assert failures(checks) == []
    names = {c.name for c in checks}
    for layer in range(weights.config.num_layers):
        for stage in ("input norm", "qkv", "rope_kv_write", "attention", "o_proj", "post attention norm", "gate_up",
                      "down"):
            assert f"layer {layer} {stage}" in names
    assert {"page_alloc", "embedding", "last_row", "lm_head", "sampler"} <= names


@pytest.mark.parametrize("module, stage", [("self_attn.k_proj", "qkv"), ("self_attn.o_proj", "o_proj"),
                                           ("mlp.gate_proj", "gate_up"), ("mlp.down_proj", "down")])
def test_a_sign_error_in_the_prefill_gemms_is_named(weights, module, stage):
    rng = np.random.default_rng()
    prompt = random_prompt(weights, rng)
    broken = negated_scales(weights, layer_prefix(0) + module + ".weight")
    checks = check_probed_prefill(weights, emulate_probed_prefill(broken, prompt), prompt, "prmt", rng)
    assert failures(checks)[0] == f"layer 0 {stage}"


def test_prefill_attention_that_skips_a_key_and_a_wrong_hand_over_fail(weights):
    rng = np.random.default_rng()
    prompt = random_prompt(weights, rng)
    checks = check_probed_prefill(weights, emulate_probed_prefill(weights, prompt, attend_all=False), prompt,
                                  "prmt", rng)
    assert {f"layer {i} attention" for i in range(weights.config.num_layers)} <= set(failures(checks))
    checks = check_probed_prefill(weights, emulate_probed_prefill(weights, prompt, last_row=-2), prompt, "prmt", rng)
    assert failures(checks)[0] == "last_row"


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    from pynanoqwen.config import PRESETS
    from pynanoqwen.fileformat import NanoQwenFile
    from pynanoqwen.synthetic import write_synthetic_nanoqwen

    path = tmp_path_factory.mktemp("selfcheck") / "tiny.nanoqwen"
    write_synthetic_nanoqwen(path, PRESETS["tiny"], seed=11, workers=1)
    with NanoQwenFile(path) as f:
        weights = InMemoryWeights(f.config, f.lm_head_int4, {name: np.array(f.tensor(name)) for name in f.names})
    return path, weights


def test_require_self_check_passes_a_correct_engine_and_stops_a_broken_one(tiny_file):
    from pynanoqwen.errors import NanoQwenError
    from pynanoqwen.selfcheck import require_self_check

    path, weights = tiny_file
    assert require_self_check(EmulatedEngine(weights), path).startswith("self-check passed")
    broken = negated_scales(weights, layer_prefix(1) + "mlp.gate_proj.weight")
    with pytest.raises(NanoQwenError, match="self-check FAILED .*layer 1 gate_up.*--skip-selfcheck"):
        require_self_check(EmulatedEngine(broken), path)


def test_a_bucket_whose_kernels_differ_is_named(tiny_file):
    """The chunk again in a bucket of other GEMM tiles: where rows sum alike, any output that is
    not the float64-checked bucket's bits fails, naming the bucket and the first output; where
    they do not, that bucket is checked against float64 in full."""
    from pynanoqwen.selfcheck import run_self_check

    _, weights = tiny_file
    result = run_self_check(EmulatedEngine(weights), weights)
    assert result.buckets == (32, 1024) and not result.failed
    assert "prefill in 1024 rows" in {c.name for c in result.checks}
    assert "again in 1024 rows" in result.summary()
    broken = {1024: negated_scales(weights, layer_prefix(1) + "mlp.up_proj.weight")}
    result = run_self_check(EmulatedEngine(weights, broken), weights)
    assert failures(result.checks) == ["prefill in 1024 rows"]
    assert "first: layer 1 gate_up" in result.failed[0].detail
    engine = EmulatedEngine(weights, broken)
    engine.rows_sum_alike = False
    result = run_self_check(engine, weights)
    assert failures(result.checks)[0] == "prefill in 1024 rows layer 1 gate_up"
    assert not [name for name in failures(result.checks) if not name.startswith("prefill in 1024 rows")]


def test_the_probed_buckets_launch_every_gemm_kernel_of_every_bucket():
    """covering_rows, which probe_buckets takes: the chosen buckets' (linear, tile, K chunks)
    include every bucket's, and each chosen bucket adds one; at 7B the long-prompt tiles (TMA-fed
    from 512 rows for gate_up, 1024 for qkv, o_proj and down_proj) are among them."""
    from pynanoqwen.config import PRESETS
    from pynanoqwen.engine.memory import PREFILL_BUCKETS
    from pynanoqwen.kernels.gemm_int4_tiles import TMA_T256, covering_rows, default_tiles_for, k_chunks

    def kernels(linears, m):
        return {(name, tiles, k_chunks(k, tiles, epilogue))
                for name, n, k, epilogue in linears for tiles in [default_tiles_for(m, n, k, epilogue)]}

    for preset in ("0.5b", "7b", "32b"):
        linears = PRESETS[preset].engine_linears
        ms = [m for m in PREFILL_BUCKETS if m >= 24]
        chosen = covering_rows(linears, ms)
        assert chosen == sorted(chosen) and chosen[0] == ms[0]
        union = set().union(*(kernels(linears, m) for m in chosen))
        assert all(kernels(linears, m) <= union for m in ms)
        for i, m in enumerate(chosen[1:], 1):  # none is there for nothing
            assert kernels(linears, m) - set().union(*(kernels(linears, c) for c in chosen[:i]))
    linears = PRESETS["7b"].engine_linears
    chosen = covering_rows(linears, [m for m in PREFILL_BUCKETS if m >= 24])
    assert {name for m in chosen for name, tiles, _ in kernels(linears, m) if tiles == TMA_T256} == \
        {"qkv", "o_proj", "gate_up", "down_proj"}
    assert covering_rows(linears, [32, 64]) == [32]


def test_generate_runs_the_self_check_on_the_gpu_only_unless_skipped(tiny_file, monkeypatch):
    """generate.run: device cuda -> self-check before the first token (its line on stderr), and a
    failing one stops it; --skip-selfcheck and device cpu do not run it."""
    from pynanoqwen import generate
    from pynanoqwen.errors import NanoQwenError
    from pynanoqwen.generate import GenerateOptions

    path, weights = tiny_file

    class Fake(EmulatedEngine):
        name, max_context = "fake cuda", 64

        def generate(self, prompt_ids, params, max_new_tokens, stop_ids, lookup=None):
            yield from [70] * max_new_tokens  # not 0..8: those are special and end generation

    backends = {"good": Fake(weights), "broken": Fake(negated_scales(weights, layer_prefix(0) + "mlp.down_proj.weight"))}
    for which in ("good", "broken"):
        monkeypatch.setattr(generate, "load_backend", lambda *args, b=backends[which]: b)
        for device, check in (("cuda", True), ("cuda", False), ("cpu", True)):
            status = []
            options = GenerateOptions(prompt="def f():", model=str(path), device=device, max_new_tokens=3,
                                      self_check=check)
            runs_check = device == "cuda" and check
            if which == "broken" and runs_check:
                with pytest.raises(NanoQwenError, match="layer 0 down"):
                    generate.run(options, on_text=lambda text: None, on_status=status.append)
                continue
            result = generate.run(options, on_text=lambda text: None, on_status=status.append)
            assert result.tokens == [70, 70, 70]
            assert any(line.startswith("self-check passed") for line in status) == runs_check


def test_cli_takes_skip_selfcheck(tiny_file):
    from click.testing import CliRunner

    from pynanoqwen.cli import main

    path, _ = tiny_file
    result = CliRunner().invoke(main, ["generate", "--model", str(path), "--device", "cpu", "--max-new-tokens", "2",
                                       "--skip-selfcheck", "def f():"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("k, runs", [(256, "fixed16"), (8192, "prmt")])
def test_the_gemv_oracle_of_auto_is_that_of_the_path_the_linear_runs(k, runs):
    """The self-check passes the engine's --gemv (auto) to oracles.gemv_oracle: its bound must be
    that of the kernel a linear of this K runs (kernels.kernel_path), which differs between paths."""
    from pynanoqwen.oracles import gemv_oracle
    from pynanoqwen.quant import quantize_int4

    rng = np.random.default_rng()
    qweight, scales = quantize_int4(rng.standard_normal((4, k)).astype(np.float32))
    x = rng.standard_normal(k).astype(np.float16)
    bounds = {path: gemv_oracle(qweight, scales, x, path)[1] for path in ("auto", "prmt", "fixed16")}
    other = "prmt" if runs == "fixed16" else "fixed16"
    assert np.array_equal(bounds["auto"], bounds[runs]) and not np.array_equal(bounds["auto"], bounds[other])
