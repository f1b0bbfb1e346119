"""HF checkpoint -> .nanoqwen (convert.py), end to end on the tiny preset.

Source weights are read back with the safetensors library (torch), not with the converter's reader.
Every INT4 tensor must dequantize to within half a scale step of the source, with the scale the
group's max|w|/7 rounded to FP16; every FP16 tensor must equal the source rounded to FP16. Every
error must name its culprit, exit 1 through the CLI with one `error:` line, and leave no file.
"""

import dataclasses
import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from pynanoqwen import convert as convert_module
from pynanoqwen.checkpoint import QWEN25_CHAT_TEMPLATE, make_checkpoint
from pynanoqwen.cli import main as cli
from pynanoqwen.config import GROUP_SIZE, PRESETS
from pynanoqwen.convert import convert_checkpoint
from pynanoqwen.errors import CheckpointError, ConfigError
from pynanoqwen.fileformat import NanoQwenFile
from pynanoqwen.quant import QMAX, dequantize_int4, unpack_valueshuffle
from pynanoqwen.tensors import QWEIGHT, SCALES, hf_tensors, is_quantized, stored_tensors

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

TINY = PRESETS["tiny"]
TIED = dataclasses.replace(TINY, tie_word_embeddings=True)
SMALL_SHARDS = 700_000  # bytes: splits tiny (2.4M parameters) into several shards


