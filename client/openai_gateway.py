"""`blink openai`: an OpenAI-compatible HTTP gateway in front of a Blink server, so OpenAI SDKs
and the usual benchmark tools work against Blink unchanged.

    blink openai --target 127.0.0.1:50051 --port 8000
    curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

It is a gRPC client of the front end (aiohttp, the `openai` extra) and stays off the CPU-free
path: run it where HTTP clients need it. Endpoints: GET /v1/models; POST /v1/completions
(prompt: a string or token ids) and POST /v1/chat/completions (messages through the model's
chat template: role, content as a string or text parts, and name, which the template sees),
both with `stream` (server-sent events ending in `data: [DONE]`, a usage chunk before it with
`stream_options.include_usage`). Parameters: max_tokens (max_completion_tokens), temperature,
top_p, top_k, seed, stop (string or list), n = 1, and vLLM's extensions ignore_eos and
stop_token_ids (which benchmark tools send) and cache_salt (a non-empty string: the prefix
cache's namespace, blink.proto's GenerateRequest.cache_salt); null is the default; one that
Blink does not serve (logprobs, echo, penalties, tools, audio output, reasoning_effort, vLLM's
guided decoding, chat_template_kwargs and continue_final_message, ...) set to anything but its
neutral value is a 400 whose `param` names it, as is a message that carries tool calls;
parameters that change no output (user, metadata, store, ...) are accepted. With
--served-model-name, a model not among its names is a 404 (model_not_found) and /v1/models
lists each, else `model` is not checked (clients send Hub ids or paths); a response names the served model where the
request named none. A body may be MAX_BODY_BYTES, and may not stop arriving for
BODY_READ_TIMEOUT_S (a 408); a path or method not served, or a larger body, is OpenAI's error
body too. An `Authorization: Bearer KEY` header is passed on as the
gRPC bearer token, an `x-blink-session` header as the SDK's session (Envoy routes a session to
one replica: deploy/envoy/envoy.yaml). Blink's errors map to HTTP statuses (INVALID_ARGUMENT
400, UNAUTHENTICATED 401, RESOURCE_EXHAUSTED 429, or 413 for a message past gRPC's size limit,
UNAVAILABLE 503, DEADLINE_EXCEEDED 504) with OpenAI's error body (a prompt too long for the
context: code context_length_exceeded, as OpenAI's). A client that disconnects
cancels its request in the server. The channel to the server takes the client commands' TLS
flags (--tls, --tls-ca, --tls-cert, --tls-key: TLS or mutual TLS).
"""
from __future__ import annotations

import asyncio
import json
import math
import re
import secrets
import time

import grpc

from blink.client.sdk import SESSION_HEADER, AsyncBlinkClient, BlinkError, Sampling, Tls
from blink.ring.layout import RejectReason

HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
               grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
               grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.CANCELLED: 499}


# gRPC's words for a message past its size limit ("Received message larger than max (N vs.
# M)", "Sent message ..."), which it reports as RESOURCE_EXHAUSTED, as a full server's queue
GRPC_TOO_LARGE = "message larger than max"

# The front end's words for a prompt that leaves no room in the context or the KV cache
# (nic_service/server.py's request checks, and the engine's own refusals where the front end
# could not check): OpenAI's code for it, context_length_exceeded, is what clients look for
# to shorten a conversation and retry (LangChain's ContextOverflowError)
CONTEXT_LENGTH_EXCEEDED = re.compile(
    r"prompt (has \d+ tokens; the (context length is|KV cache holds) \d+"
    r"|\(\d+ tokens\) plus max_tokens \(\d+\) exceeds the (context length|KV cache))"
    + "".join(f"|{re.escape('engine rejected the request: ' + reason.describe())}"
              for reason in (RejectReason.EXCEEDS_CONTEXT, RejectReason.EXCEEDS_KV_CAPACITY)))


