"""Where models run, and that nothing about it is silent: extra buffer types on AMX CPUs, GPU
layers on a CPU build, the context a model can hold, the encoder's provider and token limit.

The default decode runs in a subprocess first: on a CPU whose llama.cpp kernels crash, that one
test fails with the signal and what to do, instead of the crash killing the whole test run. Forced
extra buffers run only in child processes too (tests/conftest.py's guard fails any test that loads
them in the suite's own process); the AMX policy itself is tested with the CPU's flags faked.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import llama_cpp
import pytest

from cascade.encoder.onnx_encoder import Encoder
from cascade.errors import ModelError
from cascade.hashing import file_sha256
from cascade.questions import parse_request
from cascade.readout import llama
from cascade.readout.placement import (
    EXTRA_BUFFERS_ENV,
    Placement,
    for_tier,
    reports_amx,
    say_once,
    system_info,
    use_extra_buffers,
)
from cascade.readout.scorer import Scorer

AMX_LINE = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | REPACK = 1 |"
AVX512_LINE = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | LLAMAFILE = 1 | REPACK = 1 |"
PLAIN_LINE = "CPU : SSE3 = 1 | AVX2 = 1 | LLAMAFILE = 1 | REPACK = 1 |"
ONE_DECODE = """
from cascade.readout.llama import default_gguf_path
from cascade.questions import parse_request
from cascade.readout.scorer import Scorer
scorer = Scorer(default_gguf_path(), n_ctx=512, max_branches=2, n_threads=1)
request = parse_request({"state": "The capital of France is Paris.",
                         "questions": {"q": {"type": "noul", "instructions": "Is this about France?"}}})
print(scorer.ran_on)
print(sum(scorer.score(request).answers["q"].probabilities.values()))
"""
REQUEST_BODY = {"state": "My payouts have failed for three days, please help!",
                "questions": {"urgent": {"type": "noul", "instructions": "Is this urgent?"},
                              "team": {"type": "choice", "instructions": "Which team?",
                                       "criteria": {"billing": None, "tech": None}}}}
REQUEST = parse_request(REQUEST_BODY)
BUFFERS_CHILD = """
import json, sys
from cascade.errors import ModelError
from cascade.readout.llama import default_gguf_path
from cascade.questions import parse_request
from cascade.readout.scorer import Scorer
try:
    scorer = Scorer(default_gguf_path(), n_ctx=512, max_branches=4, n_threads=1, extra_buffers=sys.argv[1])
except ModelError as error:
    print(error, file=sys.stderr)
    sys.exit(2)
