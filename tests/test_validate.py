"""`python -m pynanoqwen validate`: the report, the exit code and the tiers a CPU-only machine runs.

The CPU tiers run for real on the embedded tiny-coder (format checks; the numpy reference against
transformers in float64: one layer, logits, greedy continuations of held-out code). The GPU tiers
run in the `gpu` test; here they must be reported as skipped. The unit tier's checks are run
under the CUDA simulator in tests/sim/test_validate_sim.py.
"""

import re
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from emulated_engine import EmulatedEngine
from pynanoqwen import device, gates
from pynanoqwen import validate as validate_module
from pynanoqwen.backends import CpuBackend
from pynanoqwen.cli import main
from pynanoqwen.data import EMBEDDED_MODEL
from pynanoqwen.fileformat import NanoQwenFile
from pynanoqwen.kernels import GEMV_PATHS
from pynanoqwen.reference import ReferenceModel, decoder_layer, load_layer

LINE = re.compile(r"^(PASS|FAIL|SKIP)  +(format|reference|unit|layer|graph) +\S")


def run_validate(*args):
    result = CliRunner().invoke(main, ["validate", *args])
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result


def check_lines(output):
    """{(tier, status)} -> count, and the summary line; every line but the first and last is a check."""
    lines = output.strip().splitlines()
    assert lines[0].startswith("validating ") and lines[-1].startswith("validate ")
    for line in lines[1:-1]:
        assert LINE.match(line), line
    return lines[1:-1], lines[-1]


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(device, "cuda_gpu_available", lambda: False)


def test_embedded_model_passes_on_cpu_and_skips_the_gpu_tiers(no_gpu):
    # 20 prompts: tests/test_tiny_coder.py compares all 100 greedy continuations.
    result = run_validate("--device", "auto", "--prompts", "20")
    assert result.exit_code == 0, result.output
    checks, summary = check_lines(result.output)
    passed = [line for line in checks if line.startswith("PASS")]
    names = " ".join(passed)
    for expected in ("open and checksums", "tokenizer", "layer 0 vs transformers", "logits vs transformers",
                     "greedy tokens vs transformers"):
        assert expected in names, result.output
    assert "20 prompts x 16 tokens: all 320 identical" in result.output
    for tier in ("unit", "layer", "graph"):
        assert any(re.match(rf"SKIP +{tier} .*no CUDA GPU", line) for line in checks), result.output
    assert not any(line.startswith("FAIL") for line in checks)
    assert re.match(r"validate OK: 5 passed, 0 failed, 3 skipped \(tiers skipped: graph, layer, unit\)", summary)


def test_corrupted_file_fails_with_one_line_and_exit_code_1(tmp_path):
    corrupted = tmp_path / "corrupted.nanoqwen"
    shutil.copyfile(EMBEDDED_MODEL, corrupted)
    with NanoQwenFile(EMBEDDED_MODEL) as f:
        offset = f.offset("model.layers.1.mlp.down_proj.weight.qweight") + 100
    with open(corrupted, "r+b") as out:
        out.seek(offset)
        byte = out.read(1)
        out.seek(offset)
        out.write(bytes([byte[0] ^ 0x10]))
    result = run_validate("--model", str(corrupted), "--device", "cpu")
    assert result.exit_code == 1
    checks, summary = check_lines(result.output)
    assert re.match(r"FAIL +format +open and checksums .*down_proj.*data checksum mismatch", checks[0]), checks[0]
    assert all(re.match(r"SKIP .*did not pass the format checks", line) for line in checks[1:]), result.output
    assert summary.startswith("validate FAILED: 0 passed, 1 failed")


def test_missing_file_fails_without_traceback(tmp_path):
    result = run_validate("--model", str(tmp_path / "absent.nanoqwen"))
    assert result.exit_code == 1
    assert re.search(r"FAIL +format +open and checksums .*no such file", result.output), result.output


