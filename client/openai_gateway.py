"""`blink openai`: an OpenAI-compatible HTTP gateway in front of a Blink server, so OpenAI SDKs
and the usual benchmark tools work against Blink unchanged.

    blink openai --target 127.0.0.1:50051 --port 8000
    curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

It is a gRPC client of the front end (aiohttp, the `openai` extra) and stays off the CPU-free
path: run it where HTTP clients need it. Endpoints: GET /v1/models; POST /v1/completions
(prompt: a string or token ids) and POST /v1/chat/completions (messages through the model's
chat template), both with `stream` (server-sent events ending in `data: [DONE]`, a usage chunk
before it with `stream_options.include_usage`). Parameters: max_tokens (max_completion_tokens),
temperature, top_p, top_k, seed, stop (string or list), n = 1, and vLLM's extensions
ignore_eos and stop_token_ids (which benchmark tools send) and cache_salt (a non-empty string:
the prefix cache's namespace, blink.proto's GenerateRequest.cache_salt); null is the default;
one that Blink does not serve (logprobs, echo, penalties, tools, vLLM's chat_template_kwargs and
continue_final_message, ...) set to anything but its neutral value is a 400; with
--served-model-name, a model not among its names is a 404 (model_not_found), else `model` is
not checked (clients send Hub ids or paths). An `Authorization: Bearer KEY` header is passed
on as the gRPC bearer token, an `x-blink-session` header as the SDK's session (Envoy routes a
session to one replica: deploy/envoy/envoy.yaml). Blink's errors map to HTTP statuses
(INVALID_ARGUMENT 400, UNAUTHENTICATED 401, RESOURCE_EXHAUSTED 429, UNAVAILABLE 503,
DEADLINE_EXCEEDED 504) with OpenAI's error body. A client that disconnects cancels its
request in the server. The channel to the server takes the client commands' TLS flags
(--tls, --tls-ca, --tls-cert, --tls-key: TLS or mutual TLS).
"""
from __future__ import annotations

import json
import secrets
import time

import grpc

from blink.client.sdk import SESSION_HEADER, AsyncBlinkClient, BlinkError, Sampling, Tls

HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
               grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
               grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.CANCELLED: 499}


class BadRequest(ValueError):
    pass


# HTTP status -> OpenAI's error type
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error",
              404: "invalid_request_error", 429: "rate_limit_error"}


SHUTTING_DOWN = "server shutting down"  # (the front end's words for the same end)


def _error(web, status: int, message: str, code: str | None = None):
    kind = ERROR_TYPE.get(status, "server_error")
    return web.json_response({"error": {"message": message, "type": kind, "param": None,
                                        "code": code}}, status=status)


def _blink_error(web, e: BlinkError):
    return _error(web, HTTP_STATUS.get(e.code, 500), e.details, e.code.name.lower())


# Parameters OpenAI's API has and Blink does not serve: a request that sets one to anything
# but its neutral value is a 400, not a completion that silently ignores it.
UNSUPPORTED = {"echo": (None, False), "logprobs": (None, False), "top_logprobs": (None,),
               "best_of": (None, 1), "suffix": (None, ""), "presence_penalty": (None, 0),
               "frequency_penalty": (None, 0), "logit_bias": (None, {}), "tools": (None, []),
               "tool_choice": (None, "none"), "functions": (None, []),
               "function_call": (None, "none"),
               # vLLM's extensions that change the prompt or the sampling
               "chat_template": (None,), "chat_template_kwargs": (None, {}),
               "add_generation_prompt": (None, True), "continue_final_message": (None, False),
               "documents": (None, []), "repetition_penalty": (None, 1), "min_p": (None, 0),
               "min_tokens": (None, 0)}