answers = scorer.score(parse_request(json.loads(sys.argv[2]))).answers
print(scorer.ran_on)
print(json.dumps({qid: answer.probabilities for qid, answer in answers.items()}))
"""
PATH_TOLERANCE = 0.15  # BENCHMARKS.md: quantized kernels of another shape move p by up to 0.10


def test_one_real_decode_with_the_default_settings_survives() -> None:
    env = {k: v for k, v in os.environ.items() if k != EXTRA_BUFFERS_ENV}
    result = subprocess.run([sys.executable, "-c", ONE_DECODE], capture_output=True, text=True,
                            timeout=300, env=env)
    if result.returncode < 0:
        name = signal.Signals(-result.returncode).name
        pytest.fail(f"llama.cpp crashed ({name}) in one default decode of gemma-3-270m on this CPU "
                    f"({system_info().strip()}); if it reports AMX, extra buffer types are the "
                    f"known cause: check cascade.readout.placement's policy, or set {EXTRA_BUFFERS_ENV}=off. "
                    f"stderr: {result.stderr[-2000:]}")
    assert result.returncode == 0, result.stderr
    ran_on, total = result.stdout.strip().splitlines()[-2:]
    assert float(total) == pytest.approx(1.0)
    assert "extra buffers" in ran_on


def test_auto_turns_extra_buffers_off_where_llama_cpp_reports_amx(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(EXTRA_BUFFERS_ENV, raising=False)
    say_once.cache_clear()  # said once per process: this test must see it said
    with caplog.at_level("WARNING", logger="cascade"):
        assert use_extra_buffers(None, AMX_LINE) == (False, "AMX CPU")
        assert use_extra_buffers("auto", AMX_LINE) == (False, "AMX CPU")
    assert use_extra_buffers(None, PLAIN_LINE) == (True, "default")
    assert use_extra_buffers(None, AVX512_LINE) == (False, "AVX-512 CPU, measured faster without")
    assert caplog.text.count("AMX_INT8") == 1  # the crash avoided is said; the speed choice recorded
    assert use_extra_buffers("off", PLAIN_LINE) == (False, "asked")
    assert use_extra_buffers("on", AVX512_LINE) == (True, "asked")


def test_on_is_refused_with_one_line_where_llama_cpp_reports_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EXTRA_BUFFERS_ENV, raising=False)
    with pytest.raises(ModelError) as refused:
        use_extra_buffers("on", AMX_LINE)
    line = str(refused.value)
    assert "\n" not in line and "AMX_INT8" in line and "issue 20824" in line
    assert "--extra-buffers force" in line and f"{EXTRA_BUFFERS_ENV}=force" in line
    monkeypatch.setenv(EXTRA_BUFFERS_ENV, "on")
    with pytest.raises(ModelError, match="extra buffers 'on' refused"):
        use_extra_buffers(None, AMX_LINE)


def test_force_loads_them_even_on_amx_and_says_the_risk(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(EXTRA_BUFFERS_ENV, raising=False)
    say_once.cache_clear()
    with caplog.at_level("WARNING", logger="cascade"):
        assert use_extra_buffers("force", AMX_LINE) == (True, "forced (asked)")
    assert "may segfault" in caplog.text
    assert use_extra_buffers("force", PLAIN_LINE) == (True, "forced (asked)")
    monkeypatch.setenv(EXTRA_BUFFERS_ENV, "force")
    assert use_extra_buffers(None, AMX_LINE) == (True, f"forced ({EXTRA_BUFFERS_ENV}=force)")


def test_a_scorer_asked_for_on_is_refused_on_faked_amx_flags_before_loading(
    gemma_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real Scorer path with the CPU's flags faked: the refusal comes before llama.cpp loads."""
    monkeypatch.setattr(llama, "system_info", lambda: AMX_LINE)
    loads: list[bytes] = []
    monkeypatch.setattr(llama_cpp, "llama_model_load_from_file", lambda path, params: loads.append(path))
    with pytest.raises(ModelError, match="extra buffers 'on' refused"):
        Scorer(gemma_path, n_ctx=512, max_branches=2, n_threads=1, extra_buffers="on")
    assert loads == []


def test_the_environment_sets_extra_buffers_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EXTRA_BUFFERS_ENV, "on")
    assert use_extra_buffers(None, PLAIN_LINE) == (True, f"{EXTRA_BUFFERS_ENV}=on")
    monkeypatch.setenv(EXTRA_BUFFERS_ENV, "OFF")
    assert use_extra_buffers(None, AMX_LINE) == (False, f"{EXTRA_BUFFERS_ENV}=off")
    assert use_extra_buffers("on", PLAIN_LINE) == (True, "asked")  # an explicit setting wins
    monkeypatch.setenv(EXTRA_BUFFERS_ENV, "maybe")
    with pytest.raises(ModelError, match=f"{EXTRA_BUFFERS_ENV} must be auto, on, off or force"):
        use_extra_buffers(None, PLAIN_LINE)


def test_the_amx_policy_is_said_once_on_stderr() -> None:
    code = ("from cascade.readout.placement import use_extra_buffers\n"
            f"for _ in range(3): use_extra_buffers(None, {AMX_LINE!r})\n")
    env = {k: v for k, v in os.environ.items() if k != EXTRA_BUFFERS_ENV}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("AMX_INT8") == 1
    assert f"{EXTRA_BUFFERS_ENV}=force" in result.stderr


def _answers_in_a_child(mode: str) -> subprocess.CompletedProcess[str]:
    """gemma's answers to REQUEST with extra buffers ``mode``, read in a child process: forced
    buffers segfault AMX Xeons (llama.cpp issue 20824), and the suite's own process must live."""
    env = {k: v for k, v in os.environ.items() if k != EXTRA_BUFFERS_ENV}
    return subprocess.run([sys.executable, "-c", BUFFERS_CHILD, mode, json.dumps(REQUEST_BODY)],
                          capture_output=True, text=True, timeout=300, env=env)


def test_both_buffer_settings_load_and_answer_alike_in_a_child_process() -> None:
    """On and off answer alike where on is allowed; where llama.cpp reports AMX, on is refused."""
    amx = reports_amx(system_info())
    answers = {}
    for mode in ("on", "off"):
        child = _answers_in_a_child(mode)
        assert child.returncode >= 0, f"extra buffers {mode} crashed the child: {child.stderr[-2000:]}"
        if mode == "on" and amx:
            assert child.returncode == 2 and "extra buffers 'on' refused" in child.stderr
            return
        assert child.returncode == 0, child.stderr
        ran_on, probabilities = child.stdout.strip().splitlines()[-2:]
        assert f"extra buffers {mode} (asked)" in ran_on
        answers[mode] = json.loads(probabilities)
    for qid, probs in answers["on"].items():
        assert sum(probs.values()) == pytest.approx(1.0)
        for key, p in probs.items():
            assert p == pytest.approx(answers["off"][qid][key], abs=PATH_TOLERANCE)