class BadRequest(ValueError):
    """A request the gateway refuses; param: the field at fault (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# HTTP status -> OpenAI's error type (another 4xx: invalid_request_error; 5xx: server_error)
ERROR_TYPE = {401: "authentication_error", 429: "rate_limit_error"}

ROUTES = "GET /v1/models, POST /v1/completions and POST /v1/chat/completions"

# The largest request body read. aiohttp's default, 1 MiB, refused prompts the server takes:
# its default limit is 4 MiB of request (--max-request-mb), which JSON that escapes non-ASCII
# text (\uXXXX, as the OpenAI SDK sends it) writes in up to 3 times as many bytes.
MAX_BODY_BYTES = 16 << 20


# How long a request's body may go without a byte arriving
BODY_READ_TIMEOUT_S = 60.0


async def _read_body(request) -> bytes:
    """The request's body, up to MAX_BODY_BYTES (413 past it), each piece within
    BODY_READ_TIMEOUT_S (asyncio.TimeoutError): aiohttp waits for a body as long as its client
    takes, so a client that sent part of one and waited held its connection and a handler for
    good; a slow client that keeps sending is no such client."""
    from aiohttp import web
    body = bytearray()
    while piece := await asyncio.wait_for(request.content.readany(), BODY_READ_TIMEOUT_S):
        body += piece
        if len(body) > MAX_BODY_BYTES:
            raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY_BYTES,
                                                actual_size=len(body))
    return bytes(body)

# How long a response's model name, where the request named none, is taken as known
SERVED_NAME_TTL_S = 30.0

SHUTTING_DOWN = "server shutting down"  # (the front end's words for the same end)


def _error_body(status: int, message: str, code: str | None = None,
                param: str | None = None) -> dict:
    """OpenAI's error object, as a response's body or a stream's error event."""
    kind = ERROR_TYPE.get(status) or ("invalid_request_error" if status < 500
                                      else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error(web, status: int, message: str, code: str | None = None, param: str | None = None):
    return web.json_response(_error_body(status, message, code, param), status=status)


# The server's refusals that name a request field (nic_service/server.py's checks), as the
# `param` of OpenAI's error: "temperature must be >= 0", "at most 16 stop strings", ...
SERVER_PARAM = re.compile(r"^(?:at most \d+ )?(max_tokens|temperature|top_p|top_k|"
                          r"stop_token_ids|stop token id|stop strings|prompt)\b")
SERVER_PARAM_NAMES = {"stop token id": "stop_token_ids", "stop strings": "stop"}


def _blink_error_body(e: BlinkError, chat: bool | None = None) -> tuple[int, dict]:
    """(HTTP status, OpenAI's error body) for a Blink call's error; chat: which endpoint's
    prompt (messages or prompt) a context-length or prompt error names, None where neither."""
    status = HTTP_STATUS.get(e.code, 500)
    if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and GRPC_TOO_LARGE in e.details:
        status = 413  # (not the 429 that clients retry: no retry makes the request smaller)
    prompt = None if chat is None else "messages" if chat else "prompt"
    if e.code == grpc.StatusCode.INVALID_ARGUMENT and CONTEXT_LENGTH_EXCEEDED.match(e.details):
        return status, _error_body(status, e.details, "context_length_exceeded", prompt)
    named = (SERVER_PARAM.match(e.details) if e.code == grpc.StatusCode.INVALID_ARGUMENT
             else None)
    param = named and SERVER_PARAM_NAMES.get(named.group(1), named.group(1))
    return status, _error_body(status, e.details, e.code.name.lower(),
                               prompt if param == "prompt" else param)


def _blink_error(web, e: BlinkError, chat: bool | None = None):
    status, body = _blink_error_body(e, chat)
    return web.json_response(body, status=status)


# Parameters OpenAI's API has and Blink does not serve: a request that sets one to anything
# but its neutral value is a 400, not a completion that silently ignores it. (Parameters that
# change no output, such as user, metadata, store or prediction, are accepted and unused.)
UNSUPPORTED = {"n": (None, 1), "echo": (None, False), "logprobs": (None, False),
               "top_logprobs": (None,), "best_of": (None, 1), "suffix": (None, ""),
               "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
               "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
               "functions": (None, []), "function_call": (None, "none"),
               "modalities": (None, ["text"]), "audio": (None,), "reasoning_effort": (None,),
               "web_search_options": (None,),
               # vLLM's extensions that change the prompt or the sampling
               "chat_template": (None,), "chat_template_kwargs": (None, {}),
               "add_generation_prompt": (None, True), "continue_final_message": (None, False),
               "documents": (None, []), "repetition_penalty": (None, 1), "min_p": (None, 0),
               "min_tokens": (None, 0), "truncate_prompt_tokens": (None,),
               "prompt_logprobs": (None,), "use_beam_search": (None, False),
               "include_stop_str_in_output": (None, False), "bad_words": (None, []),
               "allowed_token_ids": (None,), "logits_processors": (None,),
               "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
               "guided_grammar": (None,), "structured_outputs": (None,),
               # the output keeps no special token (the detokenizer skips them)
               "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True)}


def _is_neutral(value, neutral: tuple) -> bool:
    """Whether value is one of neutral, JSON's booleans apart from its numbers (Python has
    False == 0: `"logprobs": 0`, which asks for the sampled tokens' logprobs, passed as
    false)."""
    return any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)


def _bool(body: dict, key: str) -> bool:
    """body[key] as a boolean; False when absent or null."""
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"'{key}' must be a boolean, got {value!r}", key)
    return bool(value)


