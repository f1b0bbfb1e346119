"""HF checkpoint -> .nanoqwen (convert.py), end to end on the tiny preset.

Source weights are read back with the safetensors library (torch), not with the converter's reader.
Every INT4 tensor must dequantize to within half a scale step of the source, with the scale the
group's max|w|/7 rounded to FP16; every FP16 tensor must equal the source rounded to FP16. Every
error must name its culprit, exit 1 through the CLI with one `error:` line, and leave no file.
"""

import dataclasses
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys

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


def _edit_json(name, **changes):
    def mutate(hf_dir):
        path = hf_dir / name
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return mutate


def _edit_header_entry(name, **changes):
    """Change fields of one tensor's entry in model.safetensors' header, its data left as it is
    (data_offsets count from the end of the header, so the header may change length)."""
    def mutate(hf_dir):
        path = hf_dir / "model.safetensors"
        data = path.read_bytes()
        length = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + length])
        header[name].update(changes)
        text = json.dumps(header).encode()
        path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length:])
    return mutate


def _long_integer(mutate, digits: int):
    """`mutate` with every "LONG" string it writes made an integer literal of `digits` digits."""
    def long_mutate(hf_dir):
        mutate(hf_dir)
        for path in hf_dir.iterdir():
            data = path.read_bytes()
            if b'"LONG"' in data:
                text = data.replace(b'"LONG"', b"1" * digits)
                if path.suffix == ".safetensors":  # the header grew: its length comes first
                    length = int.from_bytes(data[:8], "little") + len(text) - len(data)
                    text = length.to_bytes(8, "little") + text[8:]
                path.write_bytes(text)
    return long_mutate


def _nested_header(hf_dir):
    text = b"[" * 100_000
    (hf_dir / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text)


def _replace_with_directory(name):
    def mutate(hf_dir):
        (hf_dir / name).unlink()
        (hf_dir / name).mkdir()
    return mutate


