"""The `blink` command line as an operator uses it: serve, generate, info, stats; `blink serve`
restarts a crashed engine while its front end keeps serving."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import children
from test_serving_behaviour import wait_for

from blink.client.sdk import BlinkClient
from blink.ring.lifecycle import RING_NAME_MAX_BYTES, claim_ring

pytestmark = pytest.mark.slow


def blink(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "blink.client.cli", *args], capture_output=True,
                          text=True, timeout=120, **kw)


def test_auto_engine_choice(monkeypatch):
    """auto picks cuda exactly when cuda-python imports, a GPU is usable and nvcc is found;
    an explicit choice is kept. The CUDA runtime module is replaced by fakes, so the rule is
    checked on every machine (not re-derived from the same calls)."""
    import types

    from blink.client.cli import choose_engine

    def runtime(reason, nvcc, capability=(9, 0)):
        fake = types.ModuleType("blink.gpu_engine.cuda_runtime")
        fake.gpu_unusable_reason = lambda: reason
        fake.nvcc_path = lambda: nvcc
        fake.device_attribute = lambda name, device=0: capability[
            ("COMPUTE_CAPABILITY_MAJOR", "COMPUTE_CAPABILITY_MINOR").index(name)]
        monkeypatch.setitem(sys.modules, "blink.gpu_engine.cuda_runtime", fake)

    runtime(None, "/usr/local/cuda/bin/nvcc")
    assert choose_engine("auto") == "cuda"
    for other in ((8, 0), (8, 9), (10, 0)):  # the kernels are Hopper's (sm_90a)
        runtime(None, "/usr/local/cuda/bin/nvcc", other)
        assert choose_engine("auto") == "cpu"
    runtime(None, "/usr/local/cuda/bin/nvcc")
    assert choose_engine("cpu") == "cpu" and choose_engine("hf") == "hf"
    runtime("no CUDA device", "/usr/local/cuda/bin/nvcc")
    assert choose_engine("auto") == "cpu"
    runtime(None, None)
    assert choose_engine("auto") == "cpu"
    monkeypatch.setitem(sys.modules, "blink.gpu_engine.cuda_runtime", None)  # import fails
    assert choose_engine("auto") == "cpu"
    assert choose_engine("cuda") == "cuda"


def test_the_cuda_engines_start_up_check_on_a_faked_gpu(checkpoints, monkeypatch):
    """cmd_engine's check for the CUDA engines (_for_this_gpu), which only a GPU machine
    reaches, with the CUDA runtime faked as an H200: the test checkpoint passes, flags its
    scheduler kernel cannot hold stop in one line, a GPU of another compute capability too."""
    import types

    from blink.client.cli import _for_this_gpu
    from blink.gpu_engine.reference_engine import EngineConfig

    def gpu(capability):
        fake = types.ModuleType("blink.gpu_engine.cuda_runtime")
        fake.gpu_unusable_reason = lambda: None
        fake.device_attribute = lambda name, device=0: {
            "COMPUTE_CAPABILITY_MAJOR": capability[0],
            "COMPUTE_CAPABILITY_MINOR": capability[1], "MULTIPROCESSOR_COUNT": 132}[name]
        monkeypatch.setitem(sys.modules, "blink.gpu_engine.cuda_runtime", fake)

    config = EngineConfig(model_dir=checkpoints["llama"], ring_name="x", max_num_seqs=256)
    gpu((9, 0))
    assert _for_this_gpu(config, "cuda") == config
    for kind, changed, said in (("cuda", dict(max_num_seqs=512), "--max-num-seqs 512"),
                                ("cuda", dict(num_slots=4096), "--slots 4096"),
                                ("host-cuda", dict(sm_count_target=200),
                                 "--sm-count-target 200: this GPU has 132 SMs")):
        with pytest.raises(SystemExit, match=f"blink engine: {said}"):
            _for_this_gpu(dataclasses.replace(config, **changed), kind)
    gpu((8, 9))
    with pytest.raises(SystemExit, match="need compute capability 9.0"):
        _for_this_gpu(config, "cuda")


def test_the_cuda_engines_where_they_cannot_run_are_one_line(checkpoints):
    """--engine cuda or host-cuda without cuda-python or a usable GPU: one line, not a
    traceback (where both are there, the GPU's own checks are engine_layout's, tested in
    test_engine_layout)."""
    from gpu import gpu_skip_reason
    if gpu_skip_reason() is None:
        pytest.skip("this machine can run the CUDA engines")
    for kind in ("cuda", "host-cuda"):
        out = blink("engine", "--engine", kind, "--model", str(checkpoints["llama"]),
                    "--ring-name", f"blink-test-nogpu-{os.getpid()}")
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.startswith(f"blink engine: --engine {kind}") and \
            out.stderr.count("\n") == 1, out.stderr


def test_a_flag_cut_short_is_refused_and_help_says_each_default_once(capsys):
    """argparse took a unique prefix of a flag (--metrics-p 9400 was --metrics-port), so a
    mistyped flag could pass deploy/README.md's check of every command line, and `blink
    frontend --engine cpu` failed as "--engine-timeout: 'cpu' is not a number of seconds".
    --help said "(default: True)" after --no-prefix-caching (read as off by default) and a
    default twice where the help gives it in words."""
    from blink.client.cli import build_parser
    for argv in (["frontend", "--metrics-p", "9400"], ["serve", "--no-prefix"],
                 ["frontend", "--engine", "cpu"], ["serve", "--max-batched", "1024"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        assert f"unrecognized arguments: {argv[1]}" in capsys.readouterr().err, argv
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # (its lines folded)
    assert "(default: True)" not in text and "(default: False)" not in text
    assert "the built-in demo model) (default" not in text
    assert "--max-num-seqs MAX_NUM_SEQS sequences per step at most (default: 64)" in text


def test_fewer_slots_than_sequences_is_warned(tmp_path):
    """A request holds a ring slot while it runs: --slots below --max-num-seqs caps the batch
    at the slots, which the operator is told (the Kubernetes layout ran 128 of its 256)."""
    out = blink("serve", "--slots", "2", "--max-num-seqs", "8", "--model", str(tmp_path))
    assert "--slots 2 is below --max-num-seqs 8" in out.stderr and out.returncode != 0
    out = blink("serve", "--slots", "8", "--max-num-seqs", "8", "--model", str(tmp_path))
    assert "warning" not in out.stderr and out.returncode != 0  # (no config.json there)


def test_a_cpu_kv_cache_past_the_host_s_memory_is_one_line_and_a_short_one_is_warned(
        checkpoints, caplog):
    """The CPU engine's KV cache is float32 in host memory: --num-kv-blocks past what the host
    has is one line (it was NumPy's out-of-memory traceback, or, where the address space took
    it, a start that the kernel would kill once the cache filled); one smaller than a sequence
    of the served context is said at start-up (longer requests were each refused, silently)."""
    import logging
    import secrets

    from blink.gpu_engine.reference_engine import EngineConfig, ReferenceEngine
    out = blink("engine", "--engine", "cpu", "--model", str(checkpoints["llama"]),
                "--num-kv-blocks", str(10 ** 12), "--ring-name", "blink-test-too-large")
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert re.search(r"blink engine: 1000000000000 KV blocks need \d+ MiB of host memory; \d+ "
                     r"MiB is available, room for \d+ blocks \(--num-kv-blocks, --kv-cache-mb\)$",
                     out.stderr.strip()), out.stderr
    with caplog.at_level(logging.WARNING, logger="blink.engine"):
        engine = ReferenceEngine(EngineConfig(model_dir=checkpoints["llama"], num_kv_blocks=2,
                                              ring_name=f"blink-test-{secrets.token_hex(6)}"))
    try:
        assert "the KV cache holds 32 tokens (2 blocks of 16), fewer than the context of" \
            in caplog.text
    finally:
        engine.close()


def test_a_gpu_call_that_fails_as_the_engine_starts_is_one_line(checkpoints, monkeypatch):
    """A CUDA or cuBLAS call that fails in the engine (weights past the GPU's memory: cuMemAlloc
    out of memory; pinned memory refused) ends it in one line naming the driver's error, as a
    KV cache too large does (CudaError and CublasError were tracebacks); here the engine's run
    raises cuBLAS's error, the GPU faked."""
    from blink.client import cli
    from blink.gpu_engine import reference_engine
    from blink.gpu_engine.cublas import CublasError

    def fails(*args, **kwargs):
        raise CublasError("cublasLtMatmulAlgoGetHeuristic failed: status 7")
    monkeypatch.setattr(reference_engine, "run_engine", fails)
    args = cli.build_parser().parse_args(["engine", "--engine", "cpu", "--model",
                                          str(checkpoints["llama"]), "--ring-name", "x"])
    with pytest.raises(SystemExit, match=r"^blink engine: cublasLtMatmulAlgoGetHeuristic failed: "
                                         r"status 7$"):
        cli.cmd_engine(args)


def test_flags_that_cannot_serve_are_refused_at_start(tmp_path):
    """Flag values that would start a server that cannot serve are one line and a non-zero status
    before anything starts: more front-end workers than slots (a worker with no share never
    attached: its connections hung, then failed UNAVAILABLE), an engine timeout of 0 (the front
    end detached and reattached over and over) and a request limit of 0 (every request refused)."""
    for flags, says in ((["--workers", "4", "--slots", "2"], "--workers 4 needs --slots >= 4"),
                        (["--engine-timeout", "0"], "not a number of seconds > 0"),
                        (["--max-request-mb", "0"], "not a size in MB > 0"),
                        (["--max-request-mb", "nan"], "not a size in MB > 0")):
        out = blink("serve", *flags, "--model", str(tmp_path))
        assert out.returncode != 0 and says in out.stderr, (flags, out.stderr)
        assert "Traceback" not in out.stderr, out.stderr


def test_a_ring_name_that_cannot_be_a_ring_is_refused_in_one_line(tmp_path):
    """A ring name with a '/' (a path under /dev/shm) or one too long for the claim's socket
    address (92 bytes) was a traceback from deep in the start-up, after the model had loaded."""
    longest = "r" * RING_NAME_MAX_BYTES
    claim_ring(longest, "frontend").close()  # the limit is the socket's own
    for command in ("serve", "engine", "frontend"):
        for name, says in (("a/b", "not a ring name"), (".hidden", "not a ring name"),
                           (longest + "r", "a ring name has at most 92")):
            out = blink(command, "--ring-name", name, "--model", str(tmp_path))
            assert out.returncode == 2, (command, name, out.stderr)
            assert "error: argument --ring-name: " in out.stderr and says in out.stderr
            assert "Traceback" not in out.stderr, out.stderr


def test_dummy_weights_need_the_cuda_engine(checkpoints):
    out = blink("engine", "--model", str(checkpoints["llama"]), "--engine", "cpu",
                "--load-format", "dummy", "--ring-name", f"blink-test-dummy-{os.getpid()}")
    assert out.returncode != 0
    assert "--load-format dummy needs the cuda, host-cuda or hf engine" in out.stderr


@contextlib.contextmanager
def serving(tmp_path, model, *flags: str):
    """`blink serve` of `model` with `flags` on a free port: (its process, its target); stopped
    with SIGTERM after the block, which it must survive to exit 0."""
    ready, log = tmp_path / "port", open(tmp_path / "serve.log", "w")
    serve = subprocess.Popen(
        [sys.executable, "-m", "blink.client.cli", "serve", "--model", str(model),
         "--port", "0", "--ready-file", str(ready), *flags],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (ready.exists() and ready.read_text()):
            assert serve.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "serve.log").read_text()
            time.sleep(0.05)
        yield serve, f"127.0.0.1:{ready.read_text()}"
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(20)
        log.close()
    assert serve.returncode == 0


def test_serve_generate_and_engine_restart(checkpoints, tmp_path):
    with serving(tmp_path, checkpoints["llama"], "--engine", "cpu",
                 "--engine-timeout", "1") as (serve, target):
        out = blink("generate", "--target", target, "--max-tokens", "8", "--temperature", "0",
                    "--ignore-eos", "Hello")
        assert out.returncode == 0, out.stderr
        assert "[length; 2 prompt + 8 generated tokens" in out.stderr
        info = blink("info", "--target", target)
        described = json.loads(info.stdout)
        assert (described["name"], described["engine"]) == ("llama", "cpu-reference")
        assert described["eos_token_ids"] == [1, 2] and described["has_chat_template"]
        stats = json.loads(blink("stats", "--target", target).stdout)
        assert stats["requests_finished"] == 1 and stats["engine_attachments"] == 1
        # the engine's own step counters: one prefill step (2 tokens), then 7 decode steps
        # (the 8th token is sampled, never fed back)
        assert (stats["engine_steps"], stats["engine_step_tokens"]) == (8, 2 + 7)
        assert stats["engine_busy_ns"] > 0
        # a long prompt's full blocks come from the cache when its salt's requests left them
        cached = [re.search(r"prompt( \((\d+) from the prefix cache\))? \+",
                            blink("generate", "--target", target, "--max-tokens", "1",
                                  "--cache-salt", salt, "Hello world " * 12).stderr).group(2)
                  for salt in ("s1", "s1", "s2")]
        assert cached[0] is None and int(cached[1]) >= 16 and cached[2] is None, cached

        (engine,) = children(serve.pid)
        os.kill(engine, signal.SIGKILL)
        with BlinkClient(target) as client:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # down, then the supervisor's new engine attaches
                if client.stats()["engine_attachments"] == 2 and client.health() == "SERVING":
                    break
                time.sleep(0.1)
            assert client.stats()["engine_attachments"] == 2
            assert children(serve.pid) != [engine]
            assert client.generate("after restart").completion_tokens > 0


def test_generate_stops_on_ctrl_c_and_cancels_in_the_server(checkpoints, tmp_path):
    """Ctrl-C in `blink generate` mid-stream: exit status 130 and no traceback, and the server
    ends the request as cancelled (not left generating its 400 tokens)."""
    with serving(tmp_path, checkpoints["llama"], "--engine", "synthetic",
                 "--synthetic-step-ms", "20") as (_, target):
        # a shell's background job inherits SIGINT ignored, which Python then keeps (and exec
        # passes on): the child gets a SIGINT it can receive however pytest was started
        ignored = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            gen = subprocess.Popen([sys.executable, "-m", "blink.client.cli", "generate",
                                    "--target", target, "--max-tokens", "400", "--ignore-eos",
                                    "Hello"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        finally:
            signal.signal(signal.SIGINT, ignored)
        assert gen.stdout.read(1)  # streaming
        gen.send_signal(signal.SIGINT)
        _, err = gen.communicate(timeout=10)
        assert gen.returncode == 128 + signal.SIGINT and "Traceback" not in err, err
        with BlinkClient(target) as client:
            wait_for(lambda: client.stats()["requests_cancelled"] == 1, timeout=5, interval=0.02)
            stats = client.stats()
        assert (stats["requests_cancelled"], stats["requests_finished"]) == (1, 0)
        assert stats["tokens_generated"] < 400


def test_generate_into_a_closed_pipe_ends_quietly_and_cancels(checkpoints, tmp_path):
    """`blink generate ... | head -c1`: the reader goes away mid-stream; the command ends with
    SIGPIPE's status and no traceback (it printed BrokenPipeError's), and the server ends the
    request as cancelled; `blink stats | true` too."""
    with serving(tmp_path, checkpoints["llama"], "--engine", "synthetic",
                 "--synthetic-step-ms", "20") as (_, target):
        gen = subprocess.Popen([sys.executable, "-m", "blink.client.cli", "generate",
                                "--target", target, "--max-tokens", "400", "--ignore-eos",
                                "Hello"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert gen.stdout.read(1)  # streaming
        gen.stdout.close()
        err = gen.stderr.read().decode()
        assert gen.wait(timeout=30) == 128 + signal.SIGPIPE and "Traceback" not in err, err
        with BlinkClient(target) as client:
            wait_for(lambda: client.stats()["requests_cancelled"] == 1, timeout=5, interval=0.02)
            assert client.stats()["tokens_generated"] < 400
        # a command whose whole output is buffered (stats: the write fails at the flush, once
        # the command is done), without PYTHONUNBUFFERED
        env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        stats = subprocess.Popen([sys.executable, "-m", "blink.client.cli", "stats", "--target",
                                  target], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 env=env)
        stats.stdout.close()
        err = stats.stderr.read().decode()
        assert stats.wait(timeout=30) == 128 + signal.SIGPIPE and "Exception" not in err, err


def test_client_commands_end_in_one_line_on_bad_numbers_and_a_taken_port(checkpoints, tmp_path):
    """`blink generate --max-tokens -1` and `blink openai` on a port in use: one line and a
    non-zero status, no traceback (both printed one)."""
    pytest.importorskip("aiohttp", reason="the openai extra (aiohttp) is not installed")
    with serving(tmp_path, checkpoints["llama"], "--engine", "synthetic") as (_, target):
        for flag in ("--max-tokens", "--seed", "--top-k"):
            out = blink("generate", "--target", target, flag, "-1", "Hello")
            assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
            assert "out of range" in out.stderr
        port = target.rsplit(":", 1)[1]
        out = blink("openai", "--target", target, "--host", "127.0.0.1", "--port", port)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.startswith("blink openai:") and "in use" in out.stderr


def test_front_end_worker_restarts_back_off_while_it_keeps_failing(tmp_path):
    """A front-end worker that dies is started again: at once after a long run, else after a
    wait that doubles per quick failure up to RESTART_MAX_WAIT_S (one that cannot start used
    to be restarted twice a second for ever), back to short once one runs long."""
    from blink.client.cli import FrontendWorkers
    workers = FrontendWorkers(args=None, model_dir=tmp_path)
    clock = {"now": 0.0, "lifetime": 0.0}
    spawns = []

    class Process:
        exitcode = 1

        def __init__(self):
            self.dies_at = clock["now"] + clock["lifetime"]

        def is_alive(self):
            return clock["now"] < self.dies_at

    def spawn(index):
        spawns.append(clock["now"])
        workers.procs[index], workers.started[index] = Process(), clock["now"]

    def watch_until(t):  # the watcher's 0.5 s ticks
        while clock["now"] < t:
            clock["now"] += 0.5
            workers._restart_if_dead(1, clock["now"])
    workers._spawn = spawn
    spawn(1)
    watch_until(120)  # the worker dies as soon as it starts
    waits = [b - a for a, b in zip(spawns, spawns[1:])]
    assert waits[:7] == [1.0, 1.5, 2.5, 4.5, 8.5, 16.5, 30.5]  # the wait, and a tick to see it
    assert set(waits[6:]) == {30.5}
    clock["lifetime"] = 40.0  # the next start runs long, then dies: restarted at the next tick
    watch_until(spawns[-1] + 30.5)
    long_run = spawns[-1]
    clock["lifetime"] = 0.0
    watch_until(long_run + 43)
    # seen dead at 40: at once; then quick failures again, from the shortest wait
    assert [t - long_run for t in spawns if t > long_run] == [40.0, 41.0, 42.5]


def test_gemm_split_k_flag_reaches_the_engine(tmp_path):
    """--gemm-split-k (off by default) travels from `blink serve` to the engine's config."""
    from blink.client.cli import _engine_argv, _engine_config, build_parser
    parser = build_parser()
    off = parser.parse_args(["serve", "--ring-name", "r", "--model", str(tmp_path)])
    assert _engine_config(off, tmp_path).gemm_split_k is False
    assert "--gemm-split-k" not in _engine_argv(off, tmp_path)
    argv = _engine_argv(parser.parse_args(["serve", "--ring-name", "r", "--model",
                                           str(tmp_path), "--gemm-split-k"]), tmp_path)
    engine = parser.parse_args(argv[argv.index("engine"):])
    assert _engine_config(engine, tmp_path).gemm_split_k is True


def test_fine_buckets_flag_reaches_the_engine(tmp_path, capsys):
    """--fine-buckets-from travels from `blink serve` to the engine's config (128 by default);
    a count below 4 is refused by the parser."""
    from blink.client.cli import _engine_argv, _engine_config, build_parser
    parser = build_parser()
    default = parser.parse_args(["serve", "--ring-name", "r", "--model", str(tmp_path)])
    assert _engine_config(default, tmp_path).fine_buckets_from == 128
    argv = _engine_argv(parser.parse_args(["serve", "--ring-name", "r", "--model", str(tmp_path),
                                           "--fine-buckets-from", "64"]), tmp_path)
    engine = parser.parse_args(argv[argv.index("engine"):])
    assert _engine_config(engine, tmp_path).fine_buckets_from == 64
    for bad in ("3", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--model", str(tmp_path), "--fine-buckets-from", bad])
        assert "is not a token count of at least 4" in capsys.readouterr().err


@pytest.mark.parametrize("flag,field,value,default", [
    ("--no-gemm-tuning", "gemm_tuning", False, True),
    ("--no-decode-weight-copy", "decode_weight_copy", False, True),
    ("--no-fp8-lm-head", "fp8_lm_head", False, None),  # None: as the weights come
    ("--fp8-lm-head", "fp8_lm_head", True, None),
    ("--no-fp8-fast-accum", "fp8_fast_accum", False, True)])
def test_engine_on_off_flags_reach_the_engine(tmp_path, flag, field, value, default):
    """--no-gemm-tuning, --no-decode-weight-copy, --[no-]fp8-lm-head, --no-fp8-fast-accum:
    `blink serve` passes each to the engine process it starts, and the engine's config takes
    it; without the flag, neither passes it nor changes the engine's default."""
    from blink.client.cli import _engine_argv, _engine_config, build_parser
    parser = build_parser()
    unset = parser.parse_args(["serve", "--ring-name", "r", "--model", str(tmp_path)])
    given = parser.parse_args(["serve", "--ring-name", "r", "--model", str(tmp_path), flag])
    assert getattr(_engine_config(unset, tmp_path), field) is default
    assert not {"--fp8-lm-head", "--no-fp8-lm-head", flag} & set(_engine_argv(unset, tmp_path))
    argv = _engine_argv(given, tmp_path)
    assert flag in argv
    engine = parser.parse_args(argv[argv.index("engine"):])
    assert getattr(_engine_config(engine, tmp_path), field) is value