def _int(body: dict, key: str, lo: int, hi: int) -> int | None:
    """body[key] as an int in [lo, hi]; None when absent or null."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():  # 2.0: an integer, as vLLM takes it
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BadRequest(f"'{key}' must be an integer in [{lo}, {hi}], got {value!r}", key)
    return value


def _number(body: dict, key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"'{key}' must be a number, got {value!r}", key)
    try:
        return float(value)
    except OverflowError:  # a JSON integer past a double (a 500 and a traceback before)
        raise BadRequest(f"'{key}' is out of range: a {len(str(value))}-digit integer",
                         key) from None


def special_tokens_from(body: dict, chat: bool) -> bool:
    """vLLM's add_special_tokens: whether a text prompt gets the tokenizer's special tokens
    (BOS). /v1/completions: true unless false (a client that writes its own BOS asks false,
    and got a second one); chat: the template writes them, so only false (vLLM's default) is
    served."""
    value = body.get("add_special_tokens")
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"'add_special_tokens' must be a boolean, got {value!r}",
                         "add_special_tokens")
    if chat:
        if value:
            raise BadRequest("'add_special_tokens' true is not supported on chat completions: "
                             "the chat template writes the special tokens",
                             "add_special_tokens")
        return True  # (a chat prompt's special tokens are the template's alone)
    return value is not False  # (token ids are sent as they are either way)


# /v1/completions' max_tokens when the request leaves it out (OpenAI's documented default, and
# vLLM's); chat completions default to the rest of the context, as the server does
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def sampling_from(body: dict, chat: bool) -> Sampling:
    """OpenAI request fields -> Blink sampling (unsupported values are a 400, not ignored;
    null is the default, as OpenAI documents)."""
    for key, neutral in UNSUPPORTED.items():
        if key in body and not _is_neutral(body[key], neutral):
            if key == "n":
                raise BadRequest(f"only n = 1 is supported, got {body[key]!r}", key)
            raise BadRequest(f"'{key}' is not supported by this server", key)
    if body.get("response_format") not in (None, {"type": "text"}):
        raise BadRequest("only the text response_format is supported", "response_format")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and isinstance(
            options.get("include_usage") or False, bool)):  # (null: the default, false)
        raise BadRequest("'stream_options' must be an object with a boolean 'include_usage'",
                         "stream_options")
    if options and not stream:  # (as OpenAI and vLLM refuse it; {} and null pass)
        raise BadRequest("'stream_options' can only be set when 'stream' is true",
                         "stream_options")
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) for x in stop):
        raise BadRequest("'stop' must be a string or a list of strings", "stop")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    seed = _int(body, "seed", -(1 << 63), (1 << 64) - 1)
    top_k = _int(body, "top_k", -1, (1 << 31) - 1)
    ignore_eos = _bool(body, "ignore_eos")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32
            for t in stop_ids):
        raise BadRequest("'stop_token_ids' must be a list of token ids", "stop_token_ids")
    max_tokens = _int(body, key, 0, (1 << 32) - 1)
    if max_tokens is None and not chat:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    return Sampling(max_tokens=max_tokens,
                    temperature=_number(body, "temperature"), top_p=_number(body, "top_p"),
                    top_k=None if top_k is None else max(top_k, 0),  # -1 (vLLM's off): 0
                    seed=None if seed is None else seed % (1 << 64), stop=tuple(stop),
                    stop_token_ids=tuple(stop_ids), ignore_eos=ignore_eos)


def cache_salt_from(body: dict) -> str:
    """vLLM's cache_salt: absent or null for none, else a non-empty string (as vLLM asks)."""
    salt = body.get("cache_salt")
    if salt is None:
        return ""
    if not isinstance(salt, str) or not salt:
        raise BadRequest("'cache_salt' must be a non-empty string", "cache_salt")
    return salt


# A message's fields for the tool calls Blink does not serve (tools is a 400): a conversation
# that carries one is a 400 too, not a prompt rendered without it.
TOOL_CALL_FIELDS = ("tool_calls", "function_call", "tool_call_id")


def _message(m, i: int) -> dict:
    """messages[i] as the server takes it: role, content (text parts joined with newlines, as
    vLLM joins them) and name, the participant's, which chat templates may print."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise BadRequest(f"{where} must be an object", where)
    content = m.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}.content[{j}]: only text content parts (with a "
                                 f"string 'text') are supported, got type {kind!r}",
                                 f"{where}.content")
        content = "\n".join(part["text"] for part in content)
    for key in TOOL_CALL_FIELDS:
        if m.get(key):
            raise BadRequest(f"{where}.{key}: tool calls are not supported by this server",
                             f"{where}.{key}")
    if not isinstance(m.get("role"), str):
        raise BadRequest(f"{where} needs a string 'role'", f"{where}.role")
    if not isinstance(content, str):
        raise BadRequest(f"{where} needs 'content', a string or a list of text parts",
                         f"{where}.content")
    name = m.get("name")
    if name is not None and not isinstance(name, str):
        raise BadRequest(f"{where}.name must be a string", f"{where}.name")
    return {"role": m["role"], "content": content, **({"name": name} if name else {})}


def _prompt(body: dict, chat: bool):
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list", "messages")
        return [_message(m, i) for i, m in enumerate(messages)]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 31
            for t in prompt)):
        return prompt
    raise BadRequest("'prompt' must be a string or a list of token ids (one prompt)", "prompt")


FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def _encodable(text: str) -> bool:
    """Whether text is Unicode text that UTF-8 can carry (JSON's \ud800 escape is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class WorkerConnections:
    """The gateway's connections to a Blink server: one to each of its front-end workers.

    A connection reaches one worker (`blink serve --workers N` runs N processes on one port,
    and the kernel spreads connections over them), and a worker queues a request for a slot of
    its own share alone: on one connection, the gateway in front of N workers had a worker's
    share of the slots (its requests past that waited --queue-timeout, then were a 429, the
    other shares' slots free). So it opens connections (each its own, not gRPC's shared one)
    and asks each which worker it reached (ServerStats.frontend_worker) until it holds one to
    every worker, at most PROBES_PER_WORKER tries a worker, and sends each request to the
    worker with the fewest of its calls in flight. (A connection that gRPC opens again later,
    after the server's --max-connection-age, may reach another worker: the requests then
    spread less evenly, and nothing fails.)"""

    PROBES_PER_WORKER = 8  # to miss one of 4 workers in 32 tries: about 4 * 0.75^32 = 4e-4

    def __init__(self, target: str, tls: Tls | None):
        self.target, self.tls = target, tls
        self.by_worker: dict[int, AsyncBlinkClient] = {}
        self.in_flight: dict[int, int] = {}  # the gateway's calls on each worker's connection
        self._found = False
        self._lock = asyncio.Lock()

    async def pick(self, token: str | None) -> tuple[int, AsyncBlinkClient]:
        """(worker, its connection) with the fewest calls in flight; the first call finds the
        workers (with the caller's bearer token: BlinkError as the caller's call would)."""
        if not self._found:
            await self._find_workers(token)
        worker = min(self.by_worker, key=lambda w: (self.in_flight[w], w))
        return worker, self.by_worker[worker]

    async def _find_workers(self, token: str | None) -> None:
        async with self._lock:
            tries = 0
            while not self._found:
                client = AsyncBlinkClient(self.target, tls=self.tls,
                                          options=[("grpc.use_local_subchannel_pool", 1)])
                try:
                    stats = await client.with_token(token).stats(timeout=10)
                except BaseException:
                    await client.close()
                    raise
                tries += 1
                worker, workers = stats["frontend_worker"], max(stats["frontend_workers"], 1)
                if worker in self.by_worker:
                    await client.close()
                else:
                    self.by_worker[worker], self.in_flight[worker] = client, 0
                self._found = (len(self.by_worker) >= workers
                               or tries >= self.PROBES_PER_WORKER * workers)

    async def close(self) -> None:
        for client in self.by_worker.values():
            await client.close()


def make_app(target: str, served_model_names: list[str] | None = None,
             shutdown_timeout: float | None = None, tls: Tls | None = None):
    """tls: the channel's to the server at target (None: plain). served_model_names: the
    names `model` may be (any other: 404), each listed by /v1/models; None: `model` is
    not checked, /v1/models lists the server's own name.
    shutdown_timeout: on shutdown, the requests in flight get this long (or until a second
    stop signal), then end with a "server shutting down" error (a stream: an error event, then
    [DONE])."""
    from aiohttp import web
    state: dict = {"streams": set()}  # (the Blink calls in flight)
    connections = WorkerConnections(target, tls)

    async def client_for(request) -> tuple[int, AsyncBlinkClient]:
        """(a front-end worker, the gateway's connection to it: WorkerConnections), with the
        request's bearer token and session header (if any) on its calls: the session routes a
        conversation to one replica behind Envoy."""
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        token = token if scheme.lower() == "bearer" else None
        worker, client = await connections.pick(token)
        return worker, client.with_token(token).with_session(
            request.headers.get(SESSION_HEADER) or None)

    async def served_name(client: AsyncBlinkClient) -> str:
        """The model name a response carries where the request named none (with
        --served-model-name, such a request is a 404), as OpenAI's and vLLM's carry the model
        that answered (it was ""). Asked again after SERVED_NAME_TTL_S: the target may be
        redeployed with another model."""
        name, asked = state.get("model_name", ("", -math.inf))
        if time.monotonic() - asked > SERVED_NAME_TTL_S:
            name = (await client.model_info(timeout=10)).name
            state["model_name"] = (name, time.monotonic())
        return name

    async def models(request):
        try:  # the caller's token checked by the server, whatever the listed name
            _, client = await client_for(request)
            name = (await client.model_info(timeout=10)).name
        except BlinkError as e:
            return _blink_error(web, e)
        except ValueError as e:  # a session header gRPC cannot carry
            return _error(web, 400, str(e))
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "blink"}
            for name in served_model_names or [name]]})

    async def generate(request, chat: bool):
        try:
            body = json.loads((await _read_body(request)).decode(request.charset or "utf-8"))
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            prompt, sampling = _prompt(body, chat), sampling_from(body, chat)
            cache_salt = cache_salt_from(body)
            adds_special_tokens = special_tokens_from(body, chat)
            model = body.get("model") or ""
            if not isinstance(model, str) or not _encodable(model):
                # (a lone surrogate, "\ud800", was echoed in the response's own `model`:
                # JSON that strict parsers refuse; the other text fields reach protobuf, which
                # refuses it)
                raise BadRequest(f"'model' must be a string of Unicode text, got {model!r}",
                                 "model")
        except BadRequest as e:
            return _error(web, 400, str(e), param=e.param)
        except asyncio.TimeoutError:
            late = _error(web, 408, f"the request body stopped arriving for "
                          f"{BODY_READ_TIMEOUT_S:g} s")
            late.force_close()  # (the rest of that body would hold the connection instead)
            return late
        except (ValueError, LookupError, RecursionError) as e:  # (a 500 and a traceback before)
            # JSON that does not parse, bytes that are not UTF-8, a charset Python does not know,
            # nesting deeper than the parser goes
            return _error(web, 400, f"the body is not JSON that can be read: {e}")
        if served_model_names and model not in served_model_names:
            return _error(web, 404, f"The model `{model}` does not exist.", "model_not_found",
                          "model")
        try:  # (what the SDK's request builder refuses; a session header gRPC cannot carry)
            worker, client = await client_for(request)
            model = model or await served_name(client)
            stream = client.stream(prompt, sampling, cache_salt=cache_salt,
                                   skip_special_tokens_in_prompt=not adds_special_tokens)
        except BlinkError as e:
            return _blink_error(web, e)
        except (TypeError, ValueError) as e:
            return _error(web, 400, str(e))
        connections.in_flight[worker] += 1
        state["streams"].add(stream)
        if state.get("giving_up"):  # (registered after the drain gave up the others)
            stream.cancel()
        try:  # a client that goes away (an error writing to it, or aiohttp's cancel of this
            # handler) cancels the request in the server rather than leave it generating
            return await (_stream if body.get("stream") is True else _complete)(
                web, request, body, chat, model, stream)
        finally:
            connections.in_flight[worker] -= 1
            state["streams"].discard(stream)
            stream.cancel()  # a no-op once the call has finished

    async def drain(app) -> None:
        """At shutdown (aiohttp has stopped listening): the calls in flight get
        shutdown_timeout, then are cancelled, which ends each with the shutting-down error. A
        second stop signal (Ctrl-C twice) cancels them at once: aiohttp's handler, still set,
        raised out of its shutdown (exit status 1, the streams cut mid-chunk)."""
        from blink.ring.lifecycle import STOP_SIGNALS

        def give_up() -> None:
            state["giving_up"] = True
            for stream in list(state["streams"]):
                stream.cancel()
        loop = asyncio.get_running_loop()
        loop.call_later(shutdown_timeout, give_up)
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, give_up)

    async def close(app) -> None:
        await connections.close()

    @web.middleware
    async def refusals_as_openai_errors(request, handler):
        """aiohttp's own refusals (a path not served, a method a path does not take, a body
        past MAX_BODY_BYTES) in OpenAI's error shape: they were text/plain pages."""
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            why = {404: f"this gateway serves {ROUTES}",
                   405: f"it takes {', '.join(sorted(getattr(e, 'allowed_methods', ())))}"}
            response = _error(web, e.status, f"{request.method} {request.path}: {e.reason}; "
                              f"{why.get(e.status, e.text)}")
            if "Allow" in e.headers:  # (a 405's list of methods, which HTTP requires)
                response.headers["Allow"] = e.headers["Allow"]
            return response

    app = web.Application(client_max_size=MAX_BODY_BYTES,
                          middlewares=[refusals_as_openai_errors])
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", lambda r: generate(r, chat=False))
    app.router.add_post("/v1/chat/completions", lambda r: generate(r, chat=True))
    app.on_cleanup.append(close)
    if shutdown_timeout is not None:
        app.on_shutdown.append(drain)
    return app


