"""`blink openai` against OpenAI's own Python SDK: the gateway's answers are what the Blink
SDK gets from the same server, in the shapes the OpenAI SDK parses, streaming included."""
from __future__ import annotations

import contextlib
import json
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from blink.client.sdk import SESSION_HEADER, BlinkClient, Sampling

openai = pytest.importorskip("openai", reason="the test extra (openai) is not installed")
pytest.importorskip("aiohttp", reason="the test extra (aiohttp) is not installed")


def start_gateway(model_dir, make_stack, tmp_path, engine_args=(), gateway_args=()):
    """A Blink stack on model_dir and `blink openai` in front of it: (OpenAI client, stack,
    gateway process); the caller stops the process."""
    stack = make_stack(model_dir, engine_args=engine_args)
    stack.wait_serving()
    client, proc = gateway_to(stack.target, tmp_path, gateway_args)
    return client, stack, proc


def gateway_to(target: str, tmp_path, gateway_args=(), api_key="unused", name="gateway"):
    """`blink openai --port 0` in front of the gRPC server at target, logging to
    tmp_path/NAME.log: (OpenAI client, its process), on the port its banner names (printed
    once it listens: no free port picked here and raced for)."""
    log = tmp_path / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "blink.client.cli", "openai", "--target",
                                 target, "--port", "0", *gateway_args], stdout=out,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while not (banner := re.search(r"^blink openai: http://[^ ]+:(\d+)/v1 ", log.read_text(),
                                   re.MULTILINE)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()  # (a no-op where it exited)
            proc.wait()
            pytest.fail(f"the gateway did not start:\n{log.read_text()}")
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{banner[1]}/v1", api_key=api_key,
                           max_retries=0, timeout=30)
    return client, proc


@contextlib.contextmanager
def serving_gateway(target: str, tmp_path, gateway_args=(), api_key="unused", name="gateway"):
    """gateway_to's (OpenAI client, process), the process stopped after."""
    client, proc = gateway_to(target, tmp_path, gateway_args, api_key, name)
    try:
        yield client, proc
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def gateway(checkpoints, make_stack, tmp_path):
    """A gateway that serves the model as `llama` and `llama-alias` alone
    (--served-model-name)."""
    client, stack, proc = start_gateway(checkpoints["llama"], make_stack, tmp_path,
                                        gateway_args=["--served-model-name", "llama",
                                                      "llama-alias"])
    yield client, stack
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def slow_gateway(long_checkpoint, make_stack, tmp_path):
    """A gateway before an engine of 5 ms steps: a long request runs for a long while."""
    client, stack, proc = start_gateway(long_checkpoint, make_stack, tmp_path, [
        "--engine", "synthetic", "--synthetic-step-ms", "5"])
    yield client, stack
    proc.terminate()
    proc.wait(10)