def _jinja_template(text: bytes):
    """A template in chat_template.jinja only, as newer transformers save it."""
    def mutate(hf_dir):
        config = json.loads((hf_dir / "tokenizer_config.json").read_text())
        del config["chat_template"]
        (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
        (hf_dir / "chat_template.jinja").write_bytes(text)
    return mutate


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
    "zero-heads": (_edit_config(num_attention_heads=0), ConfigError,
                   "malformed num_attention_heads: expected a positive integer, got 0"),
    "fractional-size": (_edit_config(hidden_size=256.7), ConfigError, "malformed hidden_size"),
    "too-many-layers": (_edit_config(num_hidden_layers=10**9), CheckpointError,
                        "num_hidden_layers=1000000000, but the checkpoint holds only 27 tensors"),
    "eos-outside-vocab": (_edit_config(eos_token_id=2**32 - 1), ConfigError,
                          "eos_token_id 4294967295 is not a token id of the 2048-token vocabulary"),
    "config-is-a-directory": (_replace_with_directory("config.json"), ConfigError, "config.json is a directory"),
    "tokenizer-is-a-directory": (_replace_with_directory("tokenizer.json"), CheckpointError,
                                 "cannot read"),
    "template-does-not-compile": (_edit_json("tokenizer_config.json", chat_template="{% for m in messages %}"),
                                  CheckpointError, "tokenizer_config.json: the chat template does not compile: "),
    "jinja-template-does-not-compile": (_jinja_template(b"{{ messages[0]['content'] }\n"), CheckpointError,
                                        "chat_template.jinja: the chat template does not compile: "),
    "jinja-template-not-utf8": (_jinja_template(b"\xff{{ x }}"), CheckpointError,
                                "chat_template.jinja is not UTF-8 text"),
    "tokenizer-config-not-an-object": (lambda d: (d / "tokenizer_config.json").write_text("[1, 2]"),
                                       CheckpointError, "tokenizer_config.json is not a JSON object"),
    "generation-eos-outside-vocab": (_edit_json("generation_config.json", eos_token_id=[2, 5000]), CheckpointError,
                                     "end-of-generation id 5000 (config.json or generation_config.json) is not"),
    "generation-eos-malformed": (_edit_json("generation_config.json", eos_token_id="2"), CheckpointError,
                                 "malformed eos_token_id in generation_config.json"),
    "generation-eos-too-many": (_edit_json("generation_config.json", eos_token_id=list(range(10, 20))),
                                CheckpointError, "name 10 end-of-generation ids besides eos_token_id"),
    "generation-config-broken": (lambda d: (d / "generation_config.json").write_text("{"), CheckpointError,
                                 "generation_config.json is not valid JSON"),
    # These three were a TypeError or RecursionError traceback.
    "dtype-not-a-string": (_edit_header_entry(NORM, dtype=["F32"]), CheckpointError,
                           "model.safetensors: tensor model.norm.weight has a malformed header entry"),
    "header-nested-too-deep": (_nested_header, CheckpointError, "model.safetensors has a corrupt safetensors header"),
    "config-nested-too-deep": (lambda d: (d / "config.json").write_text("[" * 100_000), ConfigError,
                               "config.json is not valid JSON"),
    # These were a ValueError or OverflowError traceback: Python reads no integer of more than 4300
    # digits, and no double holds one of 400.
    "config-integer-too-long": (_long_integer(_edit_config(max_window_layers="LONG"), 5000), ConfigError,
                                "config.json is not valid JSON: Exceeds the limit (4300 digits)"),
    "generation-config-integer-too-long": (_long_integer(_edit_json("generation_config.json", top_k="LONG"), 5000),
                                           CheckpointError, "generation_config.json is not valid JSON: Exceeds"),
    "header-integer-too-long": (_long_integer(_edit_header_entry(NORM, extra="LONG"), 5000), CheckpointError,
                                "model.safetensors has a corrupt safetensors header (not valid JSON)"),
    "theta-beyond-a-double": (_long_integer(_edit_config(rope_theta="LONG"), 400), ConfigError,
                              "config.json has a malformed rope_theta: expected a positive finite number, got 111"),
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
    (lambda d: _edit_json("model.safetensors.index.json", weight_map={"model.norm.weight": ["a", "b"]})(d),
     "model.safetensors.index.json names shard ['a', 'b'], not a file name in"),
    (lambda d: _edit_json("model.safetensors.index.json", weight_map={"model.norm.weight": 3,
                                                                      "lm_head.weight": "x.safetensors"})(d),
     "model.safetensors.index.json names shard 3, not a file name in"),
    (lambda d: _edit_json("model.safetensors.index.json", weight_map={"model.norm.weight": ".."})(d),
     "model.safetensors.index.json names shard '..', not a file name in"),  # was "cannot read DIR/..: Is a directory"
    (lambda d: _edit_json("model.safetensors.index.json", weight_map={"model.norm.weight": ""})(d),
     "model.safetensors.index.json names shard '', not a file name in"),
    (lambda d: _edit_json("model.safetensors.index.json", weight_map=[1])(d),
     "model.safetensors.index.json is not a valid index (a JSON object with a weight_map object)"),
    (_replace_with_directory("model.safetensors.index.json"), "model.safetensors.index.json is a directory"),
    (lambda d: _edit_json("model.safetensors.index.json", weight_map={"model.norm.weight": "s" * 300})(d),
     f"{'s' * 300} is listed in model.safetensors.index.json but does not exist"),  # was OSError: File name too long
], ids=["missing-shard", "index-disagrees", "index-shard-a-list", "index-shard-a-number", "index-shard-dotdot",
        "index-shard-empty", "index-map-a-list", "index-a-directory", "index-shard-name-too-long"])
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


# ---- the output path, signals and leftovers: through `python -m pynanoqwen convert`, as a user runs it ----