class _Shapes:
    """One request's response objects in OpenAI's shapes."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        self.created = int(time.time())

    def choice(self, text: str | None, finish: str | None, stream: bool) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        msg = {"content": text} if text is not None else {}
        if not stream:
            msg["role"] = "assistant"
        return {"index": 0, "delta" if stream else "message": msg, "logprobs": None,
                "finish_reason": finish}

    def envelope(self, stream: bool, choices: list, **more) -> dict:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat \
            else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **more}


def _usage(done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            # served from the prefix cache, as OpenAI reports its prompt caching
            "prompt_tokens_details": {"cached_tokens": done.cached_prompt_tokens}}


async def _complete(web, request, body: dict, chat: bool, model: str, stream):
    try:
        text = "".join([d.text async for d in stream])
    except BlinkError as e:
        return _blink_error(web, e, chat)
    done, shapes = stream.result, _Shapes(chat, model)
    if done is None:  # cancelled without an error: the gateway's drain gave it up
        return _error(web, 503, SHUTTING_DOWN, "unavailable")
    return web.json_response(shapes.envelope(
        False, [shapes.choice(text, FINISH.get(done.finish_reason, "stop"), False)],
        usage=_usage(done)))


async def _stream(web, request, body: dict, chat: bool, model: str, stream):
    """Server-sent events: (chat) the assistant's role, the text as it comes, the finish, (with
    stream_options.include_usage) a chunk of usage alone, then [DONE]. Headers go out once the
    server accepted the request, so an error before the first token is an HTTP status."""
    shapes, response = _Shapes(chat, model), None
    include_usage = (body.get("stream_options") or {}).get("include_usage")

    async def send(payload) -> None:
        await response.write(f"data: {json.dumps(payload)}\n\n".encode())

    async def send_chunk(choices: list) -> None:  # with include_usage, usage null but at the end
        await send(shapes.envelope(True, choices, **({"usage": None} if include_usage else {})))

    async def start() -> None:
        nonlocal response
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        if chat:
            await send_chunk([{"index": 0, "delta": {"role": "assistant"}, "logprobs": None,
                               "finish_reason": None}])
    try:
        async for delta in stream:
            if response is None:
                await start()
            if delta.text:
                await send_chunk([shapes.choice(delta.text, None, True)])
    except BlinkError as e:
        if response is None:
            return _blink_error(web, e, chat)
        await send(_blink_error_body(e, chat)[1])
        await response.write(b"data: [DONE]\n\n")
        return response
    if response is None:  # nothing streamed (a stop string at once, say)
        await start()
    done = stream.result
    if done is None:  # cancelled without an error: the gateway's drain gave it up
        await send(_error_body(503, SHUTTING_DOWN, "unavailable"))
        await response.write(b"data: [DONE]\n\n")
        return response
    await send_chunk([shapes.choice(None if chat else "", FINISH.get(done.finish_reason, "stop"),
                                    True)])
    if include_usage:
        await send(shapes.envelope(True, [], usage=_usage(done)))
    await response.write(b"data: [DONE]\n\n")
    return response


def cmd_openai(args) -> None:
    try:
        import aiohttp  # noqa: F401 (the `openai` extra)
    except ImportError:
        raise SystemExit("blink openai needs aiohttp: .venv/bin/pip install -e '.[openai]'")
    app = make_app(args.target, args.served_model_name, args.shutdown_timeout, _tls(args))
    try:
        asyncio.run(_serve(app, args))
    except OSError as e:  # the port taken, say
        raise SystemExit(f"blink openai: {e}") from None


def _tls(args) -> Tls | None:
    """The channel's TLS as the client commands' flags give theirs: the files read at start,
    one that cannot be used a line there, not every request's error."""
    from blink.client.cli import tls_from_args
    try:
        return tls_from_args(args)
    except (OSError, ValueError) as e:  # (ValueError: a cert without its key, or the reverse)
        raise SystemExit(f"blink openai: {e}") from None