def test_device_cuda_without_a_gpu_is_a_failure(no_gpu):
    result = run_validate("--device", "cuda", "--prompts", "2")
    assert result.exit_code == 1
    checks, summary = check_lines(result.output)
    for tier in ("unit", "layer", "graph"):
        assert any(re.match(rf"FAIL +{tier} +all +no CUDA GPU", line) for line in checks), result.output
    assert "validate FAILED: 5 passed, 3 failed" in summary


def test_an_exception_inside_a_tier_is_a_fail_line_not_a_traceback(no_gpu, monkeypatch):
    def broken(*args):
        raise RuntimeError("kernel exploded\nsecond line")

    monkeypatch.setattr(validate_module, "reference_layer_outputs", broken)
    result = run_validate("--device", "cpu", "--prompts", "2")
    assert result.exit_code == 1
    checks, _ = check_lines(result.output)
    reference = [line for line in checks if re.match(r"\w+ +reference ", line)]
    assert len(reference) == 1 and re.match(r"FAIL +reference +error +RuntimeError: kernel exploded$",
                                             reference[0]), result.output


def test_token_comparison_names_the_first_difference():
    same = validate_module._compare_tokens("t", [[1, 2], [3, 4]], [[1, 2], [3, 4]])
    assert same.status == "PASS" and "all 4 identical" in same.detail
    differ = validate_module._compare_tokens("t", [[1, 2], [3, 4], [5, 6]], [[1, 2], [3, 9], [0, 6]])
    assert differ.status == "FAIL" and differ.detail == "2 of 3 continuations differ; first: prompt 1, token 1"


def test_bad_options_are_refused():
    result = run_validate("--prompts", "0")
    assert result.exit_code == 1 and "error: --prompts must be >= 1" in result.output


class ReferenceEngine(EmulatedEngine):
    """A stand-in for engine.CudaBackend on the numpy reference, with the engine's interface
    (backends.GpuEngine): its probes from tests/emulated_engine.py, its logits the reference's.
    `wrong_graph` makes its CUDA-graph variant (eager=False) of one GEMV path return a different
    last token for every prompt."""

    def __init__(self, path, max_context, gemv, eager, wrong_graph=None):
        self.file = NanoQwenFile(path)
        super().__init__(self.file)
        self.model = ReferenceModel(self.file, max_context=max_context)
        self.name, self.max_context, self.gemv = f"reference as {gemv}", max_context, gemv
        self.wrong = not eager and gemv == wrong_graph

    def generate(self, prompt_ids, params, max_new_tokens, stop_ids, lookup=None):
        tokens = list(CpuBackend(self.model).generate(prompt_ids, params, max_new_tokens, stop_ids))
        if self.wrong:
            tokens[-1] = (tokens[-1] + 1) % self.file.config.vocab_size
        yield from tokens

    def teacher_forced_logits(self, token_ids):
        self.model.reset()
        return self.model.forward(token_ids)

    prefill_logits = teacher_forced_logits

    def layer_outputs(self, layer, hidden_states):
        cfg = self.file.config
        cache = np.zeros((2, len(hidden_states), cfg.num_kv_heads, cfg.head_dim), np.float32)
        return decoder_layer(hidden_states, load_layer(self.file, layer), cfg, cache[0], cache[1], 0)