def run_convert(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pynanoqwen", "convert", *map(str, args)],
                          capture_output=True, text=True, timeout=300, **kwargs)


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    hf_dir = tmp_path_factory.mktemp("bf16") / "hf"
    make_checkpoint(TINY, hf_dir, seed=5)
    return hf_dir


def snapshot(directory) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_an_existing_out_is_replaced_only_with_force(tmp_path, bf16_checkpoint):
    out = tmp_path / "m.nanoqwen"
    out.write_bytes(b"an earlier conversion")
    refused = run_convert(bf16_checkpoint, out)
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr == f"error: {out} exists; pass --force to replace it\n"
    assert out.read_bytes() == b"an earlier conversion"
    replaced = run_convert(bf16_checkpoint, out, "--force")
    assert replaced.returncode == 0, replaced.stderr
    with NanoQwenFile(out) as f:
        assert f.config.vocab_size == TINY.vocab_size
    assert [p.name for p in tmp_path.iterdir()] == ["m.nanoqwen"]


@pytest.mark.parametrize("target", ["config.json", "model.safetensors", "tokenizer.json", "new.nanoqwen",
                                    "../elsewhere/../hf/new.nanoqwen", "link-into-checkpoint"])
def test_an_out_inside_the_checkpoint_is_refused_even_with_force(tmp_path, bf16_checkpoint, target):
    """`convert hf hf/config.json` used to exit 0 with config.json gone."""
    hf_dir = tmp_path / "hf"
    shutil.copytree(bf16_checkpoint, hf_dir)
    (tmp_path / "elsewhere").mkdir()
    out = hf_dir / target
    if target == "link-into-checkpoint":
        out = tmp_path / "elsewhere" / "m.nanoqwen"
        out.symlink_to(hf_dir / "model.safetensors")
    before = snapshot(tmp_path)
    for force in ([], ["--force"]):
        result = run_convert(hf_dir, out, *force)
        assert result.returncode == 1 and result.stdout == ""
        assert result.stderr == (f"error: {out} is inside the checkpoint directory {hf_dir}; write the "
                                 ".nanoqwen file somewhere else\n"), result.stderr
    assert snapshot(tmp_path) == before


def test_an_input_reached_through_a_symlink_is_never_replaced(tmp_path, bf16_checkpoint):
    """The Hugging Face cache layout: the snapshot directory holds symlinks into blobs/, so a weight
    file has a name outside the checkpoint directory. Even --force must not write over it."""
    blobs, hf_dir = tmp_path / "blobs", tmp_path / "snapshot"
    shutil.copytree(bf16_checkpoint, hf_dir)
    blobs.mkdir()
    (hf_dir / "model.safetensors").rename(blobs / "0123abcd")
    (hf_dir / "model.safetensors").symlink_to(blobs / "0123abcd")
    before = snapshot(blobs)
    result = run_convert(hf_dir, blobs / "0123abcd", "--force")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == (f"error: {blobs / '0123abcd'} is {hf_dir / 'model.safetensors'}, an input of this "
                             "conversion; write the .nanoqwen file somewhere else\n")
    assert snapshot(blobs) == before and sorted(p.name for p in blobs.iterdir()) == ["0123abcd"]


@pytest.mark.parametrize("make_out, message", [
    (lambda d: d / "no-such-dir" / "m.nanoqwen", "the directory {parent} does not exist"),
    (lambda d: d, "is a directory"),
    (lambda d: d / "no-such-dir" / ".." / "m.nanoqwen", "the directory {parent} does not exist"),
], ids=["missing-directory", "directory", "through-a-missing-directory"])
def test_an_out_that_cannot_be_a_file_is_refused_before_reading_weights(tmp_path, bf16_checkpoint, make_out, message):
    out = make_out(tmp_path)
    result = run_convert(bf16_checkpoint, out)
    assert result.returncode in (1, 2) and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message.format(parent=out.parent) in lines[0]
    assert "convert:" not in result.stderr  # no progress bar: refused before the first tensor