async def _serve(app, args) -> None:
    """aiohttp's run_app, with the listening socket at hand: the banner names the port bound
    (run_app's banner said 0 for --port 0). Each of `blink serve`'s four stop signals drains
    (the app's on_shutdown; aiohttp handled SIGTERM and SIGINT alone, and SIGHUP ended the
    gateway at once, its streams cut). A request that aiohttp cannot parse gets
    _connection_class()'s refusal."""

    from aiohttp import web

    from blink.ring.lifecycle import STOP_SIGNALS
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    # handler_cancellation: a client's disconnect cancels its handler (and its request);
    # aiohttp's own timeout a little longer than the drain's, which ends the streams itself
    runner = web.AppRunner(app, handler_cancellation=True,
                           shutdown_timeout=args.shutdown_timeout + 2)
    await runner.setup()
    connection = _connection_class()
    try:  # (keepalive_timeout and backlog: run_app's)
        listener = await loop.create_server(
            lambda: connection(runner.server, loop=loop, keepalive_timeout=75),
            args.host, args.port, backlog=128)
        port = listener.sockets[0].getsockname()[1]
        print(f"blink openai: http://{args.host}:{port}/v1 -> Blink at {args.target}",
              flush=True)
        await stop.wait()
        listener.close()  # no new connections; the open ones drain in the cleanup
    finally:
        await runner.cleanup()