@pytest.mark.parametrize("wrong_graph", [None, "dp4a"])
def test_gpu_tiers_compare_through_the_engine_interface(monkeypatch, wrong_graph):
    """The layer and graph tiers run on a stand-in engine: all PASS when it computes what the
    reference does, and a graph replay that changes tokens is caught (and only that variant)."""
    monkeypatch.setattr(device, "cuda_gpu_available", lambda: True)
    monkeypatch.setattr(validate_module, "UNIT_CHECKS", ())  # the kernels need a real GPU
    monkeypatch.setattr(validate_module, "load_engine", lambda path, max_context, gemv, eager:
                        ReferenceEngine(path, max_context, gemv, eager, wrong_graph))
    result = run_validate("--device", "cuda", "--prompts", "3")
    checks, summary = check_lines(result.output)
    gpu = {re.split(r"  +", line)[2]: line.split()[0] for line in checks if re.match(r"\w+ +(layer|graph) ", line)}
    expected = {f"{gemv} layer 0 vs reference": "PASS" for gemv in GEMV_PATHS}
    for gemv in GEMV_PATHS:
        broken = gemv == wrong_graph
        expected[f"{gemv} graph vs eager tokens"] = "FAIL" if broken else "PASS"
        expected[f"{gemv} graph vs reference tokens"] = "FAIL" if broken else "PASS"
        # Teacher forcing feeds in all but the last generated token, the one that was changed.
        expected[f"{gemv} graph vs eager logits"] = "PASS"
        expected[f"{gemv} logits vs reference"] = "PASS"
        expected[f"{gemv} generate's self-check"] = "PASS"
        expected[f"{gemv} prefill vs reference"] = "PASS"
        expected[f"{gemv} prefill vs decode"] = "PASS"
    assert gpu == expected, result.output
    assert result.exit_code == (1 if wrong_graph else 0), result.output
    if wrong_graph:
        assert "3 of 3 continuations differ; first: prompt 0, token 15" in result.output


class GarbageEngine(ReferenceEngine):
    """The stand-in with all-zero or shuffled outputs: logits (both paths) and the layer's."""

    kind = "zeros"

    def corrupt(self, array):
        if self.kind == "zeros":
            return np.zeros_like(array)
        return np.take_along_axis(array, np.argsort(np.random.default_rng().random(array.shape), axis=-1), axis=-1)

    def teacher_forced_logits(self, token_ids):
        return self.corrupt(super().teacher_forced_logits(token_ids))

    prefill_logits = teacher_forced_logits

    def layer_outputs(self, layer, hidden_states):
        return self.corrupt(super().layer_outputs(layer, hidden_states))


@pytest.mark.parametrize("kind", ["zeros", "shuffled"])
def test_all_zero_and_shuffled_outputs_fail_the_gpu_tiers(monkeypatch, kind):
    """Through validate's own comparisons: every check that holds an output against the reference
    fails (the two paths of the same garbage may agree with each other: prefill vs decode)."""
    monkeypatch.setattr(device, "cuda_gpu_available", lambda: True)
    monkeypatch.setattr(validate_module, "UNIT_CHECKS", ())
    monkeypatch.setattr(GarbageEngine, "kind", kind)
    monkeypatch.setattr(validate_module, "load_engine", lambda path, max_context, gemv, eager:
                        GarbageEngine(path, max_context, gemv, eager))
    result = run_validate("--device", "cuda", "--prompts", "3")
    checks, _ = check_lines(result.output)
    status = {re.split(r"  +", line)[2]: line.split()[0] for line in checks if re.match(r"\w+ +(layer|graph) ", line)}
    for gemv in ("prmt", "dp4a"):
        for name in ("layer 0 vs reference", "logits vs reference", "prefill vs reference"):
            assert status[f"{gemv} {name}"] == "FAIL", result.output
    assert result.exit_code == 1


@pytest.mark.gpu
def test_embedded_model_passes_every_tier_on_the_gpu():
    result = run_validate("--device", "cuda")
    print(result.output)
    assert result.exit_code == 0, result.output
    checks, summary = check_lines(result.output)
    assert not any(line.startswith(("FAIL", "SKIP")) for line in checks), result.output
    for tier in ("unit", "layer", "graph"):
        assert any(re.match(rf"PASS +{tier} ", line) for line in checks)


