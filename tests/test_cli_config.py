"""`blink serve`/`engine`/`frontend`'s flag checks and the configs the flags become, against
the documented bounds and defaults (README's Configuration table, the CLI's --help).

In-process: the parser, _check_engine_args, _engine_argv, _engine_config and _frontend_config
are called directly, so nothing starts."""
from __future__ import annotations

import pytest

from blink.client import cli


def _parse(*argv: str):
    return cli.build_parser().parse_args(list(argv))


def _serve(tmp_path, *flags: str):
    return _parse("serve", "--ring-name", "r", "--model", str(tmp_path), *flags)


# --- _check_engine_args: what must be refused, and the smallest values that must be taken ---

@pytest.mark.parametrize("flags, says", [
    (["--max-batched-tokens", "0"], "--max-batched-tokens must be >= 1"),
    (["--block-size", "0"], "--block-size must be >= 1"),
    (["--num-kv-blocks", "0"], "--num-kv-blocks must be >= 1"),
    (["--kv-cache-mb", "0"], "--kv-cache-mb must be >= 1"),
    (["--max-model-len", "1"], "--max-model-len must be >= 2"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be in (0, 1]"),
    (["--gpu-memory-utilization", "1.01"], "--gpu-memory-utilization must be in (0, 1]"),
    (["--sm-count-target", "-1"], "--sm-count-target must be >= 0"),
])
def test_engine_flags_out_of_range_are_refused_in_one_line(tmp_path, flags, says):
    with pytest.raises(SystemExit) as e:
        cli._check_engine_args(_serve(tmp_path, *flags))
    assert str(e.value).startswith("blink: ") and says in str(e.value)


@pytest.mark.parametrize("flags", [
    ["--max-batched-tokens", "1"], ["--block-size", "1"], ["--num-kv-blocks", "1"],
    ["--kv-cache-mb", "1"], ["--max-model-len", "2"],
    ["--gpu-memory-utilization", "1"],   # (0, 1]: a whole GPU is allowed
    ["--gpu-memory-utilization", "1e-3"],
    ["--sm-count-target", "0"],          # 0: every SM (README, --help)
    ["--slots", "1", "--max-num-seqs", "1"],
])
def test_the_smallest_documented_engine_values_are_taken(tmp_path, capsys, flags):
    cli._check_engine_args(_serve(tmp_path, *flags))  # no SystemExit
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("flags, says", [
    (["--engine", "cpu", "--hf-static-cache"], "--hf-static-cache is an option of --engine hf"),
    (["--engine", "synthetic", "--quantization", "fp8"], "--quantization fp8: an option of"),
    (["--engine", "hf", "--quantization", "fp8"], "--quantization fp8: an option of"),
    (["--engine", "hf", "--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8: an option of"),
    (["--engine", "synthetic", "--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8: an option of"),
    (["--engine", "cpu", "--step-log", "LOG"], "--step-log is an option of the cuda engine"),
])
def test_options_of_other_engines_are_refused_before_anything_starts(tmp_path, flags, says):
    """`blink serve` checks these itself: its engine process would refuse them only after the
    front end had started (and serve then ends as an engine that never came up)."""
    flags = [str(tmp_path / "log") if f == "LOG" else f for f in flags]
    with pytest.raises(SystemExit) as e:
        cli._check_engine_args(_serve(tmp_path, *flags))
    assert says in str(e.value)


@pytest.mark.parametrize("flags", [
    ["--engine", "hf"], ["--engine", "hf", "--hf-static-cache"], ["--engine", "synthetic"],
    ["--engine", "hf", "--quantization", "none"],
    ["--engine", "cpu", "--quantization", "fp8", "--kv-cache-dtype", "fp8"],
    ["--engine", "host-cuda", "--kv-cache-dtype", "fp8"],
])
def test_each_engine_s_own_options_are_taken(tmp_path, flags):
    cli._check_engine_args(_serve(tmp_path, *flags))


def test_as_many_workers_as_slots_is_taken(tmp_path):
    """README: `blink serve` refuses more workers than --slots: as many is fine (each worker gets
    one slot). The check passes, and the command ends at the empty model folder instead."""
    for workers, slots, says in ((2, 2, "no config.json"),
                                 (3, 2, "--workers 3 needs --slots >= 3")):
        args = _parse("serve", "--model", str(tmp_path), "--workers", str(workers), "--slots",
                      str(slots), "--max-num-seqs", "1")
        with pytest.raises(SystemExit) as e:
            cli.cmd_serve(args)
        assert says in str(e.value), (workers, slots, str(e.value))


# --- serve -> the engine's command line -> the engine's config ----------------------------------

def _through_the_engine(tmp_path, *flags: str):
    """serve's args with flags, the engine command line serve builds from them, re-parsed as the
    engine process parses it, and that engine's config."""
    argv = cli._engine_argv(_serve(tmp_path, *flags), tmp_path)
    engine = _parse(*argv[argv.index("engine"):])
    return engine, cli._engine_config(engine, tmp_path)


def test_the_documented_engine_defaults_reach_the_engine(tmp_path):
    engine, config = _through_the_engine(tmp_path)
    assert engine.gpu_memory_utilization == 0.9
    assert config.kv_cache_bytes == 256 << 20  # README: 256 MiB
    assert (config.num_slots, config.block_size, config.max_num_seqs,
            config.max_num_batched_tokens) == (128, 16, 64, 512)
    assert (config.num_kv_blocks, config.max_model_len, config.quantization,
            config.fp8_lm_head, config.kv_cache_dtype) == (None, None, None, None, "auto")
    assert config.prefix_caching is True and config.sm_count_target is None


def test_every_engine_flag_of_serve_reaches_the_engine_s_config(tmp_path):
    engine, config = _through_the_engine(
        tmp_path, "--slots", "7", "--block-size", "8", "--kv-cache-mb", "3",
        "--num-kv-blocks", "11", "--max-num-seqs", "5", "--max-batched-tokens", "33",
        "--max-model-len", "99", "--gpu-memory-utilization", "0.5", "--quantization", "fp8",
        "--kv-cache-dtype", "fp8", "--no-prefix-caching", "--sm-count-target", "20")
    assert engine.gpu_memory_utilization == 0.5
    assert (config.num_slots, config.block_size, config.kv_cache_bytes, config.num_kv_blocks,
            config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len) == \
        (7, 8, 3 << 20, 11, 5, 33, 99)
    assert (config.quantization, config.kv_cache_dtype, config.prefix_caching,
            config.sm_count_target) == ("fp8", "fp8", False, 20)
    assert config.ring_name == "r"


def test_quantization_none_and_sm_count_target_0_reach_the_engine(tmp_path):
    """`--quantization none` (an FP8 checkpoint's values in bf16) and `--sm-count-target 0`
    (every SM) are values of their own, not the flag left out."""
    _, config = _through_the_engine(tmp_path, "--quantization", "none",
                                    "--sm-count-target", "0")
    assert config.quantization == "none" and config.sm_count_target == 0


# --- the front end's config ---------------------------------------------------------------------

def _frontend(tmp_path, *flags: str):
    return cli._frontend_config(_parse("frontend", "--ring-name", "r", "--model", str(tmp_path),
                                       *flags), tmp_path)


def test_the_front_end_s_units_and_defaults(tmp_path):
    config = _frontend(tmp_path)
    assert config.max_request_bytes == 4 << 20  # 4 MiB: gRPC's limit is twice that + 1 MiB
    assert (config.stream_interval_s, config.poll_interval_s) == (0.0, 200e-6)
    assert (config.keepalive_time_s, config.max_connection_age_s,
            config.max_connection_age_grace_s) == (60.0, None, None)
    config = _frontend(tmp_path, "--stream-interval-ms", "20", "--poll-interval-us", "500",
                       "--max-request-mb", "0.5", "--keepalive-time", "15",
                       "--max-connection-age", "100", "--max-connection-age-grace", "7")
    assert config.stream_interval_s == pytest.approx(0.020)
    assert config.poll_interval_s == pytest.approx(500e-6)
    assert config.max_request_bytes == 1 << 19
    assert (config.keepalive_time_s, config.max_connection_age_s,
            config.max_connection_age_grace_s) == (15.0, 100.0, 7.0)


@pytest.mark.parametrize("flags", [["--tls-cert", "C"], ["--tls-key", "K"],
                                   ["--tls-client-ca", "CA"],
                                   ["--tls-key", "K", "--tls-client-ca", "CA"]])
def test_tls_files_go_together(tmp_path, flags):
    """--tls-cert needs --tls-key and the reverse, and --tls-client-ca needs both: one line,
    before any file is read (none of these exist)."""
    flags = [str(tmp_path / f) if f in ("C", "K", "CA") else f for f in flags]
    with pytest.raises(SystemExit) as e:
        _frontend(tmp_path, *flags)
    assert str(e.value) == ("blink: TLS needs --tls-cert and --tls-key (and --tls-client-ca "
                            "only with them)")


def test_the_auth_token_s_bounds(tmp_path):
    """README: one line of printable ASCII, at most 4,096 characters, whitespace around it
    ignored."""
    token = tmp_path / "token"
    token.write_text("x" * cli.MAX_TOKEN_CHARS + "\n")
    assert cli.MAX_TOKEN_CHARS == 4096
    assert cli._auth_token(token) == "x" * 4096
    token.write_text("x" * 4097)
    with pytest.raises(SystemExit, match="at most 4096 characters"):
        cli._auth_token(token)
    token.write_text("  \t s3cret-token \r\n")
    assert cli._auth_token(token) == "s3cret-token"
    assert _frontend(tmp_path, "--auth-token-file", str(token)).auth_token == "s3cret-token"
    for bad in (b"a\tb", b"a b\x7f", b"tok1\ntok2"):
        token.write_bytes(bad)
        with pytest.raises(SystemExit, match="one line of printable ASCII"):
            cli._auth_token(token)
    token.write_bytes(b"has space")  # a space is printable: taken as written
    assert cli._auth_token(token) == "has space"


@pytest.mark.parametrize("flag, value, parsed", [
    ("--stream-interval-ms", "10000", 10000.0), ("--stream-interval-ms", "0", 0.0),
    ("--poll-interval-us", "1000000", 1e6), ("--max-queued", "0", 0),
    ("--queue-timeout", "0", 0.0), ("--keepalive-time", "1e9", 1e9),
])
def test_front_end_numbers_at_their_bounds_are_taken(tmp_path, flag, value, parsed):
    args = _parse("frontend", "--model", str(tmp_path), flag, value)
    assert getattr(args, flag[2:].replace("-", "_")) == parsed


@pytest.mark.parametrize("flag, value, says", [
    ("--stream-interval-ms", "10000.5", "is not a number of milliseconds from 0 to 10000"),
    ("--queue-timeout", "inf", "is not a number of seconds >= 0"),
    ("--keepalive-time", "inf", "is not a number of seconds >= 0"),
    ("--shutdown-timeout", "inf", "is not a number of seconds >= 0"),
    ("--engine-timeout", "inf", "is not a number of seconds > 0"),
    ("--max-request-mb", "inf", "is not a size in MB > 0"),
    ("--max-queued", "-1", "is not a whole number >= 0"),
])
def test_front_end_numbers_past_their_bounds_are_refused(tmp_path, capsys, flag, value, says):
    with pytest.raises(SystemExit) as e:
        _parse("frontend", "--model", str(tmp_path), flag, value)
    assert e.value.code == 2
    assert f"argument {flag}: '{value}' {says}" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_synthetic_step_that_is_not_a_duration_is_refused(tmp_path, capsys, value):
    """-1, nan and inf were taken, and the synthetic engine's first step raised in time.sleep,
    crashing the engine at every restart (each request UNAVAILABLE)."""
    with pytest.raises(SystemExit) as e:
        _serve(tmp_path, "--engine", "synthetic", "--synthetic-step-ms", value)
    assert e.value.code == 2
    assert (f"argument --synthetic-step-ms: '{value}' is not a number of milliseconds >= 0"
            in capsys.readouterr().err)
    assert _serve(tmp_path, "--synthetic-step-ms", "2.5").synthetic_step_ms == 2.5


def test_serve_s_verbose_flag_reaches_the_engine(tmp_path):
    """-v is "same as --log-level debug" (--help): the engine serve starts logs at debug too (it
    was started at info)."""
    for flags in (["-v"], ["--log-level", "debug"]):
        engine, _ = _through_the_engine(tmp_path, *flags)
        assert engine.log_level == "debug", flags
    engine, _ = _through_the_engine(tmp_path)
    assert engine.log_level == "info"