def _connection_class():
    """aiohttp's connection handler, but for a request its parser refuses (a header past
    8,190 bytes, a control character in one, ...): aiohttp's 400 page and its logged traceback
    quoted the bytes that failed, an Authorization header's bearer token among them. The
    refusal here is a 400 in OpenAI's error shape and a log line, each naming the parser's
    error class alone. (aiohttp's limits stay: they hold the longest token a Blink server
    takes, cli.py's MAX_TOKEN_CHARS and the scheme, with room to spare.)"""
    from aiohttp import web
    from aiohttp.http_exceptions import HttpProcessingError

    class Connection(web.RequestHandler):
        def handle_error(self, request, status=500, exc=None, message=None):
            if not isinstance(exc, HttpProcessingError):  # a handler's failure: aiohttp's 500
                return super().handle_error(request, status, exc, message)
            what = type(exc).__name__
            # (a port scanner's or a TLS client's bytes fail as a method: aiohttp logs those
            # at debug, as the probes they mostly are)
            log = self.logger.debug if what == "BadHttpMethod" else self.logger.info
            log("%d: a request from %s that cannot be read (%s)", status, request.remote, what)
            response = _error(web, status, f"the request cannot be read as HTTP ({what})")
            response.force_close()  # (the parser's state is lost, as aiohttp's own closes)
            return response
    return Connection
