"""Bad command lines of every command, through `python -m pynanoqwen` as a user runs it: each is
one `error: ...` line on stderr, nothing on stdout, exit code 1 (2 for what click itself parses:
a value that is not a number, a missing argument, an unknown option). Arguments are checked before
the hardware: a wrong setting is reported as such on a machine without a GPU too."""

import os
import subprocess
import sys

import pytest

from pynanoqwen.data import EMBEDDED_MODEL, held_out_function_count
from pynanoqwen.device import cuda_gpu_available


def run_module(*args) -> subprocess.CompletedProcess:
    """Bytes arguments reach Python undecoded, as from a terminal that is not UTF-8."""
    return subprocess.run([sys.executable, "-m", "pynanoqwen", *(a if isinstance(a, bytes) else str(a) for a in args)],
                          capture_output=True, text=True, errors="backslashreplace", timeout=300,
                          env={**os.environ, "PYNANOQWEN_API_KEY": ""})


def assert_one_error_line(result: subprocess.CompletedProcess, expected: str, code: int = 1) -> None:
    assert result.returncode == code and result.stdout == "", result.stderr
    assert result.stderr == f"error: {expected}\n"


@pytest.mark.parametrize("args, expected", [
    (["validate", "--seed", "-1"], "--seed must be >= 0, got -1"),
    (["validate", "--prompts", "0"], "--prompts must be >= 1, got 0"),
    (["validate", "--prompts", "100000"], f"--prompts must be at most {held_out_function_count()}, got 100000: the "
     f"held-out standard library files of this Python hold {held_out_function_count()} functions to draw prompts from"),
    (["bench", "--synthetic", "7b", "--repeats", "0"], "--repeats must be at least 1"),
    (["bench", "--synthetic", "7b", "--gen-tokens", "2"],
         "--gen-tokens must be at least 3: the first gap of a run overlaps the next step's launch, so fewer give no interval"),
    (["bench", "--synthetic", "7b", "--prompt-tokens", "-4"], "--prompt-tokens must be at least 1"),
    (["bench", "--synthetic", "7b", "--eager-tokens", "0"], "--eager-tokens must be at least 1"),
    (["bench", "--synthetic", "9b"], "unknown preset '9b'; choose one of tiny, 0.5b, 1.5b, 3b, 7b, 14b, 32b"),
    (["bench", "--model", "/nonexistent/m.nanoqwen"], "/nonexistent/m.nanoqwen: no such file"),
    (["bench", "--synthetic", "7b", "--json", "/nonexistent/run.json"],
     "--json /nonexistent/run.json: its directory does not exist"),
    (["bench", "--synthetic", "7b", "--model", EMBEDDED_MODEL],
     "give exactly one of --model FILE and --synthetic PRESET"),
    (["bench", "--synthetic", "tiny", "--prompt-tokens", "4000"],
     "the timed runs need a context of 4144 positions (--prompt-tokens + --gen-tokens, or 16 + --eager-tokens, and "
     "16 to spare), more than the model's 2048"),
    (["bench", "--model", EMBEDDED_MODEL, "--eager-tokens", "3000"],
     "the timed runs need a context of 3032 positions (--prompt-tokens + --gen-tokens, or 16 + --eager-tokens, and "
     "16 to spare), more than the model's 2048"),
    (["serve", "--host", ""], "--host is empty; give an address (0.0.0.0 opens the server to the network)"),
    (["bench", "--synthetic", "7b", "--json", ""], "--json is empty; give the path of the JSON file to write"),
    (["bench", "--synthetic", "7b", "--json", "/dev/null"],
     "--json /dev/null is not a regular file; give the path of the JSON file to write"),
    (["bench", "--synthetic", "7b", "--json", "/tmp/" + "j" * 300 + "/run.json"],
     f"--json /tmp/{'j' * 300}/run.json: File name too long"),
    (["serve", "--host", b"caf\xe9"], r"--host is not valid UTF-8 text (byte 0xe9 at character 3)"),
    (["serve", "--api-key", b"\xffkey"], r"--api-key is not valid UTF-8 text (byte 0xff at character 0)"),
    (["bench", "--synthetic", "7b", "--json", "/tmp/" + "j" * 250 + ".json"],
     f"--json /tmp/{'j' * 250}.json: File name too long (the results go to a temporary file beside it first, whose "
     "name is 12 bytes longer)"),
    (["serve", "--api-key", "secret "], "--api-key starts or ends with white space, which no Authorization header "
                                        "can carry; remove it"),
    (["serve", "--api-key", "sec\x07ret"], "--api-key contains a control character, which no Authorization header "
                                           "can carry"),
    (["serve", "--port", "0", "--host", "\u00fc" + "x" * 70],
     f"cannot listen on \u00fc{'x' * 70}:0: not a valid host name"),
], ids=["validate-seed", "validate-prompts", "validate-too-many-prompts", "bench-repeats", "bench-gen-tokens",
        "bench-prompt-tokens", "bench-eager-tokens", "bench-preset", "bench-missing-model", "bench-json-dir",
        "bench-both", "bench-run-beyond-context", "bench-eager-run-beyond-context", "serve-empty-host",
        "bench-json-empty", "bench-json-device", "bench-json-name-too-long", "serve-host-not-utf8",
        "serve-api-key-not-utf8", "bench-json-temp-name-too-long", "serve-api-key-white-space",
        "serve-api-key-control", "serve-host-not-idna"])