def source_weights(hf_dir) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint as float32, read by the safetensors library."""
    weights = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        weights.update({name: t.float().numpy() for name, t in safetensors_torch.load_file(path).items()})
    return weights


def check_conversion(hf_dir, out, lm_head_int4: bool) -> None:
    cfg = json.loads((hf_dir / "config.json").read_text())
    src = source_weights(hf_dir)
    with NanoQwenFile(out) as f:
        assert f.lm_head_int4 == lm_head_int4
        assert f.config.tie_word_embeddings == cfg["tie_word_embeddings"]
        assert (f.config.vocab_size, f.config.eos_token_id) == (cfg["vocab_size"], cfg["eos_token_id"])
        assert list(f.names) == list(stored_tensors(f.config, lm_head_int4))
        assert bytes(f.tokenizer_json) == (hf_dir / "tokenizer.json").read_bytes()
        assert f.chat_template == QWEN25_CHAT_TEMPLATE
        for name in stored_tensors(f.config, lm_head_int4):
            if name.endswith(SCALES):
                continue
            hf_name = name.removesuffix(QWEIGHT)
            w = src["model.embed_tokens.weight" if hf_name not in src else hf_name]  # tied INT4 lm_head
            if is_quantized(hf_name, lm_head_int4):
                check_int4(hf_name, w, f.tensor(hf_name + QWEIGHT), f.tensor(hf_name + SCALES))
            else:
                np.testing.assert_array_equal(f.tensor(name), w.astype(np.float16), err_msg=name)


def check_int4(name, w, qweight, scales) -> None:
    n, k = w.shape
    groups = w.astype(np.float64).reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    exact_scale = np.abs(groups).max(axis=2) / QMAX
    s = scales.astype(np.float64)
    # The stored scale is max|w|/7 rounded to FP16 (through float32: within one FP16 ulp).
    assert np.all(np.abs(s - exact_scale) <= np.spacing(scales).astype(np.float64)), name
    # Each weight is the nearest code times the stored scale: |w - w'| <= s/2, plus the float32
    # rounding of w/s (relative 2^-24 of |w/s| <= 7.5) that picks the code.
    err = np.abs(groups - dequantize_int4(qweight, scales, np.float64).reshape(groups.shape))
    assert np.all(err <= s[:, :, None] * (0.5 + 8 * 2.0**-24)), name
    codes = unpack_valueshuffle(qweight).astype(np.int64).reshape(groups.shape) - 8
    assert np.all(np.abs(codes) <= QMAX) and np.all(np.abs(codes).max(axis=2) == QMAX), name


@pytest.mark.parametrize("model, dtype, shard_bytes, lm_head_int4", [
    (TINY, "bf16", None, True),
    (TINY, "bf16", None, False),
    (TINY, "fp16", SMALL_SHARDS, True),
    (TINY, "fp32", SMALL_SHARDS, False),
    (TIED, "bf16", SMALL_SHARDS, True),
    (TIED, "fp16", None, False),
    (TIED, "fp32", None, True),
], ids=["bf16-int4head", "bf16-fp16head", "fp16-sharded", "fp32-sharded-fp16head", "tied-bf16-sharded",
        "tied-fp16-fp16head", "tied-fp32-int4head"])
def test_convert_round_trip(tmp_path, model, dtype, shard_bytes, lm_head_int4):
    hf_dir = tmp_path / "hf"
    make_checkpoint(model, hf_dir, seed=7, dtype=dtype, **({"shard_bytes": shard_bytes} if shard_bytes else {}))
    assert (hf_dir / "model.safetensors.index.json").exists() == bool(shard_bytes)
    out = tmp_path / "tiny.nanoqwen"
    report = convert_checkpoint(hf_dir, out, lm_head_int4=lm_head_int4, progress=False)
    check_conversion(hf_dir, out, lm_head_int4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "tiny.nanoqwen"]  # no temp file left
    assert report.output_bytes == out.stat().st_size
    tied_head = model.tie_word_embeddings and lm_head_int4
    assert report.tensors == len(hf_tensors(model)) + tied_head
    itemsize = 4 if dtype == "fp32" else 2
    embed = model.vocab_size * model.hidden_size
    values = sum(np.prod(shape) for shape in hf_tensors(model).values()) + tied_head * embed
    assert report.input_bytes == values * itemsize
    assert report.peak_rss_bytes > 0 and 0 <= report.rss_growth_bytes <= report.peak_rss_bytes


def test_block_boundaries_do_not_change_the_result(tmp_path, monkeypatch):
    """Blocks of 3000 values (11 rows of 256, 4 of 640) give the same file as whole tensors."""
    make_checkpoint(TINY, tmp_path / "hf", seed=2)
    convert_checkpoint(tmp_path / "hf", tmp_path / "whole.nanoqwen", progress=False)
    monkeypatch.setattr(convert_module, "BLOCK_ELEMENTS", 3000)
    convert_checkpoint(tmp_path / "hf", tmp_path / "blocks.nanoqwen", progress=False)
    assert (tmp_path / "whole.nanoqwen").read_bytes() == (tmp_path / "blocks.nanoqwen").read_bytes()


def test_checkpoint_saved_by_transformers(tmp_path):
    """A checkpoint written by save_pretrained (the safetensors library, chat_template.jinja or not)."""
    transformers = pytest.importorskip("transformers")
    make_checkpoint(TINY, tmp_path / "ours", seed=4)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "hf")
    transformers.AutoTokenizer.from_pretrained(tmp_path / "ours").save_pretrained(tmp_path / "hf")
    out = tmp_path / "hf.nanoqwen"
    convert_checkpoint(tmp_path / "hf", out, progress=False)
    with NanoQwenFile(out) as f:
        assert f.chat_template == QWEN25_CHAT_TEMPLATE
        assert bytes(f.tokenizer_json) == (tmp_path / "hf" / "tokenizer.json").read_bytes()
    check_conversion_weights_only(tmp_path / "hf", out)


def check_conversion_weights_only(hf_dir, out) -> None:
    src = source_weights(hf_dir)
    with NanoQwenFile(out) as f:
        for hf_name, w in src.items():
            if is_quantized(hf_name, True):
                check_int4(hf_name, w, f.tensor(hf_name + QWEIGHT), f.tensor(hf_name + SCALES))
            else:
                np.testing.assert_array_equal(f.tensor(hf_name), w.astype(np.float16), err_msg=hf_name)


def test_progress_and_summary_go_to_stderr(tmp_path, capfd):
    make_checkpoint(TINY, tmp_path / "hf", seed=3)
    convert_checkpoint(tmp_path / "hf", tmp_path / "m.nanoqwen")
    out, err = capfd.readouterr()
    assert out == ""
    assert "convert" in err and "tensor 27/27" in err  # the tqdm bar
    summary = err.strip().splitlines()[-1]
    assert summary.startswith("converted 27 tensors: read 4.9 MB, wrote ") and "peak RSS" in summary


# ---- errors: the culprit is named, the CLI exits 1 with one line, and no file is left behind ----

def _edit_weights(edit):
    """Apply edit(dict of float32 arrays) to model.safetensors, rewritten by the safetensors library."""
    def mutate(hf_dir):
        path = hf_dir / "model.safetensors"
        tensors = safetensors_numpy.load_file(path)
        edit(tensors)
        safetensors_numpy.save_file(tensors, path, metadata={"format": "pt"})
    return mutate


def _edit_config(**changes):
    def mutate(hf_dir):
        path = hf_dir / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return mutate


def _set(name, index, value):
    def edit(tensors):
        tensors[name][index] = value
    return _edit_weights(edit)


def _truncate(hf_dir):
    path = hf_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])


def _corrupt_header(hf_dir):
    path = hf_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:40] = b"\xff" * 32
    path.write_bytes(bytes(data))


def _add_lm_head_to_tied(hf_dir):
    _edit_config(tie_word_embeddings=True)(hf_dir)  # the checkpoint still holds lm_head.weight


GATE, NORM = "model.layers.0.mlp.gate_proj.weight", "model.norm.weight"
ERROR_CASES = {
    "missing-tensor": (_edit_weights(lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
                       CheckpointError, "tensor model.layers.1.mlp.up_proj.weight is missing"),
    "extra-tensor": (_edit_weights(lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq":
                                                       np.ones(32, np.float32)})),
                     CheckpointError, "unexpected tensor model.layers.0.self_attn.rotary_emb.inv_freq"),
    "wrong-shape": (_edit_weights(lambda t: t.update({GATE: np.ascontiguousarray(t[GATE].T)})),
                    CheckpointError, f"tensor {GATE} in model.safetensors has shape [256, 640]"),
    "nan": (_set("model.layers.1.mlp.down_proj.weight", (200, 5), np.nan), CheckpointError,
            "tensor model.layers.1.mlp.down_proj.weight in model.safetensors has NaN values (row 200)"),
    "inf": (_set("model.norm.weight", 7, -np.inf),
            CheckpointError, "tensor model.norm.weight in model.safetensors has Inf values"),
    "beyond-fp16": (_set("model.layers.0.self_attn.q_proj.bias", 3, 1e6), CheckpointError,
                    "tensor model.layers.0.self_attn.q_proj.bias has a value of magnitude 1e+06"),
    "unsupported-dtype": (_edit_weights(lambda t: t.update({NORM: t[NORM].astype(np.float64)})),
                          CheckpointError, "tensor model.norm.weight is F64"),
    "tied-with-lm-head": (_add_lm_head_to_tied, CheckpointError, "unexpected tensor lm_head.weight"),
    "no-config": (lambda d: (d / "config.json").unlink(), ConfigError, "config.json not found"),
    "bad-model-type": (_edit_config(model_type="llama"), ConfigError, "model_type 'llama' is not supported"),
    "rope-scaling": (_edit_config(rope_scaling={"type": "yarn", "factor": 4.0}), ConfigError, "rope_scaling"),
    "no-tokenizer": (lambda d: (d / "tokenizer.json").unlink(), CheckpointError, "tokenizer.json not found"),
    "corrupt-tokenizer": (lambda d: (d / "tokenizer.json").write_text('{"model": 1'), CheckpointError,
                          "tokenizer.json cannot be loaded"),
    "no-weights": (lambda d: (d / "model.safetensors").unlink(), CheckpointError,
                   "has neither model.safetensors nor model.safetensors.index.json"),
    "truncated": (_truncate, CheckpointError, "model.safetensors is truncated: tensor lm_head.weight ends at"),
    "corrupt-header": (_corrupt_header, CheckpointError, "model.safetensors has a corrupt safetensors header"),
}


@pytest.fixture(scope="module")
def fp32_checkpoint(tmp_path_factory):
    hf_dir = tmp_path_factory.mktemp("fp32") / "hf"
    make_checkpoint(TINY, hf_dir, seed=9, dtype="fp32")
    return hf_dir


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory):
    hf_dir = tmp_path_factory.mktemp("sharded") / "hf"
    make_checkpoint(TINY, hf_dir, seed=9, shard_bytes=SMALL_SHARDS)
    return hf_dir


def assert_fails_cleanly(hf_dir, work_dir, error_type, message):
    previous = work_dir / "previous.nanoqwen"
    previous.write_bytes(b"an earlier conversion")
    before = sorted(p.name for p in work_dir.iterdir())
    with pytest.raises(error_type) as raised:
        convert_checkpoint(hf_dir, work_dir / "new.nanoqwen", progress=False)
    assert message in str(raised.value) and "\n" not in str(raised.value)
    with pytest.raises(error_type):
        convert_checkpoint(hf_dir, previous, progress=False)
    result = CliRunner().invoke(cli, ["convert", str(hf_dir), str(work_dir / "cli.nanoqwen")])
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1] == f"error: {raised.value}"  # after the progress bar, if it started
    assert "Traceback" not in result.output
    assert sorted(p.name for p in work_dir.iterdir()) == before  # nothing new, no temp file
    assert previous.read_bytes() == b"an earlier conversion"


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_error_is_named_and_leaves_no_file(tmp_path, fp32_checkpoint, case):
    mutate, error_type, message = ERROR_CASES[case]
    hf_dir = tmp_path / "hf"
    shutil.copytree(fp32_checkpoint, hf_dir)
    mutate(hf_dir)
    work_dir = tmp_path / "out"
    work_dir.mkdir()
    assert_fails_cleanly(hf_dir, work_dir, error_type, message)


def _unmap_tensor(hf_dir):
    path = hf_dir / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["weight_map"]["model.norm.weight"] = index["weight_map"]["model.embed_tokens.weight"]
    path.write_text(json.dumps(index))


@pytest.mark.parametrize("mutate, message", [
    (lambda d: (d / "model-00002-of-00007.safetensors").unlink(),
     "model-00002-of-00007.safetensors is listed in model.safetensors.index.json but does not exist"),
    (_unmap_tensor, "holds model.norm.weight, which model.safetensors.index.json maps to "
                    "'model-00001-of-00007.safetensors'"),
], ids=["missing-shard", "index-disagrees"])
def test_sharded_errors(tmp_path, sharded_checkpoint, mutate, message):
    hf_dir = tmp_path / "hf"
    shutil.copytree(sharded_checkpoint, hf_dir)
    assert len(list(hf_dir.glob("model-*-of-00007.safetensors"))) == 7
    mutate(hf_dir)
    work_dir = tmp_path / "out"
    work_dir.mkdir()
    assert_fails_cleanly(hf_dir, work_dir, CheckpointError, message)


def test_interrupt_removes_the_partial_file(tmp_path, fp32_checkpoint, monkeypatch):
    """Ctrl-C in the middle (here: during the third quantization) propagates and leaves nothing."""
    calls = []
    quantize_int4 = convert_module.quantize_int4

    def interrupted(w):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return quantize_int4(w)

    monkeypatch.setattr(convert_module, "quantize_int4", interrupted)
    previous = tmp_path / "model.nanoqwen"
    previous.write_bytes(b"an earlier conversion")
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(fp32_checkpoint, previous, progress=False)
    assert len(calls) == 3
    assert [p.name for p in tmp_path.iterdir()] == ["model.nanoqwen"]
    assert previous.read_bytes() == b"an earlier conversion"
