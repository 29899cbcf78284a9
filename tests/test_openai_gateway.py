"""`blink openai` against OpenAI's own Python SDK: the gateway's answers are what the Blink
SDK gets from the same server, in the shapes the OpenAI SDK parses, streaming included."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from blink.client.sdk import BlinkClient, Sampling

openai = pytest.importorskip("openai", reason="the test extra (openai) is not installed")
pytest.importorskip("aiohttp", reason="the test extra (aiohttp) is not installed")


@pytest.fixture
def gateway(checkpoints, make_stack, tmp_path):
    stack = make_stack(checkpoints["llama"])
    stack.wait_serving()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "gateway.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "blink.client.cli", "openai", "--target",
                             stack.target, "--port", str(port)], stdout=log,
                            stderr=subprocess.STDOUT)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           max_retries=0, timeout=30)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.models.list()
            break
        except openai.APIConnectionError:
            assert proc.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "gateway.log").read_text()
            time.sleep(0.1)
    yield client, stack
    proc.terminate()
    proc.wait(10)
    log.close()


def test_openai_sdk_through_the_gateway(gateway):
    client, stack = gateway
    assert [m.id for m in client.models.list().data] == ["llama"]
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
