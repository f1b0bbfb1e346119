"""The engine's schedule (pynanoqwen/engine/schedule.py) without a GPU: the order of the launches a
decode step and a prefill chunk make, and that every activation a launch reads was written by a
launch before it in the same list (so a step's data flows through its buffers, never from a stale
one). Kernel objects are stand-ins that record nothing; buffers are numpy arrays, which is all
the schedule touches."""

import dataclasses

import numpy as np
import pytest

from pynanoqwen.config import PRESETS
from pynanoqwen.engine.buffers import Activations, Buffers, KvPool, PrefillRows, StepState
from pynanoqwen.engine.schedule import DecodeOps, Kernels, PrefillOps, forward_launches
from pynanoqwen.engine.weights import DeviceLayer, DeviceWeights, PrefillLinears

CFG = dataclasses.replace(PRESETS["tiny"], num_layers=2)
LAYER = ["qkv", "attention", "o_proj", "gate_up", "down"]  # decode's QKV GEMV applies RoPE and writes K/V
PREFILL_LAYER = ["input_norm", "qkv", "rope_kv_write", "attention", "o_proj", "post_attention_norm", "gate_up", "down"]


class Kernel:
    path = "prmt"  # a GEMV's arithmetic, which the schedule names in its reports

    def launch(self, stream, *args, **kwargs):
        raise AssertionError("the schedule builds launches; it does not run them")

    launch_rows = launch_rope = launch


def buffers(rows=16) -> Buffers:
    def array(*shape):
        return np.zeros(shape, np.float32)

    prefill = {rows: PrefillRows(*(array(rows, 8) for _ in dataclasses.fields(PrefillRows)))}  # distinct arrays
    return Buffers(StepState(*(array(4) for _ in dataclasses.fields(StepState))),
                   Activations(*(array(8) for _ in dataclasses.fields(Activations))),
                   KvPool(array(CFG.num_layers, 4, 1, 16, 8), array(CFG.num_layers, 4, 1, 16, 8)),
                   array(4, 4), array(4, 4), prefill, array(2), None, None)


def weights(lm_head_int4: bool) -> DeviceWeights:
    layer = DeviceLayer(np.ones(8), np.ones(8), Kernel(), Kernel(), Kernel(), Kernel(),
                        PrefillLinears(Kernel(), Kernel(), Kernel(), Kernel()))
    return DeviceWeights(np.ones((4, 8)), np.ones(8), [layer] * CFG.num_layers, Kernel(), lm_head_int4, 1)


KERNELS = Kernels(*(Kernel() for _ in dataclasses.fields(Kernels)))


def reads_follow_writes(launches, activations: list) -> None:
    """Every activation buffer a launch reads (an argument it does not write) was written by an
    earlier launch of the list."""
    activation_ids = {id(array) for array in activations}
    written = set()
    for launch in launches:
        outputs = {id(array) for array in launch.writes.values()}
        for arg in launch.args:
            if id(arg) in activation_ids and id(arg) not in outputs:
                assert id(arg) in written, f"{launch.stage} (layer {launch.layer}) reads a buffer nothing wrote"
        written |= outputs


def fields_of(record) -> list:
    return [getattr(record, field.name) for field in dataclasses.fields(record)]


@pytest.mark.parametrize("lm_head_int4", [True, False])
def test_a_decode_step_runs_the_layer_schedule_and_its_data_flows_forward(lm_head_int4):
    b = buffers()
    ops = DecodeOps(CFG, weights(lm_head_int4), KERNELS, b, context=100)
    launches = forward_launches(ops, "argmax", new_page=True)
    head = ["lm_head"] if lm_head_int4 else ["final_norm", "lm_head"]
    assert [launch.stage for launch in launches] == ["page_alloc", "embedding"] + LAYER * CFG.num_layers + head + [
        "sampler"]
    assert [launch.layer for launch in launches if launch.stage == "qkv"] == list(range(CFG.num_layers))
    assert all(launch.bytes > 0 for launch in launches)
    reads_follow_writes(launches, fields_of(b.act))
    # "prompt" steps sample without the lm_head; a step inside a page allocates nothing.
    assert [launch.stage for launch in forward_launches(ops, "prompt", new_page=False)][-2:] == ["down", "sampler"]


def test_a_prefill_chunk_runs_the_same_layer_schedule_over_rows_then_hands_over():
    b = buffers(rows=16)
    ops = PrefillOps(CFG, weights(True), KERNELS, b, rows=16)
    launches = forward_launches(ops, "argmax")
    assert [launch.stage for launch in launches] == (["page_alloc", "embedding"] + PREFILL_LAYER * CFG.num_layers
                                                     + ["last_row", "lm_head", "sampler"])
    reads_follow_writes(launches, fields_of(b.prefill[16]) + fields_of(b.act))
    last_row = next(launch for launch in launches if launch.stage == "last_row")
    assert last_row.writes["h"] is b.act.h  # the decode head reads what the chunk handed over
