"""The self-check's numpy side (pynanoqwen/selfcheck.py) on a stand-in for the GPU: a float32/FP16
numpy emulation of CudaBackend.probed_step, written here from the engine's documented buffers.

It must pass what a correct engine produces, and fail, naming the kernel and layer, on each kind
of wrong result a broken kernel gives: a sign error in one layer's weights, RoPE at the wrong
angle, attention that ignores a key, a wrong embedding row, a wrong greedy token, a wrong norm.
"""

import dataclasses

import numpy as np
import pytest

from pynanoqwen.kernels.page_alloc import PAGE_SIZE
from pynanoqwen.quant import dequantize_int4
from pynanoqwen.reference import InMemoryWeights, rope_tables
from pynanoqwen.selfcheck import POSITION, check_probed_step
from pynanoqwen.synthetic import SyntheticWeights
from pynanoqwen.tensors import QWEIGHT, SCALES, layer_prefix


def tiny_weights(lm_head_int4: bool, seed: int) -> InMemoryWeights:
    source = SyntheticWeights("tiny", seed=seed, lm_head_int4=lm_head_int4, workers=1)
    return InMemoryWeights(source.config, lm_head_int4, {name: source.tensor(name) for name in source.names})


def f16(x):
    return np.asarray(x, np.float32).astype(np.float16)


def emulate_probed_step(weights, first: int, token: int, *, fused_norm: bool = True, rope_position: int = POSITION,
                        attend_all: bool = True) -> dict:
    """What CudaBackend.probed_step returns, computed in numpy with the engine's buffer types."""
    cfg = weights.config
    heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def linear(name, x):
        w = dequantize_int4(weights.tensor(name + QWEIGHT), weights.tensor(name + SCALES), np.float64)
        return w @ np.asarray(x, np.float64)

    def norm(h, name):
        h64 = h.astype(np.float64)
        return f16(h64 / np.sqrt(np.mean(h64 * h64) + cfg.rms_norm_eps) * weights.tensor(name).astype(np.float64))

    pages = np.zeros((cfg.num_layers, 2, kv_heads, PAGE_SIZE, hd), np.float16)
    captured = {}
    for position, tok in enumerate((first, token)):
        keep = position == POSITION
        h = weights.tensor("model.embed_tokens.weight")[tok].astype(np.float32)
        if keep:
            captured[None, "embedding"] = {"h": h.copy()}
        for layer in range(cfg.num_layers):
            p = layer_prefix(layer)
            stages = {}
            xn = norm(h, p + "input_layernorm.weight")
            stages["input_norm"] = {"xn": xn}
            qkv = np.concatenate([linear(f"{p}self_attn.{m}_proj.weight", xn)
                                  + weights.tensor(f"{p}self_attn.{m}_proj.bias") for m in "qkv"]).astype(np.float32)
            stages["qkv"] = {"qkv": qkv}
            cos, sin = (t[0, :hd // 2] for t in rope_tables(hd, cfg.rope_theta, [rope_position if keep else 0]))
            parts = qkv.reshape(heads + 2 * kv_heads, hd)
            x1, x2 = parts[:, :hd // 2], parts[:, hd // 2:]
            rotated = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], 1).astype(np.float32)
            pages[layer, 0, :, position] = f16(rotated[heads:heads + kv_heads])
            pages[layer, 1, :, position] = f16(parts[heads + kv_heads:])
            stages["rope_kv_write"] = {"q": rotated[:heads].copy(), "k_page": pages[layer, 0].copy(),
                                       "v_page": pages[layer, 1].copy()}
            first_key = 0 if attend_all or not keep else position
            keys = pages[layer, 0, :, first_key:position + 1].astype(np.float64)
            values = pages[layer, 1, :, first_key:position + 1].astype(np.float64)
            q = rotated[:heads].astype(np.float64).reshape(kv_heads, heads // kv_heads, hd)
            scores = np.einsum("kgd,kcd->kgc", q, keys) / np.sqrt(hd)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            attn = f16((np.einsum("kgc,kcd->kgd", probs, values) / probs.sum(-1)[..., None]).reshape(-1))
            stages["attention"] = {"attn": attn}
            h = (h + linear(p + "self_attn.o_proj.weight", attn)).astype(np.float32)
            stages["o_proj"] = {"h": h.copy()}
            xn = norm(h, p + "post_attention_layernorm.weight")
            stages["post_attention_norm"] = {"xn": xn}
            g, u = linear(p + "mlp.gate_proj.weight", xn), linear(p + "mlp.up_proj.weight", xn)
            mlp = f16(g / (1 + np.exp(-g)) * u)
            stages["gate_up"] = {"mlp": mlp}
            h = (h + linear(p + "mlp.down_proj.weight", mlp)).astype(np.float32)
            stages["down"] = {"h": h.copy()}
            if keep:
                for stage, buffers in stages.items():
                    if fused_norm and stage.endswith("norm"):
                        continue
                    captured[layer, stage] = buffers
    xn = norm(h, "model.norm.weight")
    if weights.lm_head_int4:
        logits = linear("lm_head.weight", xn)
    else:
        table = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        logits = weights.tensor(table).astype(np.float64) @ xn.astype(np.float64)
    if not fused_norm or not weights.lm_head_int4:
        captured[None, "final_norm"] = {"xn": xn}
    captured[None, "lm_head"] = {"logits": logits.astype(np.float32)}
    captured[None, "sampler"] = {"tokens": np.array([first, token, int(np.argmax(logits))], np.int32)}
    return captured


def failures(checks):
    return [c.name for c in checks if c.status == "FAIL"]


@pytest.fixture(scope="module", params=[True, False], ids=["int4 lm_head", "fp16 lm_head"])
def weights(request):
    return tiny_weights(request.param, seed=int(np.random.default_rng().integers(1000)))


@pytest.mark.parametrize("path", ["prmt", "dp4a"])
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
        for stage in ("qkv", "rope_kv_write", "attention", "o_proj", "gate_up", "down"):
            assert f"layer {layer} {stage}" in names
    assert {"embedding", "lm_head", "sampler"} <= names
    assert (f"layer 0 input norm" in names) == (not fused_norm)


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
    assert {f"layer {i} rope_kv_write" for i in range(weights.config.num_layers)} <= set(failures(checks))


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


class EmulatedBackend:
    """A stand-in for CudaBackend: probed_step from the emulation, on possibly broken weights."""

    gemv = "prmt"

    def __init__(self, weights):
        self.weights = weights

    def probed_step(self, first, token):
        return emulate_probed_step(self.weights, first, token)


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
    assert require_self_check(EmulatedBackend(weights), path).startswith("self-check passed")
    broken = negated_scales(weights, layer_prefix(1) + "mlp.gate_proj.weight")
    with pytest.raises(NanoQwenError, match="self-check FAILED .*layer 1 gate_up.*--skip-selfcheck"):
        require_self_check(EmulatedBackend(broken), path)


def test_generate_runs_the_self_check_on_the_gpu_only_unless_skipped(tiny_file, monkeypatch):
    """generate.run: device cuda -> self-check before the first token (its line on stderr), and a
    failing one stops it; --skip-selfcheck and device cpu do not run it."""
    from pynanoqwen import generate
    from pynanoqwen.errors import NanoQwenError
    from pynanoqwen.generate import GenerateOptions

    path, weights = tiny_file

    class Fake(EmulatedBackend):
        name, max_context = "fake cuda", 64

        def generate(self, prompt_ids, params, max_new_tokens, stop_ids):
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