@pytest.mark.skipif(llama_cpp.llama_supports_gpu_offload(), reason="this build can offload to a GPU")
def test_gpu_layers_on_a_cpu_build_are_refused(gemma_path: Path) -> None:
    with pytest.raises(ModelError, match=r"no GPU offload.*DGGML_CUDA=on"):
        Scorer(gemma_path, n_ctx=512, n_gpu_layers=1)


@pytest.mark.skipif(not llama_cpp.llama_supports_gpu_offload(), reason="needs a GPU build")
def test_gpu_layers_on_a_gpu_build_are_recorded(gemma_path: Path) -> None:
    scorer = Scorer(gemma_path, n_ctx=512, n_gpu_layers=99)
    try:
        assert scorer.ran_on.startswith("gpu: ")
        assert scorer.score(REQUEST).usage.ran_on == {gemma_path.name: scorer.ran_on}
    finally:
        scorer.close()


def test_negative_gpu_layers_are_refused(gemma_path: Path) -> None:
    with pytest.raises(ModelError, match="gpu layers must be 0 or more"):
        Scorer(gemma_path, n_ctx=512, n_gpu_layers=-1)


def test_answers_record_where_they_ran_and_the_model_hash(gemma_scorer: Scorer, gemma_path: Path) -> None:
    response = gemma_scorer.score(REQUEST)
    assert response.usage.ran_on == {gemma_path.name: gemma_scorer.ran_on}
    assert gemma_scorer.ran_on.startswith("cpu, ")
    for answer in response.answers.values():
        assert answer.readout is not None
        assert answer.readout.model_sha256 == file_sha256(gemma_path)


def test_a_context_beyond_the_trained_one_is_lowered_and_said(gemma_path: Path) -> None:
    scorer = Scorer(gemma_path, n_ctx=1 << 20, max_branches=2, n_threads=1)
    try:
        trained = scorer.model.n_ctx_train
        assert scorer.ctx.config.n_ctx == trained < 1 << 20
        assert f"n_ctx {trained}, the model's trained context ({1 << 20} asked)" in scorer.ran_on
    finally:
        scorer.close()


def test_the_encoder_records_its_provider_and_its_cuts(encoder: Encoder) -> None:
    assert encoder.ran_on == f"onnxruntime {encoder.provider} (device 'cpu' asked)"
    assert encoder.provider == "CPUExecutionProvider"
    long = "word " * (encoder.max_length + 50)
    (short_tokens, short_cut), (long_tokens, long_cut) = encoder.cuts(["a short message", long])
    assert (short_cut, long_tokens) == (None, encoder.max_length)
    assert 3 < short_tokens < 10
    assert long_cut == f"encoder read the first {encoder.max_length} tokens (max_length); the rest was cut"


def test_auto_device_records_the_provider_it_got() -> None:
    auto = Encoder(device="auto", threads=1)
    assert auto.provider in ("CUDAExecutionProvider", "CPUExecutionProvider")
    assert f"onnxruntime {auto.provider} (device 'auto' asked)" == auto.ran_on


def test_placements_layer_given_over_bundle_defaults() -> None:
    bundle_default = Placement(gpu_layers=20, n_ctx=2048)
    given = Placement(gpu_layers=99)
    assert given.over(bundle_default) == Placement(gpu_layers=99, n_ctx=2048)
    assert Placement().over(bundle_default) == bundle_default
    per_tier = {"teacher": given}
    assert for_tier(per_tier, "teacher") == given and for_tier(per_tier, "small") is None
    assert for_tier(given, "small") == given and for_tier(None, "small") is None