def _int(body: dict, key: str, lo: int, hi: int) -> int | None:
    """body[key] as an int in [lo, hi]; None when absent or null."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BadRequest(f"'{key}' must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _number(body: dict, key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"'{key}' must be a number, got {value!r}")
    return float(value)


# /v1/completions' max_tokens when the request leaves it out (OpenAI's documented default, and
# vLLM's); chat completions default to the rest of the context, as the server does
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def sampling_from(body: dict, chat: bool) -> Sampling:
    """OpenAI request fields -> Blink sampling (unsupported values are a 400, not ignored;
    null is the default, as OpenAI documents)."""
    if body.get("n") not in (None, 1):
        raise BadRequest("only n = 1 is supported")
    for key, neutral in UNSUPPORTED.items():
        if key in body and body[key] not in neutral:
            raise BadRequest(f"'{key}' is not supported by this server")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise BadRequest("only the text response_format is supported")
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and isinstance(
            options.get("include_usage", False), bool)):
        raise BadRequest("'stream_options' must be an object with a boolean 'include_usage'")
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) for x in stop):
        raise BadRequest("'stop' must be a string or a list of strings")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    seed = _int(body, "seed", -(1 << 63), (1 << 64) - 1)
    top_k = _int(body, "top_k", -1, (1 << 31) - 1)
    ignore_eos = body.get("ignore_eos") or False
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(ignore_eos, bool):
        raise BadRequest("'ignore_eos' must be a boolean")
    if not isinstance(stop_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32
            for t in stop_ids):
        raise BadRequest("'stop_token_ids' must be a list of token ids")
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
        raise BadRequest("'cache_salt' must be a non-empty string")
    return salt


def _prompt(body: dict, chat: bool):
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list")
        out = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                if not all(isinstance(p, dict) and p.get("type") == "text"
                           and isinstance(p.get("text"), str) for p in content):
                    raise BadRequest("only text content parts are supported")
                content = "\n".join(p["text"] for p in content)  # as vLLM joins them
            if not isinstance(content, str) or not isinstance(m.get("role"), str):
                raise BadRequest("each message needs a string 'role' and text 'content'")
            out.append({"role": m["role"], "content": content})
        return out
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 31
            for t in prompt)):
        return prompt
    raise BadRequest("'prompt' must be a string or a list of token ids (one prompt)")


FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def make_app(target: str, served_model_names: list[str] | None = None,
             shutdown_timeout: float | None = None, tls: Tls | None = None):
    """tls: the channel's to the server at target (None: plain). served_model_names: the
    names `model` may be (any other: 404), the first listed by /v1/models; None: `model` is
    not checked, /v1/models lists the server's own name.
    shutdown_timeout: on shutdown, the requests in flight get this long (or until a second
    stop signal), then end with a "server shutting down" error (a stream: an error event, then
    [DONE])."""
    import asyncio

    from aiohttp import web
    state: dict = {"streams": set()}  # (the Blink calls in flight)

    def client_for(request) -> AsyncBlinkClient:
        """The gateway's one channel, with the request's bearer token and session header (if
        any) on its calls: the session routes a conversation to one replica behind Envoy."""
        if "client" not in state:
            state["client"] = AsyncBlinkClient(target, tls=tls)
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        return state["client"].with_token(token if scheme.lower() == "bearer" else None) \
            .with_session(request.headers.get(SESSION_HEADER) or None)

    async def models(request):
        try:  # the caller's token checked by the server, whatever the listed name
            name = (await client_for(request).model_info(timeout=10)).name
        except BlinkError as e:
            return _blink_error(web, e)
        except ValueError as e:  # a session header gRPC cannot carry
            return _error(web, 400, str(e))
        if served_model_names:
            name = served_model_names[0]
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "blink"}]})

    async def generate(request, chat: bool):
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            prompt, sampling = _prompt(body, chat), sampling_from(body, chat)
            cache_salt = cache_salt_from(body)
        except BadRequest as e:
            return _error(web, 400, str(e))
        except (ValueError, LookupError, RecursionError) as e:  # (a 500 and a traceback before)
            # JSON that does not parse, bytes that are not UTF-8, a charset Python does not know,
            # nesting deeper than the parser goes
            return _error(web, 400, f"the body is not JSON that can be read: {e}")
        model = body.get("model") or ""
        if served_model_names and model not in served_model_names:
            return _error(web, 404, f"The model `{model}` does not exist.", "model_not_found")
        try:  # (what the SDK's request builder refuses; a session header gRPC cannot carry)
            stream = client_for(request).stream(prompt, sampling, cache_salt=cache_salt)
        except (TypeError, ValueError) as e:
            return _error(web, 400, str(e))
        state["streams"].add(stream)
        if state.get("giving_up"):  # (registered after the drain gave up the others)
            stream.cancel()
        try:  # a client that goes away (an error writing to it, or aiohttp's cancel of this
            # handler) cancels the request in the server rather than leave it generating
            return await (_stream if body.get("stream") else _complete)(
                web, request, body, chat, model, stream)
        finally:
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
        if "client" in state:
            await state["client"].close()

    app = web.Application()
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
        return _blink_error(web, e)
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
            return _blink_error(web, e)
        await send({"error": {"message": e.details, "type": ERROR_TYPE.get(
            HTTP_STATUS.get(e.code, 500), "server_error"), "code": e.code.name.lower()}})
        await response.write(b"data: [DONE]\n\n")
        return response
    if response is None:  # nothing streamed (a stop string at once, say)
        await start()
    done = stream.result
    if done is None:  # cancelled without an error: the gateway's drain gave it up
        await send({"error": {"message": SHUTTING_DOWN, "type": "server_error",
                              "code": "unavailable"}})
        await response.write(b"data: [DONE]\n\n")
        return response
    await send_chunk([shapes.choice(None if chat else "", FINISH.get(done.finish_reason, "stop"),
                                    True)])
    if include_usage:
        await send(shapes.envelope(True, [], usage=_usage(done)))
    await response.write(b"data: [DONE]\n\n")
    return response


def cmd_openai(args) -> None:
    import asyncio
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
    import asyncio

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
