"""pynanoqwen.synthetic: random .nanoqwen files that the reader and the reference model accept."""

import dataclasses

import numpy as np

from pynanoqwen.config import PRESETS
from pynanoqwen.fileformat import NanoQwenFile
from pynanoqwen.quant import dequantize_int4
from pynanoqwen.reference import ReferenceModel
from pynanoqwen import synthetic
from pynanoqwen.synthetic import SyntheticWeights, write_synthetic_nanoqwen

TINY = PRESETS["tiny"]


def test_tiny_file_is_valid_and_runs_in_the_reference_model(tmp_path):
    path = tmp_path / "tiny.nanoqwen"
    cfg = write_synthetic_nanoqwen(path, TINY, seed=3)
    with NanoQwenFile(path, verify_data=True) as f:
        assert f.config == cfg and f.lm_head_int4
        assert dataclasses.replace(cfg, bos_token_id=TINY.bos_token_id, eos_token_id=TINY.eos_token_id) == TINY
        norm = f.tensor("model.layers.0.input_layernorm.weight").astype(np.float64)
        assert abs(norm.mean() - 1.0) < 0.01 and 0.01 < norm.std() < 0.03  # 1 + N(0, 0.02)
        w = dequantize_int4(f.tensor("model.layers.1.mlp.down_proj.weight.qweight"),
                            f.tensor("model.layers.1.mlp.down_proj.weight.scales"))
        assert 0.015 < w.std() < 0.025  # N(0, 0.02) through INT4
        logits = ReferenceModel(f).forward([1, 5, 9])
        assert logits.shape == (3, cfg.vocab_size) and np.isfinite(logits).all()


def test_values_do_not_depend_on_the_number_of_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(synthetic, "BLOCK_VALUES", 4096)  # many row blocks per tensor, as at 7B
    cfg = dataclasses.replace(TINY, num_layers=1, tie_word_embeddings=True)
    one, many = tmp_path / "one.nanoqwen", tmp_path / "many.nanoqwen"
    write_synthetic_nanoqwen(one, cfg, seed=5, lm_head_int4=False, workers=1)
    write_synthetic_nanoqwen(many, cfg, seed=5, lm_head_int4=False, workers=4)
    assert one.read_bytes() == many.read_bytes()
    write_synthetic_nanoqwen(many, cfg, seed=6, lm_head_int4=False, workers=4)
    assert one.read_bytes() != many.read_bytes()


def test_in_memory_weights_are_the_file_tensors(tmp_path):
    path = tmp_path / "tiny.nanoqwen"
    write_synthetic_nanoqwen(path, TINY, seed=4)
    weights = SyntheticWeights("tiny", seed=4)
    assert weights.config == TINY and weights.lm_head_int4
    # Any order: scales before their qweight, an FP16 tensor in between.
    order = ["lm_head.weight.scales", "model.norm.weight", "lm_head.weight.qweight"] + \
        [n for n in weights.names if not n.startswith(("lm_head", "model.norm"))]
    with NanoQwenFile(path) as f:
        for name in order:
            got = weights.tensor(name)
            assert got.dtype == f.tensor(name).dtype and weights.nbytes(name) == f.nbytes(name)
            np.testing.assert_array_equal(got, f.tensor(name))