def test_cli_score_refuses_gpu_layers_on_a_cpu_build(tmp_path: Path) -> None:
    if llama_cpp.llama_supports_gpu_offload():
        pytest.skip("this build can offload to a GPU")
    request = tmp_path / "req.json"
    request.write_text(json.dumps({"state": "hi",
                                   "questions": {"q": {"type": "noul", "instructions": "Hi?"}}}))
    result = subprocess.run([sys.executable, "-m", "distill.cli", "score", "--request", str(request),
                             "--gpu-layers", "99"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "ModelError: 99 GPU layers asked, but this llama-cpp-python build has no GPU offload" \
        in result.stderr


GUARDED = """
import llama_cpp
from cascade.readout.llama import LlamaModel, default_gguf_path


def test_forced_in_process():
    LlamaModel(default_gguf_path(), extra_buffers="force").close()


def test_raw_default_params():
    model = llama_cpp.llama_model_load_from_file(str(default_gguf_path()).encode(),
                                                 llama_cpp.llama_model_default_params())
    llama_cpp.llama_model_free(model)


def test_policy_default():
    LlamaModel(default_gguf_path()).close()
"""


def test_the_guard_fails_a_test_that_forces_extra_buffers_in_the_suite_process(tmp_path: Path) -> None:
    """tests/buffer_guard.py, run on three tests of its own in a child pytest (no decode: no crash)."""
    (tmp_path / "test_guarded.py").write_text(GUARDED)
    tests = Path(__file__).resolve().parent
    env = {k: v for k, v in os.environ.items() if k != EXTRA_BUFFERS_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(tests), str(tests.parent), env.get("PYTHONPATH", "")])
    child = subprocess.run([sys.executable, "-m", "pytest", "-p", "buffer_guard", "-q", "-rA",
                            "-p", "no:cacheprovider", str(tmp_path)],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert child.returncode == 1, child.stdout + child.stderr
    lines = child.stdout.splitlines()
    assert any(line.startswith("PASSED") and "test_policy_default" in line for line in lines)
    for name, why in (("test_forced_in_process", "extra buffers forced (asked)"),
                      ("test_raw_default_params", "outside cascade's placement policy")):
        assert any(line.startswith("ERROR") and name in line for line in lines), child.stdout
        assert why in child.stdout


def test_the_threads_default_counts_other_processes_busy_now_not_this_ones_or_finished_ones() -> None:
    """The 1-minute load average counted this program's own earlier steps and processes that had
    ended (the demo's gemma then always loaded on 1 thread of 2): what counts is the cores other
    processes keep busy while a model loads."""
    import subprocess
    import sys
    import threading

    from cascade.readout.placement import busy_elsewhere, default_threads

    quiet = busy_elsewhere(0.3)
    assert quiet is not None  # Linux: /proc/stat
    if quiet > (os.cpu_count() or 1) - 1:  # a neighbour would find no core to take
        pytest.skip(f"other processes keep {quiet:.1f} cores busy: no idle core to measure a neighbour on")
    spinning = threading.Event()

    def spin() -> None:  # this process's own work, as a training step before the load
        while not spinning.is_set():
            pass

    own = threading.Thread(target=spin)
    own.start()
    try:
        while_own = busy_elsewhere(0.3)
    finally:
        spinning.set()
        own.join()
    neighbour = subprocess.Popen([sys.executable, "-c", "while True:\n    pass\n"])
    try:
        with_neighbour = busy_elsewhere(0.3)
    finally:
        neighbour.kill()
        neighbour.wait()
    after = busy_elsewhere(0.3)
    assert while_own is not None and with_neighbour is not None and after is not None
    assert with_neighbour - quiet > 0.5 and with_neighbour - after > 0.5  # a busy core counts, then not
    assert abs(while_own - quiet) < 0.5  # its own work does not
    threads, why = default_threads()
    assert 1 <= threads <= (os.cpu_count() or 1) and "busy with other processes" in why


def test_more_threads_than_cpus_are_refused_in_one_line_by_both_runtimes(gemma_path: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    """100,000 threads held `cascade decide` for minutes (ONNX Runtime made them all before its
    first answer); more threads than CPUs never speed a pass, so both runtimes refuse them."""
    from distill.cli import main

    over = (os.cpu_count() or 1) + 1
    with pytest.raises(ModelError, match=rf"threads {over} is more than this machine's {over - 1} CPUs"):
        Encoder(threads=over)
    with pytest.raises(ModelError, match=rf"gemma.*: threads {over} is more than this machine's"):
        Scorer(gemma_path, n_ctx=512, max_branches=2, n_threads=over)
    assert Encoder(threads=over - 1).dim > 0
    state = tmp_path / "s.json"
    question = {"type": "noul", "instructions": "Urgent?"}
    state.write_text(json.dumps({"state": "hi", "questions": {"u": question}}))
    assert main(["score", "--model", str(gemma_path), "--request", str(state), "--threads", "100000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "threads 100000 is more than this machine's" in err[0], err
