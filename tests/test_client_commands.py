"""The client commands (generate, info, stats): how their flags become the request
and what they print, with the server replaced by a recording fake (the gRPC path itself is
test_cli's and test_operations')."""
from __future__ import annotations

import json

import pytest

from blink.client import cli
from blink.client.sdk import Completion, Delta, ModelInfo, Tls


class _Stream:
    def __init__(self, deltas, result):
        self._deltas, self.result = deltas, result

    def __iter__(self):
        return iter(self._deltas)


class _FakeClient:
    def __init__(self, result=None, info=None, stats=None):
        self.calls = []
        self._result, self._info, self._stats = result, info, stats

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def health(self, timeout=None):
        return "SERVING"

    def stream(self, prompt, sampling, **kw):
        self.calls.append((prompt, sampling, kw))
        return _Stream([Delta("Hel", ()), Delta("lo", ())], self._result)

    def model_info(self, timeout=None):
        return self._info

    def stats(self, timeout=None):
        return dict(self._stats)


def _done(**kw):
    fields = dict(text="Hello", token_ids=(), finish_reason="length", matched_stop="",
                  prompt_tokens=5, completion_tokens=2, time_to_first_token_s=0.0123,
                  total_s=0.0456, preemptions=0, cached_prompt_tokens=0, request_id="1")
    fields.update(kw)
    return Completion(**fields)


@pytest.fixture
def fake(monkeypatch):
    holder = {}

    def install(**kw):
        client = _FakeClient(**kw)
        monkeypatch.setattr(cli, "_client", lambda args: client)
        holder["client"] = client
        return client
    return install


def _run(*argv):
    args = cli.build_parser().parse_args(list(argv))
    args.func(args)


def test_generate_sends_every_stop_and_the_sampling_flags(fake, capsys):
    client = fake(result=_done())
    _run("generate", "Hi", "--stop", "a", "--stop", "\n\n", "--max-tokens", "7",
         "--temperature", "0.5", "--top-p", "0.9", "--top-k", "3", "--seed", "11",
         "--ignore-eos", "--cache-salt", "s1", "--timeout", "4")
    ((prompt, sampling, kw),) = client.calls
    assert prompt == "Hi"
    assert (sampling.stop, sampling.max_tokens, sampling.temperature, sampling.top_p,
            sampling.top_k, sampling.seed, sampling.ignore_eos) == \
        (("a", "\n\n"), 7, 0.5, 0.9, 3, 11, True)
    assert kw == dict(timeout=4.0, cache_salt="s1", skip_special_tokens_in_prompt=False)
    out = capsys.readouterr()
    assert out.out == "Hello\n"
    # the summary line: its own fields, milliseconds to one decimal
    assert out.err.strip() == ("[length; 5 prompt + 2 generated tokens; first token 12.3 ms, "
                               "total 45.6 ms]")


def test_generate_s_summary_names_the_prefix_cache_only_when_it_served_tokens(fake, capsys):
    fake(result=_done(cached_prompt_tokens=16, finish_reason="stop"))
    _run("generate", "Hi")
    assert "[stop; 5 prompt (16 from the prefix cache) + 2 generated tokens" in \
        capsys.readouterr().err


def test_generate_chat_sends_one_user_message(fake, capsys):
    client = fake(result=_done())
    _run("generate", "--chat", "Hi there")
    ((prompt, _, kw),) = client.calls
    assert prompt == [{"role": "user", "content": "Hi there"}]
    assert kw["skip_special_tokens_in_prompt"] is False


def test_generate_chat_refuses_skip_special_tokens_in_prompt(fake, capsys):
    client = fake(result=_done())
    with pytest.raises(SystemExit, match="--skip-special-tokens-in-prompt applies to a text "
                                         "prompt"):
        _run("generate", "--chat", "--skip-special-tokens-in-prompt", "Hi")
    assert client.calls == []
    client = fake(result=_done())
    _run("generate", "--skip-special-tokens-in-prompt", "Hi")
    assert client.calls[0][2]["skip_special_tokens_in_prompt"] is True


def test_stats_hit_rate_is_derived_and_null_before_any_lookup(fake, capsys):
    base = {"requests_finished": 3, "prefix_hit_tokens": 0, "prefix_query_tokens": 0}
    fake(stats=base)
    _run("stats")
    assert json.loads(capsys.readouterr().out)["prefix_cache_hit_rate"] is None
    fake(stats={**base, "prefix_hit_tokens": 48, "prefix_query_tokens": 128})
    _run("stats")
    printed = json.loads(capsys.readouterr().out)
    assert printed["prefix_cache_hit_rate"] == 48 / 128
    assert printed["requests_finished"] == 3


def test_info_prints_the_model_info_as_json(fake, capsys):
    info = ModelInfo(name="llama", architecture="LlamaForCausalLM", context_length=512,
                     vocab_size=300, eos_token_ids=(1, 2), has_chat_template=True,
                     engine="cpu-reference")
    fake(info=info)
    _run("info")
    assert json.loads(capsys.readouterr().out) == {
        "name": "llama", "architecture": "LlamaForCausalLM", "context_length": 512,
        "vocab_size": 300, "eos_token_ids": [1, 2], "has_chat_template": True,
        "engine": "cpu-reference"}


def test_tls_flags_of_the_client_commands(tmp_path):
    """--tls alone: TLS with the system's roots (not a plain channel); no flag: plain; the files
    are read as given."""
    parse = cli.build_parser().parse_args
    assert cli.tls_from_args(parse(["info"])) is None
    assert cli.tls_from_args(parse(["stats", "--tls"])) == Tls()
    ca = tmp_path / "ca.pem"
    ca.write_bytes(b"CA")
    assert cli.tls_from_args(parse(["generate", "x", "--tls-ca", str(ca)])) == Tls(ca=b"CA")


def test_the_token_file_is_stripped_for_the_client(tmp_path, monkeypatch):
    seen = {}

    class Client:
        def __init__(self, target, tls=None, token=None):
            seen.update(target=target, tls=tls, token=token)
    import blink.client.sdk as sdk
    monkeypatch.setattr(sdk, "BlinkClient", Client)
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    cli._client(cli.build_parser().parse_args(["info", "--target", "h:1", "--token-file",
                                               str(token)]))
    assert seen == {"target": "h:1", "tls": None, "token": "s3cret"}


def test_the_documented_client_defaults(fake, capsys):
    """README's Commands: `blink generate "prompt" [--max-tokens 64]`, `blink openai --target
    host:port [--port 8000]`, and --served-model-name NAME... takes several names."""
    client = fake(result=_done())
    _run("generate", "Hi")
    ((_, sampling, kw),) = client.calls
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k,
            sampling.seed, sampling.stop, sampling.ignore_eos) == (64, None, None, None, None,
                                                                     (), False)
    assert kw == dict(timeout=None, cache_salt="", skip_special_tokens_in_prompt=False)
    parse = cli.build_parser().parse_args
    gateway = parse(["openai"])
    assert (gateway.target, gateway.host, gateway.port, gateway.served_model_name) == \
        ("127.0.0.1:50051", "127.0.0.1", 8000, None)
    assert parse(["openai", "--served-model-name", "a", "b"]).served_model_name == ["a", "b"]
    assert parse(["openai", "--served-model-name", "llama"]).served_model_name == ["llama"]