def test_bad_settings_are_reported_before_the_missing_gpu(args, expected):
    """`validate --seed -1` was a 40-line traceback; `bench --synthetic 9b` reported the missing GPU, and
    `bench --prompt-tokens 4000` on a 2048-token model failed on the GPU after loading the weights;
    `serve --host ''` listened on every interface and `bench --json ''` wrote no file, silently.
    `bench --json /dev/null` would have renamed its results over the device after the run (as root),
    and a --json directory name over 255 bytes was a traceback; `serve --host caf\\xe9` was a TypeError
    traceback, and a --api-key that is not UTF-8 made every request a 500. A --json name of 244-255
    bytes passed the checks, but its temporary file's name was too long after the run; an --api-key
    with white space at its ends (or a control character) made every request a 401. A non-ASCII
    --host that IDNA cannot encode (a label over 63 characters) was a TypeError traceback. `validate
    --prompts` above the held-out functions' count ran the tiers, then printed a FAIL line."""
    assert_one_error_line(run_module(*args), expected)


@pytest.mark.parametrize("name", ["run.json", "loop/run.json"])
def test_bench_json_in_a_symlink_loop_is_one_error_line(tmp_path, name):
    """Path.resolve raises RuntimeError on a symlink loop (before Python 3.13): a traceback."""
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    if name == "run.json":
        (tmp_path / name).symlink_to(tmp_path / "loop")
    target = tmp_path / name
    assert_one_error_line(run_module("bench", "--synthetic", "7b", "--json", target),
                          f"--json {target}: Too many levels of symbolic links")


def test_bench_without_a_gpu_says_so_once_the_settings_are_good():
    if cuda_gpu_available():
        pytest.skip("a GPU is present")
    assert_one_error_line(run_module("bench", "--synthetic", "7b"),
                          "bench needs an NVIDIA GPU of compute capability 9.0 (H100/H200); none was found")


@pytest.mark.parametrize("args, culprit", [
    (["validate", "--seed", "x"], "'--seed'"),
    (["validate", "--device", "tpu"], "'--device'"),
    (["bench", "--repeats", "1.5"], "'--repeats'"),
    (["convert", "only-one-argument"], "'OUT'"),
    (["info"], "'FILE'"),
    (["info", "/"], "is a directory"),
    (["generate", "--no-such-option", "x"], "--no-such-option"),
    (["serve", "--port", "eighty"], "'--port'"),
    (["frobnicate"], "'frobnicate'"),
])
def test_what_click_parses_is_one_line_too(args, culprit):
    """Click's wording changes between its versions; what must hold is one line naming the culprit
    and where the options are listed, and click's exit code 2."""
    result = run_module(*args)
    assert result.returncode == 2 and result.stdout == "", result.stderr
    command = " ".join(["python -m pynanoqwen"] + args[:1] * (args[0] != "frobnicate"))
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert culprit in result.stderr and result.stderr.endswith(f"; see '{command} --help'\n"), result.stderr


@pytest.mark.parametrize("content, expected", [
    (b"", "{path}: 0 bytes, too short for the 256-byte header"),
    (b"NANOQWEN" + bytes(500), "{path}: header: format version 0 is not supported (this reader reads version 1)"),
], ids=["empty", "zero-header"])
def test_info_on_files_that_are_not_models(tmp_path, content, expected):
    path = tmp_path / "m.nanoqwen"
    path.write_bytes(content)
    assert_one_error_line(run_module("info", path), expected.format(path=path))


def test_info_on_a_truncated_model(tmp_path):
    path = tmp_path / "m.nanoqwen"
    data = EMBEDDED_MODEL.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    assert_one_error_line(run_module("info", path), f"{path}: header: file_size says {len(data)} bytes but the "
                                                    f"file has {len(data) // 2} (truncated or appended to)")


def test_a_vanishing_temperature_samples_as_greedy():
    """`--temperature 1e-320` overflowed logits / T into NaN probabilities: numpy warnings on stderr
    and tokens that were not the model's most probable."""
    args = ["generate", "--device", "cpu", "--max-new-tokens", "6", "def f(x):"]
    greedy, tiny = run_module(*args), run_module(*args, "--temperature", "1e-320")
    assert greedy.returncode == tiny.returncode == 0, tiny.stderr
    assert tiny.stdout == greedy.stdout and "Warning" not in tiny.stderr


@pytest.mark.parametrize("args", [["info", ""], ["generate", "--device", "cpu", "--model", "", "x"],
                                  ["bench", "--model", ""], ["validate", "--device", "cpu", "--model", ""]],
                         ids=["info", "generate", "bench", "validate"])
def test_an_empty_model_path_is_named_as_empty(args):
    """An empty path was reported as `.: is a directory`."""
    assert_one_error_line(run_module(*args), "the model path is empty; give the path of a .nanoqwen file")