@pytest.mark.parametrize("make_args", [
    lambda d, hf: (d / ("h" * 300), d / "m.nanoqwen"),
    lambda d, hf: (hf, d / ("m" * 300 + ".nanoqwen")),
    lambda d, hf: (hf, d / ("o" * 300) / "m.nanoqwen"),
], ids=["hf-dir", "out", "out-directory"])
def test_a_name_too_long_for_the_file_system_is_one_error_line(tmp_path, bf16_checkpoint, make_args):
    """A name over 255 bytes made os.stat raise, where a missing file is just False: a traceback."""
    hf_dir, out = make_args(tmp_path, bf16_checkpoint)
    result = run_convert(hf_dir, out)
    assert result.returncode == 1 and result.stdout == ""
    assert re.fullmatch(r"error: .*: File name too long\n", result.stderr), result.stderr
    assert list(tmp_path.iterdir()) == []


def test_weights_in_a_fifo_are_refused_not_waited_for(tmp_path, bf16_checkpoint):
    """Opening a FIFO waits for a writer: convert hung, silently, forever."""
    hf_dir = tmp_path / "hf"
    shutil.copytree(bf16_checkpoint, hf_dir)
    (hf_dir / "model.safetensors").unlink()
    os.mkfifo(hf_dir / "model.safetensors")
    result = subprocess.run([sys.executable, "-m", "pynanoqwen", "convert", str(hf_dir), str(tmp_path / "m.nanoqwen")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == f"error: {hf_dir / 'model.safetensors'} is not a regular file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                                  "chat_template.jinja", "model.safetensors.index.json"])
def test_checkpoint_files_in_a_fifo_are_refused_not_waited_for(tmp_path, bf16_checkpoint, name):
    """As for the weights: a FIFO in place of config.json, the tokenizer, its config, the chat template,
    generation_config.json or the index made convert wait for a writer, silently, forever."""
    hf_dir = tmp_path / "hf"
    shutil.copytree(bf16_checkpoint, hf_dir)
    if name == "chat_template.jinja":  # read only where tokenizer_config.json holds no template
        _edit_json("tokenizer_config.json", chat_template=None)(hf_dir)
    (hf_dir / name).unlink(missing_ok=True)
    os.mkfifo(hf_dir / name)
    result = subprocess.run([sys.executable, "-m", "pynanoqwen", "convert", str(hf_dir), str(tmp_path / "m.nanoqwen")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == f"error: {hf_dir / name} is not a regular file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize("make_out", [lambda loop: loop, lambda loop: loop / "m.nanoqwen"], ids=["out", "out-directory"])
def test_an_out_in_a_symlink_loop_is_one_error_line(tmp_path, bf16_checkpoint, make_out):
    """Path.resolve raises RuntimeError on a symlink loop (before Python 3.13): a traceback."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    out = make_out(tmp_path / "a")
    for force in ([], ["--force"]):
        result = run_convert(bf16_checkpoint, out, *force)
        assert result.returncode == 1 and result.stdout == ""
        assert result.stderr == f"error: {out}: Too many levels of symbolic links\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


@pytest.mark.parametrize("args, expected", [
    (["{hf}", ""], "the output path OUT is empty; give the path of the .nanoqwen file to write"),
    (["", "{tmp}/m.nanoqwen"], "the checkpoint directory HF_DIR is empty; give a Hugging Face checkpoint directory"),
], ids=["out", "hf-dir"])
def test_an_empty_path_is_named_as_empty(tmp_path, bf16_checkpoint, args, expected):
    """An empty OUT was reported as `.: is a directory`; an empty HF_DIR was the current directory,
    and OUT was said to be inside the checkpoint directory `.`."""
    args = [a.format(hf=bf16_checkpoint, tmp=tmp_path) for a in args]
    result = run_convert(*args, cwd=tmp_path)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == f"error: {expected}\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("mutate, expected", [
    (_edit_config(num_attention_heads=0),
     "error: config.json has a malformed num_attention_heads: expected a positive integer, got 0\n"),
    (_edit_config(hidden_size=256.7), "error: config.json has a malformed hidden_size: expected a positive integer, "
                                      "got 256.7\n"),
    (_edit_json("tokenizer_config.json", chat_template="{% for m in messages %}"),
     "error: {hf_dir}/tokenizer_config.json: the chat template does not compile: "),  # then jinja2's words
], ids=["zero-heads", "fractional-hidden-size", "template-does-not-compile"])
def test_a_bad_config_or_template_is_one_error_line_from_the_command(tmp_path, bf16_checkpoint, mutate, expected):
    """The command as a user runs it (test_error_is_named_and_leaves_no_file runs these in-process)."""
    hf_dir = tmp_path / "hf"
    shutil.copytree(bf16_checkpoint, hf_dir)
    mutate(hf_dir)
    out = tmp_path / "m.nanoqwen"
    result = run_convert(hf_dir, out)
    assert result.returncode == 1 and result.stdout == "", result.stderr
    assert result.stderr.startswith(expected.format(hf_dir=hf_dir)), result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.endswith("\n"), result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_force_does_not_replace_what_is_not_a_file(tmp_path, bf16_checkpoint):
    """`convert hf /dev/null --force` renamed the new file over the device (as root); a FIFO shows it."""
    out = tmp_path / "pipe"
    os.mkfifo(out)
    for force in ([], ["--force"]):
        result = run_convert(bf16_checkpoint, out, *force)
        assert result.returncode == 1 and result.stdout == ""
        assert result.stderr == f"error: {out} is not a regular file; give the path of the .nanoqwen file to write\n"
        assert stat.S_ISFIFO(os.stat(out).st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["pipe"]


SIGNAL_DURING_QUANTIZATION = """
import os, signal, sys
from pynanoqwen import convert
from pynanoqwen.cli import main

calls = []
quantize_int4 = convert.quantize_int4

def quantize_then_signal(w):
    calls.append(1)
    if len(calls) == 3:  # the temp file holds the first tensors now
        os.kill(os.getpid(), signal.{signal})
    return quantize_int4(w)

convert.quantize_int4 = quantize_then_signal
sys.argv = ["pynanoqwen", "convert", "--force", sys.argv[1], sys.argv[2]]
main()
"""


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGHUP"])
def test_termination_removes_the_temp_file_like_ctrl_c(tmp_path, bf16_checkpoint, signal_name):
    """`kill PID` (or a closed terminal) during the conversion: the process exits 128 + signal,
    the temp file is gone and an existing OUT is untouched. The signal is sent from inside the
    third quantization, so it lands while the temp file holds data, every time."""
    out = tmp_path / "m.nanoqwen"
    out.write_bytes(b"an earlier conversion")
    code = SIGNAL_DURING_QUANTIZATION.replace("{signal}", signal_name)
    result = subprocess.run([sys.executable, "-c", code, str(bf16_checkpoint), str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 128 + getattr(signal, signal_name), result.stderr
    assert "Traceback" not in result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["m.nanoqwen"]
    assert out.read_bytes() == b"an earlier conversion"


def test_leftover_temp_files_of_earlier_runs_are_named_and_kept(tmp_path, bf16_checkpoint):
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(finished.stdout)
    stale = tmp_path / f"m.nanoqwen.tmp.{dead_pid}.0123abcd"
    stale.write_bytes(b"x" * 2_000_000)
    result = run_convert(bf16_checkpoint, tmp_path / "m.nanoqwen")
    assert result.returncode == 0, result.stderr
    assert (f"note: {stale} (2.0 MB) was left by an earlier convert (process {dead_pid}, which is no longer "
            "running); it is not this run's and stays where it is") in result.stderr.splitlines()
    assert stale.read_bytes() == b"x" * 2_000_000
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["m.nanoqwen", stale.name])


@pytest.mark.parametrize("pid", ["0", "99999999999999999999", "2147483648"],
                         ids=["zero", "beyond-c-long", "beyond-pid_t"])
def test_a_leftover_whose_pid_no_process_can_have_is_no_longer_running(tmp_path, bf16_checkpoint, pid):
    """A pid of more digits than a C long was an OverflowError traceback from os.kill, and one beyond
    pid_t another; pid 0 was reported as "still running" (os.kill(0, 0) asks about our own group)."""
    stale = tmp_path / f"m.nanoqwen.tmp.{pid}.0123abcd"
    stale.write_bytes(b"x" * 1_000_000)
    result = run_convert(bf16_checkpoint, tmp_path / "m.nanoqwen")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert (f"note: {stale} (1.0 MB) was left by an earlier convert (process {pid}, which is no longer "
            "running); it is not this run's and stays where it is") in result.stderr.splitlines()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["m.nanoqwen", stale.name])


LEFTOVER_VANISHES_AFTER_LISTING = """
import sys
from pynanoqwen import convert
from pynanoqwen.cli import main

leftover_temp_files = convert.leftover_temp_files

def listed_then_removed(path):
    found = leftover_temp_files(path)
    for temp, _ in found:  # its writer finished (renamed it) or failed (removed it) just now
        temp.unlink()
    return found

convert.leftover_temp_files = listed_then_removed
sys.argv = ["pynanoqwen", "convert", sys.argv[1], sys.argv[2]]
main()
"""


def test_a_leftover_that_vanishes_after_listing_is_skipped(tmp_path, bf16_checkpoint):
    """A temp file removed between the directory listing and its stat() was a FileNotFoundError traceback."""
    stale = tmp_path / "m.nanoqwen.tmp.12345.0123abcd"
    stale.write_bytes(b"x")
    result = subprocess.run([sys.executable, "-c", LEFTOVER_VANISHES_AFTER_LISTING, str(bf16_checkpoint),
                             str(tmp_path / "m.nanoqwen")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "note:" not in result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["m.nanoqwen"]


def test_the_summary_gives_time_peak_memory_and_size(tmp_path, bf16_checkpoint):
    """The README's 7B figures are read off this line."""
    out = tmp_path / "m.nanoqwen"
    result = run_convert(bf16_checkpoint, out)
    assert result.returncode == 0, result.stderr
    summary = result.stderr.strip().splitlines()[-1]
    match = re.fullmatch(r"converted 27 tensors: read 4\.9 MB, wrote ([\d.]+) MB in ([\d.]+) s; peak RSS "
                         r"([\d.]+) MB \(\+[\d.]+ MB during conversion; largest output tensor [\d.]+ MB\)", summary)
    assert match, summary
    assert abs(float(match[1]) * 1e6 - out.stat().st_size) <= 0.05e6
    assert float(match[3]) > 0


def test_generation_config_eos_ids_are_carried_into_the_file(tmp_path, bf16_checkpoint):
    hf_dir = tmp_path / "hf"
    shutil.copytree(bf16_checkpoint, hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    eos, bos = config["eos_token_id"], config["bos_token_id"]
    _edit_json("generation_config.json", eos_token_id=[eos, 100, bos, 100])(hf_dir)
    convert_checkpoint(hf_dir, tmp_path / "m.nanoqwen", progress=False)
    with NanoQwenFile(tmp_path / "m.nanoqwen") as f:
        assert f.config.eos_token_id == eos and f.extra_eos_ids == (100, bos)
    (hf_dir / "generation_config.json").unlink()
    _edit_config(eos_token_id=[eos, 7])(hf_dir)
    convert_checkpoint(hf_dir, tmp_path / "m.nanoqwen", progress=False)
    with NanoQwenFile(tmp_path / "m.nanoqwen") as f:
        assert f.config.eos_token_id == eos and f.extra_eos_ids == (7,)