def test_openai_sdk_through_the_gateway(gateway):
    client, stack = gateway
    # every served name is listed, as vLLM lists them (the first alone before)
    assert [m.id for m in client.models.list().data] == ["llama", "llama-alias"]
    greedy = Sampling(max_tokens=10, temperature=0.0)
    with BlinkClient(stack.target) as blink:
        want_text = blink.generate("Once upon a time", greedy)
        messages = [{"role": "user", "content": "Tell me a story"}]
        want_chat = blink.generate(messages, greedy)

    done = client.completions.create(model="llama", prompt="Once upon a time", max_tokens=10,
                                     temperature=0)
    assert done.choices[0].text == want_text.text
    assert done.choices[0].finish_reason == ("length" if want_text.finish_reason == "length"
                                             else "stop")
    assert done.usage.completion_tokens == want_text.completion_tokens
    # a prompt sent again: its full KV blocks come from the prefix cache, as usage says
    long_prompt = "Once upon a time there was a story about " * 8
    first, again = (client.completions.create(model="llama", prompt=long_prompt, max_tokens=2,
                                              temperature=0) for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 16

    chat = client.chat.completions.create(model="llama", messages=messages, max_tokens=10,
                                          temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == want_chat.text
    assert chat.usage.prompt_tokens == want_chat.prompt_tokens

    chunks = list(client.chat.completions.create(model="llama", messages=messages,
                                                 max_tokens=10, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want_chat.text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    pieces = list(client.completions.create(model="llama", prompt="Once upon a time",
                                            max_tokens=10, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == want_text.text

    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="llama", prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="n = 1"):
        client.completions.create(model="llama", prompt="hi", n=2)


def post(client, path: str, body: dict | bytes, timeout: float = 30,
         headers: dict | None = None):
    """(status, parsed JSON body) of a raw POST to the gateway (body: JSON, or bytes as they
    are)."""
    import json
    import urllib.error
    import urllib.request
    req = urllib.request.Request(f"{client.base_url}{path.lstrip('/')}",
                                 data=body if isinstance(body, bytes)
                                 else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_and_unsupported_parameters_are_openai_errors(gateway):
    """Values the gateway cannot serve are a 400 in OpenAI's error body (they were a 500 and a
    traceback, or silently ignored), a model other than the served one a 404; null is the
    default; stream_options.include_usage streams a usage chunk before [DONE]. (This gateway
    serves `llama` and `llama-alias` alone: --served-model-name.)"""
    client, _ = gateway
    base = {"model": "llama", "prompt": "hi", "max_tokens": 3}
    for bad in ({"stop": 5}, {"stop": [None]}, {"max_tokens": -1}, {"max_tokens": 1e30},
                {"seed": 2 ** 70}, {"top_k": -2}, {"prompt": [-1]}, {"prompt": [2 ** 40]},
                {"prompt": [True]}, {"logprobs": 2}, {"echo": True}, {"best_of": 3},
                {"presence_penalty": 1.0}, {"logit_bias": {"5": 10}}, {"suffix": "x"},
                {"response_format": {"type": "json_object"}}, {"stream_options": True},
                {"stream_options": {"include_usage": "yes"}},
                # a stream's option on a request that does not stream (taken before)
                {"stream_options": {"include_usage": True}},
                {"chat_template_kwargs": {"enable_thinking": False}},
                {"continue_final_message": True}, {"add_generation_prompt": False},
                {"repetition_penalty": 1.1}, {"ignore_eos": "yes"}, {"stop_token_ids": [-1]},
                {"cache_salt": ""}, {"cache_salt": 5},
                # a JSON integer past a double (a text/plain 500 and a traceback before)
                {"temperature": 10 ** 400}, {"top_p": 10 ** 400},
                # the detokenizer always skips special tokens (these were silently ignored)
                {"skip_special_tokens": False}, {"spaces_between_special_tokens": False},
                {"add_special_tokens": "no"}):
        status, body = post(client, "/completions", {**base, **bad})
        assert (status, body["error"]["type"]) == (400, "invalid_request_error"), (bad, body)
        assert body["error"]["param"] == next(iter(bad)), (bad, body)
    status, body = post(client, "/chat/completions", {
        "model": "llama", "max_tokens": 3,
        "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]})
    assert status == 400, body
    status, body = post(client, "/chat/completions", {
        "model": "llama", "max_tokens": 3, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]})
    assert status == 400 and "text content" in body["error"]["message"], body
    status, body = post(client, "/completions", {**base, "model": "gpt-4-nope"})
    assert (status, body["error"]["code"]) == (404, "model_not_found"), body
    # vLLM's add_special_tokens: false leaves the BOS out of a text prompt (it was ignored:
    # a client that writes its own BOS got two); on chat the template writes them
    counts = [post(client, "/completions", {**base, **extra})[1]["usage"]["prompt_tokens"]
              for extra in ({}, {"add_special_tokens": True}, {"add_special_tokens": False})]
    assert counts[0] == counts[1] == counts[2] + 1, counts
    # the server's own refusals name the field too (param was null); an integer written as a
    # float is an integer, as vLLM takes it (a 400 before)
    for bad, param in (({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                       ({"max_tokens": 0}, "max_tokens"), ({"stop": [""]}, "stop"),
                       ({"stop": ["x"] * 17}, "stop"), ({"prompt": ""}, "prompt")):
        status, body = post(client, "/completions", {**base, **bad})
        assert (status, body["error"]["param"]) == (400, param), (bad, body)
    status, body = post(client, "/completions", {**base, "max_tokens": 2.0,
                                                 "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body
    chat = {"model": "llama", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    status, body = post(client, "/chat/completions", {**chat, "add_special_tokens": True})
    assert (status, body["error"]["param"]) == (400, "add_special_tokens"), body
    status, body = post(client, "/chat/completions", {**chat, "add_special_tokens": False,
                                                      "model": "llama-alias"})
    assert status == 200 and body["model"] == "llama-alias", body
    # bodies that cannot be read as JSON: bytes that are not UTF-8, a charset Python does not
    # know, nesting deeper than the parser goes (each a 500 and a traceback before)
    for raw, content_type in ((b'{"prompt": "\xff\xfe"}', "application/json"),
                              (b'{"prompt": "hi"}', "application/json; charset=foo"),
                              (b"[" * 100_000 + b"]" * 100_000, "application/json")):
        status, body = post(client, "/completions", raw, headers={"Content-Type": content_type})
        assert (status, body["error"]["type"]) == (400, "invalid_request_error"), (raw[:20], body)
    # null is the default; max_tokens applies where max_completion_tokens is null
    status, body = post(client, "/completions", {**base, "n": None, "seed": -5,
                                                 "max_completion_tokens": None, "top_k": -1,
                                                 "temperature": 0, "logprobs": None})
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body
    chunks = list(client.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
    # OpenAI's chunks before the last carry "usage": null, not no usage key (the SDK above
    # reads both as None: the raw lines tell them apart)
    import json
    import urllib.request
    req = urllib.request.Request(
        f"{client.base_url}chat/completions", headers={"Content-Type": "application/json"},
        data=json.dumps({"model": "llama", "messages": [{"role": "user", "content": "Hi"}],
                         "max_tokens": 3, "stream": True,
                         "stream_options": {"include_usage": True}}).encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        events = [json.loads(line[6:]) for line in r.read().decode().splitlines()
                  if line.startswith("data: {")]
    assert len(events) >= 3 and all("usage" in e and e["usage"] is None for e in events[:-1])
    assert events[-1]["usage"]["completion_tokens"] == 3


def test_vllm_s_ignore_eos_and_stop_token_ids_and_text_parts(gateway):
    """vLLM's extensions that benchmark tools send are served, not ignored: ignore_eos (every
    token asked for) and stop_token_ids (the stream ends on the id); a message's text parts are
    joined with newlines, as vLLM joins them; cache_salt keeps a salt's cached prefixes to
    itself."""
    client, stack = gateway
    prompt = "Once upon a time"
    with BlinkClient(stack.target) as blink:
        ids = blink.generate(prompt, Sampling(max_tokens=8, temperature=0.0, ignore_eos=True),
                             return_token_ids=True).token_ids
    k = next(i for i in range(2, 8) if ids[i] not in ids[:i])
    _, body = post(client, "/completions", {"model": "llama", "prompt": prompt, "max_tokens": 8,
                                            "temperature": 0, "stop_token_ids": [ids[k]],
                                            "ignore_eos": True})
    assert body["usage"]["completion_tokens"] == k + 1, body
    assert body["choices"][0]["finish_reason"] == "stop"

    def prompt_tokens(content):
        _, body = post(client, "/chat/completions", {
            "model": "llama", "max_tokens": 1, "messages": [{"role": "user",
                                                             "content": content}]})
        return body["usage"]["prompt_tokens"]
    parts = [{"type": "text", "text": "Summarize:"}, {"type": "text", "text": "Cats nap."}]
    assert prompt_tokens(parts) == prompt_tokens("Summarize:\nCats nap.")
    assert prompt_tokens("Summarize:\nCats nap.") != prompt_tokens("Summarize:Cats nap.")

    def cached(salt):
        body = {"model": "llama", "prompt": "A long story about salts and caches " * 8,
                "max_tokens": 1, **({} if salt is None else {"cache_salt": salt})}
        status, answer = post(client, "/completions", body)
        assert status == 200, answer
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    a, a_again, b, unsalted, unsalted_again = map(cached, ("a", "a", "b", None, None))
    assert a == b == unsalted == 0 and a_again == unsalted_again >= 16


def test_completions_default_to_16_tokens_chat_to_the_context(gateway):
    """/v1/completions without max_tokens generates at most 16 tokens, OpenAI's documented
    default (and vLLM's); chat completions run to the context's end or EOS, as the server."""
    client, _ = gateway
    prompt = "Once upon a time"
    longer = client.completions.create(model="llama", prompt=prompt, max_tokens=40,
                                       temperature=0)
    assert longer.usage.completion_tokens == 40  # greedy runs past 16 with no EOS
    default = client.completions.create(model="llama", prompt=prompt, temperature=0)
    assert default.usage.completion_tokens == 16 and default.choices[0].finish_reason == "length"
    assert longer.choices[0].text.startswith(default.choices[0].text)


def test_a_client_that_goes_away_cancels_its_request(slow_gateway):
    """A streaming client that closes its connection after a few chunks, and a client whose
    non-streaming request times out, each cancel their request in the server: the slot and
    the KV blocks come back at once (the engine used to generate their 10,000 tokens, 50 s
    of its steps)."""
    import http.client
    import json
    import socket as sockets
    import urllib.request
    client, stack = slow_gateway
    # no --served-model-name: `model` is not checked (clients send Hub ids or paths)
    assert post(client, "completions", {"model": "some-org/Some-Model-8B", "prompt": "hi",
                                        "max_tokens": 2})[0] == 200
    body = {"model": client.models.list().data[0].id, "prompt": "go on", "max_tokens": 10_000,
            "temperature": 0}
    host, port = client.base_url.host, client.base_url.port
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.read(200)
    conn.sock.shutdown(sockets.SHUT_RDWR)
    conn.close()
    with BlinkClient(stack.target) as blink:
        assert wait_idle(blink) and blink.stats()["requests_cancelled"] == 1
        req = urllib.request.Request(f"{client.base_url}completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(OSError):  # the client's own timeout: it gives up and goes away
            urllib.request.urlopen(req, timeout=1)
        assert wait_idle(blink) and blink.stats()["requests_cancelled"] == 2


def test_the_gateway_reaches_every_front_end_worker_s_slots(long_checkpoint, make_stack,
                                                           tmp_path):
    """In front of `--workers 2` with a slot each, two long streams at once both run: the
    gateway holds a connection to each worker and sends a request to the one with the fewest
    of its calls in flight. (On its one connection, the second waited for the first worker's
    slot through --queue-timeout, then was a 429, the other worker's slot free.)"""
    import http.client
    import json
    stack = make_stack(long_checkpoint, engine_args=[
        "--engine", "synthetic", "--synthetic-step-ms", "5", "--slots", "2"],
        frontend_args=["--workers", "2", "--queue-timeout", "2"])
    stack.wait_serving()
    with serving_gateway(stack.target, tmp_path) as (client, _):
        body = json.dumps({"model": "m", "prompt": "go on", "max_tokens": 2000,
                           "stream": True})
        streams = []
        for _ in range(2):  # the second sent once the first streams
            conn = http.client.HTTPConnection(client.base_url.host, client.base_url.port,
                                              timeout=30)
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            assert response.status == 200, response.read()
            assert response.readline().startswith(b"data: {"), "no first chunk"
            streams.append(conn)
        with BlinkClient(stack.target) as blink:
            assert blink.stats()["ring_slots_in_use"] == 2
            for conn in streams:
                conn.close()
            assert wait_idle(blink)


def wait_idle(blink, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = blink.stats()
        if s["ring_slots_in_use"] == 0 and s["sequences_running"] == 0 \
                and s["kv_blocks_free"] == s["kv_blocks_total"]:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("signal_name,stream,twice", [
    ("SIGTERM", True, False), ("SIGINT", True, False), ("SIGHUP", True, False),
    ("SIGQUIT", True, False), ("SIGTERM", False, False), ("SIGINT", True, True)])
def test_sigterm_ends_the_gateway_within_its_shutdown_timeout(long_checkpoint, make_stack,
                                                             tmp_path, signal_name, stream,
                                                             twice):
    """SIGTERM (and SIGINT, SIGHUP, SIGQUIT, as `blink serve`'s) with a request in flight: the
    gateway exits 0 soon after --shutdown-timeout (it took aiohttp's default 60 s; SIGHUP killed
    it at once, status 129), a stream ends with a "server shutting down" error event and [DONE]
    (it was cut mid-chunk), a whole completion with a 503 saying so, and the request is
    cancelled in the server. twice: Ctrl-C twice, under a minute's --shutdown-timeout, ends it
    all so at once (the second exited 1, the stream cut mid-chunk)."""
    import http.client
    import json
    import signal
    client, stack, proc = start_gateway(long_checkpoint, make_stack, tmp_path, [
        "--engine", "synthetic", "--synthetic-step-ms", "5"],
        ["--shutdown-timeout", "60" if twice else "1"])
    try:
        conn = http.client.HTTPConnection(client.base_url.host, client.base_url.port,
                                          timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({
            "model": "m", "prompt": "go on", "max_tokens": 10_000, "stream": stream}),
            {"Content-Type": "application/json"})
        if stream:
            response = conn.getresponse()
            assert response.status == 200 and response.read(200)
        else:  # under way in the server
            with BlinkClient(stack.target) as blink:
                deadline = time.monotonic() + 30
                while blink.stats()["sequences_running"] != 1 and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert blink.stats()["sequences_running"] == 1
        t0 = time.monotonic()
        proc.send_signal(getattr(signal, signal_name))
        if twice:
            time.sleep(0.5)
            assert proc.poll() is None  # draining
            proc.send_signal(getattr(signal, signal_name))
        if stream:
            rest = response.read()  # (http.client.IncompleteRead for a cut stream)
            assert b'"code": "unavailable"' in rest and rest.endswith(b"data: [DONE]\n\n"), \
                rest[-300:]
        else:
            response = conn.getresponse()
            body = response.read()
            assert response.status == 503 and b"shutting down" in body, (response.status, body)
        assert proc.wait(20) == 0 and time.monotonic() - t0 < 10
        with BlinkClient(stack.target) as blink:
            assert wait_idle(blink) and blink.stats()["requests_cancelled"] == 1
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_session_header_and_the_token_reach_the_server(tmp_path):
    """The gateway passes an HTTP request's x-blink-session header on as the gRPC call's
    (Envoy routes by it) and its bearer token as the call's; a request without the header
    sends none. The server here is the SDK tests' fake, which records each call's metadata.
    (The OpenAI client sends its api_key, "unused", as the bearer token unless told another.)"""
    from test_client_sdk import FakeBlink, serve_fake
    with serve_fake(FakeBlink()) as (fake, target), \
            serving_gateway(target, tmp_path) as (client, _):
        for headers, token in (({SESSION_HEADER: "conv-9", "Authorization": "Bearer k1"},
                                "k1"), ({}, "unused"),
                               ({"Authorization": "bearer k2"}, "k2")):  # (any case)
            client.with_options(default_headers=headers).completions.create(
                model="m", prompt="hi", max_tokens=2)
            sent = fake.metadata[-1]
            assert sent.get(SESSION_HEADER) == headers.get(SESSION_HEADER)
            assert sent["authorization"] == f"Bearer {token}"
        # a header value gRPC metadata cannot carry is the client's error, not the server's
        status, body = post(client, "/completions", {"prompt": "hi", "max_tokens": 2},
                            headers={SESSION_HEADER: "caf\u00e9"})
        assert status == 400 and "printable ASCII" in body["error"]["message"], body
        # the same for a bearer token, and on /v1/models (a 500 and a traceback before)
        status, body = post(client, "/completions", {"prompt": "hi", "max_tokens": 2},
                            headers={"Authorization": "Bearer caf\u00e9"})
        assert status == 400 and "printable ASCII" in body["error"]["message"], body
        req = urllib.request.Request(f"{client.base_url}models",
                                     headers={"Authorization": "Bearer caf\u00e9"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=30)
        assert refused.value.code == 400, refused.value.read()


def test_port_0_is_the_bound_port_in_the_banner(tmp_path):
    """`--port 0` listens on a free port and the banner names it, as a supervisor reads it
    (gateway_to does): the banner said port 0."""
    from test_client_sdk import FakeBlink, serve_fake
    with serve_fake(FakeBlink()) as (_, target), \
            serving_gateway(target, tmp_path) as (client, _):
        port = client.base_url.port
        assert port != 0
        assert f"blink openai: http://127.0.0.1:{port}/v1 -> Blink at {target}\n" in \
            (tmp_path / "gateway.log").read_text()
        assert client.completions.create(model="m", prompt="hi", max_tokens=2).choices[0].text


def test_the_gateway_reaches_a_mutual_tls_server(checkpoints, make_stack, tmp_path):
    """`blink openai` takes the client commands' TLS flags (--tls, --tls-ca, --tls-cert,
    --tls-key), so it reaches a server that serves TLS or mutual TLS (it had no way to). Where
    the TLS cannot work (a CA that did not sign the server's certificate, the system's roots,
    no client certificate), each request fails as `blink info`'s does, UNAVAILABLE with
    gRPC's reason: a 503; a file it cannot use stops it at start in one line, as `blink info`."""
    pytest.importorskip("cryptography", reason="the test extra (cryptography) is not installed")
    from test_cli import blink
    from test_operations import _certificates

    from blink.client.sdk import Tls
    (tmp_path / "pem").mkdir()
    (tmp_path / "other").mkdir()
    pem, other = _certificates(tmp_path / "pem"), _certificates(tmp_path / "other")
    stack = make_stack(checkpoints["llama"], start=False, frontend_args=[
        "--tls-cert", str(pem["server.pem"]), "--tls-key", str(pem["server.key"]),
        "--tls-client-ca", str(pem["ca.pem"])])
    stack.start_engine()
    stack.start_frontend()
    mutual = Tls(*(pem[f].read_bytes() for f in ("ca.pem", "client.pem", "client.key")))
    with BlinkClient(stack.target, tls=mutual) as client:
        client.wait_ready(60)

    def flags(ca, cert=None, key=None):
        return ["--tls-ca", str(ca)] + (["--tls-cert", str(cert), "--tls-key", str(key)]
                                        if cert else [])
    with serving_gateway(stack.target, tmp_path, flags(
            pem["ca.pem"], pem["client.pem"], pem["client.key"])) as (client, _):
        done = client.completions.create(model="m", prompt="over TLS", max_tokens=3,
                                         extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 3
    for name, wrong in (("wrong-ca", flags(other["ca.pem"], pem["client.pem"],
                                           pem["client.key"])),
                        ("no-client-cert", flags(pem["ca.pem"])),
                        ("system-roots", ["--tls"])):
        info = blink("info", "--target", stack.target, *wrong)
        assert info.returncode == 1, info.stderr
        with serving_gateway(stack.target, tmp_path, wrong, name=name) as (client, _):
            status, body = post(client, "/completions", {"prompt": "hi", "max_tokens": 2})
        assert (status, body["error"]["code"]) == (503, "unavailable"), (name, body)
        assert f"blink info: UNAVAILABLE: {body['error']['message']}\n" in info.stderr
    for wrong, why in ((["--tls-ca", str(tmp_path / "absent.pem")], "No such file"),
                       (["--tls-cert", str(pem["client.pem"])], "cert and key go together")):
        for command in (["info"], ["openai", "--port", "0"]):
            out = blink(*command, "--target", stack.target, *wrong)
            assert out.returncode == 1 and why in out.stderr, (command, out.stderr)
            assert len(out.stderr.splitlines()) == 1, out.stderr


def raw_request(client, authorization: bytes) -> bytes:
    """What the gateway answers a POST /v1/completions with this Authorization value, sent
    as raw bytes (a header HTTP clients refuse to build), up to its closing the connection."""
    with socket.create_connection((client.base_url.host, client.base_url.port),
                                  timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nAuthorization: "
                  + authorization + b"\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 2\r\n\r\n{}")
        answer = b""
        while chunk := s.recv(1 << 16):
            answer += chunk
    return answer


def quotes(text: str, secret: str, run: int = 16) -> bool:
    """Whether text holds any `run` characters of secret in a row."""
    pieces = {secret[i:i + run] for i in range(len(secret) - run + 1)}
    return any(text[i:i + run] in pieces for i in range(len(text) - run + 1))


def test_a_header_it_cannot_read_is_refused_without_quoting_it(checkpoints, make_stack,
                                                              tmp_path):
    """An Authorization header past aiohttp's 8,190 bytes a field (twice the longest token a
    Blink server takes) or with a control character in it got aiohttp's own 400, whose body
    and logged traceback quoted the header: a bearer token leaked into a response and a log.
    Now it is a 400 in OpenAI's error shape and one log line, neither with a byte of the
    request, even at --log-level debug; a wrong token of a usual size is still the server's
    401, the right one served."""
    import json
    (tmp_path / "token").write_text("s3cret-token\n")
    stack = make_stack(checkpoints["llama"],
                       frontend_args=["--auth-token-file", str(tmp_path / "token")])
    secret = secrets.token_hex(10_000)  # 20 KB
    with serving_gateway(stack.target, tmp_path, ["--log-level", "debug"],
                         api_key="s3cret-token") as (client, _):
        for authorization in (f"Bearer {secret}", f"Bearer {secret[:100]}\x01"):
            answer = raw_request(client, authorization.encode()).decode("latin-1")
            assert not quotes(answer, secret), answer
            assert re.match(r"HTTP/1\.[01] 400 ", answer), answer
            error = json.loads(answer.partition("\r\n\r\n")[2])["error"]
            assert error["type"] == "invalid_request_error", error
        status, body = post(client, "/completions", {"prompt": "hi", "max_tokens": 2},
                            headers={"Authorization": "Bearer wrong-token"})
        assert (status, body["error"]["type"]) == (401, "authentication_error"), body
        assert client.completions.create(model="m", prompt="hi", max_tokens=2).choices
    log = (tmp_path / "gateway.log").read_text()
    assert "cannot be read" in log and not quotes(log, secret), log[-3000:]


# A template that prints a message's name where it has one, as ChatML-style templates for
# multi-party chats do (transformers hands a template every key of a message).
NAMED_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m.role }}"
                  "{% if m.name is defined %} ({{ m.name }}){% endif %}: {{ m.content }}<|eot|>"
                  "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def test_a_message_s_name_reaches_the_chat_template(make_stack, tmp_path):
    """A message's `name` (OpenAI's participant name) reaches the model's chat template, so
    the prompt is transformers' apply_chat_template's on the same folder, token for token
    (the gateway dropped it: the prompt had no names); a message without one has no `name`
    for the template to test."""
    from test_chat_template import _codec_and_transformers, _tiny_model
    folder = _tiny_model(tmp_path / "named", chat_template=NAMED_TEMPLATE)
    _, hf = _codec_and_transformers(folder)
    client, stack, proc = start_gateway(folder, make_stack, tmp_path)
    try:
        named = [{"role": "system", "content": "Two users share this chat."},
                 {"role": "user", "name": "alice", "content": "Hi, I am Alice."},
                 {"role": "user", "name": "bob_2", "content": "And I am Bob."}]
        unnamed = [{k: v for k, v in m.items() if k != "name"} for m in named]
        with BlinkClient(stack.target) as blink:
            for messages in (named, unnamed):
                want = hf.apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=True)
                want = len(getattr(want, "input_ids", want))
                done = client.chat.completions.create(model="m", messages=messages,
                                                      max_tokens=1)
                assert done.usage.prompt_tokens == want, messages
                # the Blink SDK sends it too
                assert blink.generate(messages, Sampling(max_tokens=1)).prompt_tokens == want
    finally:
        proc.terminate()
        proc.wait(10)


def test_refusals_name_their_parameter_and_a_number_is_not_a_boolean(gateway):
    """A 400 names the parameter at fault in OpenAI's `param` (it was always null); JSON's 0
    and true are not its false and 1 (Python's False == 0 let `"logprobs": 0`, which asks for
    the sampled tokens' logprobs, and `"echo": 0`, `"n": true`, pass as neutral, and
    `"stream": "false"` streamed); parameters that would change the answer (audio output,
    reasoning effort, vLLM's guided decoding, ...) and messages that carry tool calls are
    refused, not ignored; a message's fault names the message."""
    client, _ = gateway
    completion = {"model": "llama", "prompt": "hi", "max_tokens": 3}
    chat = {"model": "llama", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}
    for path, base, bad, param in (
            ("/completions", completion, {"logprobs": 0}, "logprobs"),
            ("/completions", completion, {"echo": 0}, "echo"),
            ("/completions", completion, {"best_of": True}, "best_of"),
            ("/completions", completion, {"n": True}, "n"),
            ("/completions", completion, {"stream": "false"}, "stream"),
            ("/completions", completion, {"ignore_eos": 0}, "ignore_eos"),
            ("/completions", completion, {"model": 5}, "model"),
            ("/completions", completion, {"model": "\ud800"}, "model"),  # (was echoed)
            ("/completions", completion, {"max_tokens": -1}, "max_tokens"),
            ("/completions", completion, {"stop": 5}, "stop"),
            ("/completions", completion, {"guided_json": {"type": "object"}}, "guided_json"),
            ("/completions", completion, {"include_stop_str_in_output": True},
             "include_stop_str_in_output"),
            ("/chat/completions", chat, {"modalities": ["text", "audio"]}, "modalities"),
            ("/chat/completions", chat, {"reasoning_effort": "low"}, "reasoning_effort"),
            ("/chat/completions", chat, {"response_format": {"type": "json_object"}},
             "response_format"),
            ("/chat/completions", chat, {"messages": [
                {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "", "tool_calls": [{
                    "id": "c1", "type": "function",
                    "function": {"name": "add", "arguments": "[2, 2]"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "4"}]},
             "messages[1].tool_calls"),
            ("/chat/completions", chat, {"messages": [
                {"role": "user", "content": "Hi"},
                {"role": "tool", "tool_call_id": "c1", "content": "4"}]},
             "messages[1].tool_call_id"),
            ("/chat/completions", chat, {"messages": [
                {"role": "user", "content": "Hi"}, {"role": "user", "content": [
                    {"type": "text", "text": "this:"},
                    {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
             "messages[1].content"),
            ("/chat/completions", chat, {"messages": [{"role": "user", "content": "Hi",
                                                       "name": 5}]}, "messages[0].name")):
        status, body = post(client, path, {**base, **bad})
        assert status == 400, (bad, body)
        assert (body["error"]["type"], body["error"]["param"]) == (
            "invalid_request_error", param), (bad, body)
        assert param.partition(".")[0].partition("[")[0] in body["error"]["message"], body
    # the neutral values still pass: 0.0 for 0, false, null, [], OpenAI's "text" output
    status, body = post(client, "/chat/completions", {
        **chat, "presence_penalty": 0.0, "logprobs": False, "stream": False, "n": 1,
        "tools": [], "modalities": ["text"], "user": "u-1", "metadata": {"k": "v"},
        "messages": [{"role": "user", "content": "Hi", "name": "alice", "tool_calls": []}]})
    assert status == 200 and body["object"] == "chat.completion", body


def test_aiohttp_s_refusals_and_stream_errors_are_openai_errors(tmp_path):
    """A path the gateway does not serve, a method a path does not take and a body past its
    limit are OpenAI's error body (they were aiohttp's text/plain pages, which the OpenAI SDK
    shows as raw text); a body under the server's own 4 MiB request limit is read (aiohttp's
    1 MiB default refused it: a 413); an error mid-stream is an event in the same shape, then
    [DONE]; a response carries the served model's name where the request named none (it
    carried ""). The server here is the SDK tests' fake."""
    import json

    from test_client_sdk import MODEL, FakeBlink, serve_fake

    def raw(client, method: str, path: str, body: bytes | None = None):
        req = urllib.request.Request(f"{client.base_url}{path}", data=body, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()
    with serve_fake(FakeBlink()) as (fake, target), \
            serving_gateway(target, tmp_path) as (client, _):
        for method, path, body, status in (
                ("POST", "embeddings", b"{}", 404), ("GET", "chat/completions", None, 405),
                ("POST", "completions", json.dumps({"prompt": "x" * (17 << 20)}).encode(),
                 413)):
            got, headers, answer = raw(client, method, path, body)
            error = json.loads(answer)["error"]
            assert (got, error["type"]) == (status, "invalid_request_error"), (path, answer)
            assert f"{method} /v1/{path}" in error["message"], error
        got, headers, _ = raw(client, "GET", "chat/completions")
        assert headers["Allow"] == "POST"
        with pytest.raises(openai.NotFoundError, match="this gateway serves"):
            client.embeddings.create(model="m", input="hi")
        # 3 MiB of prompt (under the fake's 4 MiB gRPC limit), as JSON that escapes each
        # character to 6 bytes: 9 MiB of body
        prompt = "\u00e9" * (3 << 19)
        done = client.completions.create(model="m", prompt=prompt, max_tokens=2)
        assert done.choices[0].text == "Hello world"
        assert fake.requests[-1].text == prompt
        # past the server's gRPC limit: a 413 (a 429, RESOURCE_EXHAUSTED's, had clients retry)
        status, body = post(client, "/completions", {"prompt": "x" * (5 << 20)})
        assert (status, body["error"]["code"]) == (413, "resource_exhausted"), body
        # a request without a model: the response names the served one, as OpenAI and vLLM
        status, body = post(client, "/completions", {"prompt": "hi", "max_tokens": 2})
        assert (status, body["model"]) == (200, MODEL.name), body
        # the server's error mid-stream: an event in OpenAI's error shape, then [DONE]
        with pytest.raises(openai.APIError, match="engine stopped"):
            list(client.completions.create(model="m", prompt="fail-mid", stream=True))
        req = urllib.request.Request(
            f"{client.base_url}completions", headers={"Content-Type": "application/json"},
            data=json.dumps({"prompt": "fail-mid", "stream": True}).encode())
        with urllib.request.urlopen(req, timeout=30) as r:
            lines = [line for line in r.read().decode().splitlines() if line]
        assert json.loads(lines[-2][len("data: "):]) == {"error": {
            "message": "engine stopped", "type": "server_error", "param": None,
            "code": "unavailable"}}, lines
        assert lines[-1] == "data: [DONE]"


def test_a_prompt_too_long_for_the_context_is_context_length_exceeded(gateway):
    """A prompt that leaves no room in the context (alone or with its max_tokens) is OpenAI's
    400 with code context_length_exceeded and param messages or prompt (it was the gRPC
    code's name, invalid_argument, which no client looks for: LangChain's ContextOverflowError,
    which shortens a conversation and retries, keys on OpenAI's code); other bad values keep
    their code. (The model here has a 512-token context.)"""
    client, _ = gateway
    long_text = "hello " * 600
    for create, prompt, param, extra in (
            (client.completions.create, {"prompt": long_text}, "prompt", {}),
            (client.completions.create, {"prompt": "hi"}, "prompt", {"max_tokens": 10_000}),
            (client.chat.completions.create,
             {"messages": [{"role": "user", "content": long_text}]}, "messages", {}),
            (client.chat.completions.create,
             {"messages": [{"role": "user", "content": long_text}]}, "messages",
             {"stream": True})):
        with pytest.raises(openai.BadRequestError) as refused:
            create(model="llama", **prompt, **extra)
        assert (refused.value.code, refused.value.param) == ("context_length_exceeded", param)
        assert "context length" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="llama", prompt="hi", top_p=0)
    assert refused.value.code == "invalid_argument"


@pytest.mark.parametrize("reason", ["EXCEEDS_CONTEXT", "EXCEEDS_KV_CAPACITY", "BAD_TOP_P"])
def test_the_engine_s_own_context_refusals_are_context_length_exceeded(reason):
    """Where the front end could not check (an engine that publishes no KV capacity), the
    engine refuses the request itself, in its words (RejectReason): the same code for a
    client, and another refusal keeps its own."""
    import grpc

    from blink.client.openai_gateway import _blink_error_body
    from blink.client.sdk import BlinkError
    from blink.ring.layout import RejectReason
    error = BlinkError(grpc.StatusCode.INVALID_ARGUMENT,
                       f"engine rejected the request: {RejectReason[reason].describe()}")
    status, body = _blink_error_body(error, chat=True)
    context = reason != "BAD_TOP_P"
    assert (status, body["error"]["code"], body["error"]["param"]) == (
        400, "context_length_exceeded" if context else "invalid_argument",
        "messages" if context else None)


def test_a_body_that_stops_arriving_is_a_408(monkeypatch):
    """A client that sends its headers and part of its body, then waits, gets a 408 once the
    body's time is up, with the connection to be closed (aiohttp reads what is left of the
    body for its lingering time, 10 s, then closes it): it held the connection and a handler
    for as long as it waited (aiohttp sets no limit on a body's arrival)."""
    import asyncio
    import json

    from aiohttp import web

    from blink.client import openai_gateway
    monkeypatch.setattr(openai_gateway, "BODY_READ_TIMEOUT_S", 0.5)

    async def half_a_body() -> tuple[bytes, float]:
        runner = web.AppRunner(openai_gateway.make_app("127.0.0.1:9"))  # (never reached)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            port = runner.addresses[0][1]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
            await writer.drain()
            start = time.monotonic()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            length = int(re.search(rb"Content-Length: (\d+)", head).group(1))
            response = head + await reader.readexactly(length)
            took = time.monotonic() - start
            writer.close()
            await writer.wait_closed()
            return response, took
        finally:
            await runner.cleanup()
    response, took = asyncio.run(half_a_body())
    assert response.startswith(b"HTTP/1.1 408"), response[:200]
    assert b"Connection: close" in response, response[:300]
    body = json.loads(response.split(b"\r\n\r\n", 1)[1])
    assert "stopped arriving for 0.5 s" in body["error"]["message"], body
    assert took < 5


def test_a_slow_body_that_keeps_arriving_is_read(monkeypatch):
    """The body's time limit is between pieces, not for the whole body: a client sending
    slowly (here a piece every 0.2 s for 1.2 s, against 0.5 s) is served, and a body past
    MAX_BODY_BYTES is a 413 in OpenAI's shape."""
    import asyncio
    import json

    from aiohttp import web

    from blink.client import openai_gateway
    monkeypatch.setattr(openai_gateway, "BODY_READ_TIMEOUT_S", 0.5)
    monkeypatch.setattr(openai_gateway, "MAX_BODY_BYTES", 1000)

    async def send(pieces: list[bytes]) -> bytes:
        runner = web.AppRunner(openai_gateway.make_app("127.0.0.1:9"))  # (never reached)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", runner.addresses[0][1])
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n"
                         % sum(map(len, pieces)))
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.2)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            length = int(re.search(rb"Content-Length: (\d+)", head).group(1))
            response = head + await reader.readexactly(length)
            writer.close()
            await writer.wait_closed()
            return response
        finally:
            await runner.cleanup()
    # a valid request whose model is refused (n = 2) once read whole: the gateway read it
    slow = json.dumps({"prompt": "hi", "n": 2}).encode()
    response = asyncio.run(send([slow[i:i + 4] for i in range(0, len(slow), 4)][:6]
                                + [slow[24:]]))
    assert response.startswith(b"HTTP/1.1 400"), response[:300]
    assert json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]["param"] == "n"
    response = asyncio.run(send([b'{"prompt": "' + b"x" * 1200 + b'"}']))
    assert response.startswith(b"HTTP/1.1 413"), response[:300]
    assert json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]["type"] == \
        "invalid_request_error"


# A fake Blink server scripted by its prompt, for what the gateway makes of each kind of final
# (oracle: OpenAI's API reference for finish_reason, usage, max_completion_tokens and the status
# codes; vLLM's for top_k = -1).
def _scripted_blink():
    import grpc
    from test_client_sdk import CHUNKS, FINAL, FakeBlink, _chunk
    from blink.v1 import blink_pb2
    reasons = {"eos": blink_pb2.FINISH_REASON_EOS, "length": blink_pb2.FINISH_REASON_LENGTH,
               "stop": blink_pb2.FINISH_REASON_STOP}

    class Scripted(FakeBlink):
        """The prompt (or the last message's content) names the final's finish reason, or is
        'deadline': the call fails DEADLINE_EXCEEDED."""

        def Generate(self, request, context):
            self.requests.append(request)
            kind = request.WhichOneof("prompt")
            script = request.text if kind == "text" else (
                request.messages.messages[-1].content if kind == "messages" else "")
            if script == "deadline":
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed")
            for text, _ in CHUNKS:
                yield _chunk(text, [])
            final = blink_pb2.Final()
            final.CopyFrom(FINAL)
            final.finish_reason = reasons.get(script, blink_pb2.FINISH_REASON_STOP)
            yield blink_pb2.GenerateResponse(final=final)
    return Scripted()


def _events(client, path: str, body: dict) -> list[dict]:
    """A streamed response's data events, parsed (the [DONE] line left out)."""
    req = urllib.request.Request(f"{client.base_url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return [json.loads(line[6:]) for line in r.read().decode().splitlines()
                if line.startswith("data: {")]


def test_finish_reasons_usage_limits_and_codes_as_openai_documents(tmp_path):
    """Each engine finish as OpenAI names it, streamed or not, on both endpoints; usage's
    total; the token limits each endpoint sends (max_completion_tokens over max_tokens);
    vLLM's top_k -1 as "off"; a deadline as 504; a request naming no model where the server
    has a served name as 404."""
    from test_client_sdk import serve_fake
    with serve_fake(_scripted_blink()) as (fake, target), \
            serving_gateway(target, tmp_path, ["--served-model-name", "m"]) as (client, _):
        for reason, want in (("eos", "stop"), ("stop", "stop"), ("length", "length")):
            _, body = post(client, "/completions", {"model": "m", "prompt": reason})
            assert body["choices"][0]["finish_reason"] == want, (reason, body)
            events = _events(client, "completions", {"model": "m", "prompt": reason,
                                                     "stream": True})
            assert events[-1]["choices"][0]["finish_reason"] == want, events
            events = _events(client, "chat/completions", {
                "model": "m", "stream": True,
                "messages": [{"role": "user", "content": reason}]})
            assert events[-1]["choices"][0]["finish_reason"] == want, events
        _, body = post(client, "/completions", {"model": "m", "prompt": "x"})
        assert body["usage"]["total_tokens"] == 8 == sum(  # the fake's final: 3 + 5
            body["usage"][k] for k in ("prompt_tokens", "completion_tokens"))
        chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        post(client, "/chat/completions", chat)
        assert not fake.requests[-1].sampling.HasField("max_tokens")  # the rest of the context
        post(client, "/completions", {"model": "m", "prompt": "x"})
        assert fake.requests[-1].sampling.max_tokens == 16
        post(client, "/chat/completions", {**chat, "max_completion_tokens": 7})
        assert fake.requests[-1].sampling.max_tokens == 7
        post(client, "/chat/completions", {**chat, "max_completion_tokens": 7, "max_tokens": 9})
        assert fake.requests[-1].sampling.max_tokens == 7
        post(client, "/completions", {"model": "m", "prompt": "x", "top_k": -1})
        assert fake.requests[-1].sampling.top_k == 0  # off, not greedy (1)
        status, body = post(client, "/completions", {"model": "m", "prompt": "deadline"})
        assert status == 504 and body["error"]["code"] == "deadline_exceeded", body
        status, body = post(client, "/completions", {"prompt": "x"})
        assert (status, body["error"]["code"]) == (404, "model_not_found"), body


def test_a_batch_of_one_prompt_is_that_prompt(tmp_path):
    """OpenAI's prompt may be a list: ["text"] and [[ids]] are one prompt each."""
    from test_client_sdk import serve_fake
    with serve_fake(_scripted_blink()) as (fake, target), \
            serving_gateway(target, tmp_path) as (client, _):
        status, body = post(client, "/completions", {"prompt": ["once"]})
        assert status == 200 and fake.requests[-1].text == "once", body
        status, body = post(client, "/completions", {"prompt": [[5, 6, 7]]})
        assert status == 200 and list(fake.requests[-1].token_ids.ids) == [5, 6, 7], body