def test_dp4a_divergences_must_sit_at_near_ties():
    """The dp4a token check: a continuation that leaves the reference where the reference's own
    top two logits are close passes; the same departure fails once the margin the error estimate
    allows is smaller than that gap."""
    from pynanoqwen.tokenizer import Tokenizer

    t = validate_module.Target(EMBEDDED_MODEL, embedded=True, prompts=4, seed=0)
    t.file = NanoQwenFile(EMBEDDED_MODEL)
    try:
        cfg = t.config
        t.tokenizer = Tokenizer.from_json_bytes(t.file.tokenizer_json, t.file.chat_template, vocab_size=cfg.vocab_size,
                                                bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id)
        theirs = t.reference_tokens()
        prompt, at = t.prompts()[1], 5
        model = ReferenceModel(t.file, max_context=t.max_context())
        logits = model.forward(prompt + theirs[1][:at], last_only=True)[0].astype(np.float64)
        second = int(np.argsort(logits)[-2])
        gap = float(logits[theirs[1][at]] - logits[second])
        ours = [list(seq) for seq in theirs]
        ours[1][at] = second  # the GPU took the reference's runner-up here
        eps_at_gap = gap / float(gates.clear_margin(logits, 1.0))  # the error estimate whose margin is the gap
        assert validate_module._divergences_at_near_ties("x", t, ours, eps_at_gap * 1.01).status == "PASS"
        assert validate_module._divergences_at_near_ties("x", t, ours, eps_at_gap * 0.99).status == "FAIL"
    finally:
        t.file.close()


def test_without_torch_the_reference_tier_says_it_was_skipped_and_how_to_get_it(no_gpu, monkeypatch):
    from pynanoqwen import transformers_adapter

    monkeypatch.setattr(transformers_adapter, "missing", lambda: "torch")
    result = run_validate("--device", "cpu", "--prompts", "2")
    assert result.exit_code == 0, result.output
    checks, summary = check_lines(result.output)
    reference = [line for line in checks if re.match(r"\w+ +reference ", line)]
    assert len(reference) == 1 and re.match(r"SKIP +reference +all +the reference tier was not run: it needs torch",
                                            reference[0]), result.output
    assert "pip install pynanoqwen[validate]" in reference[0]
    assert "the reference tier did not run (torch is not installed): `pip install pynanoqwen[validate]`" in summary


MEMORY_TEST_CAP = int(1.5 * 2**30)
MEMORY_SCRIPT = """
import sys, threading, time
from pynanoqwen import validate

def anon():  # RssAnon: the process's own memory, not the file's mapped pages
    with open("/proc/self/status") as status:
        return 1024 * int(next(line.split()[1] for line in status if line.startswith("RssAnon:")))

peak, done = [anon()], threading.Event()

def watch():
    while not done.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.01)

watcher = threading.Thread(target=watch)
watcher.start()
validate.CPU_MEMORY_BYTES = int(sys.argv[2])
report = validate.validate(sys.argv[1], "cpu", 2, 0, on_line=print)
done.set()
watcher.join()
print("PEAK", max(peak[0], anon()))
"""


@pytest.mark.slow
def test_validate_on_the_cpu_stays_under_its_memory_cap(tmp_path):
    """A model whose float64 transformers copy is 0.77 GB (0.5B widths, 6 layers, vocab 8192),
    under a cap of 1.5 GiB: the logits check must run, and the process's anonymous memory (the
    file's mapped pages aside) must stay under the cap throughout (measured: 1.19 GiB). Building the
    float64 model from a float64 copy of every tensor, as validate did before, held both copies and
    the reference's cached float32 layers: 1.77 GiB here, measured the same way."""
    import dataclasses
    import subprocess
    import sys

    from pynanoqwen.config import PRESETS
    from pynanoqwen.synthetic import write_synthetic_nanoqwen
    from pynanoqwen.transformers_adapter import float64_bytes

    cfg = dataclasses.replace(PRESETS["0.5b"], num_layers=6, vocab_size=8192, max_position_embeddings=256)
    assert 0.7e9 < float64_bytes(cfg) < 0.8e9
    path = tmp_path / "mid.nanoqwen"
    write_synthetic_nanoqwen(path, cfg, seed=5, lm_head_int4=False)
    proc = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(path), str(MEMORY_TEST_CAP)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak = int(re.search(r"^PEAK (\d+)$", proc.stdout, re.M).group(1))
    print(proc.stdout[-2000:], f"\npeak anonymous memory {peak / 2**30:.2f} GiB (cap {MEMORY_TEST_CAP / 2**30:.1f})")
    assert re.search(r"^PASS +reference +logits vs transformers ", proc.stdout, re.M), proc.stdout
    assert peak <= MEMORY_TEST_CAP
