"""`blink openai`: an OpenAI-compatible HTTP gateway in front of a Blink server, so OpenAI SDKs
and the usual benchmark tools work against Blink unchanged.

    blink openai --target 127.0.0.1:50051 --port 8000
    curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

It is a gRPC client of the front end (aiohttp, the `openai` extra) and stays off the CPU-free
path: run it where HTTP clients need it. Endpoints: GET /v1/models; POST /v1/completions
(prompt: a string or token ids) and POST /v1/chat/completions (messages through the model's
chat template), both with `stream` (server-sent events ending in `data: [DONE]`). Parameters:
max_tokens (max_completion_tokens), temperature, top_p, top_k, seed, stop (string or list),
n = 1. An `Authorization: Bearer KEY` header is passed on as the gRPC bearer token. Blink's
errors map to HTTP statuses (INVALID_ARGUMENT 400, UNAUTHENTICATED 401, RESOURCE_EXHAUSTED 429,
UNAVAILABLE 503, DEADLINE_EXCEEDED 504) with OpenAI's error body.
"""
from __future__ import annotations

import json
import secrets
import time

import grpc

from blink.client.sdk import AsyncBlinkClient, BlinkError, Sampling

HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
               grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
               grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.CANCELLED: 499}


class BadRequest(ValueError):
    pass


def _error(web, status: int, message: str, kind: str):
    return web.json_response({"error": {"message": message, "type": kind, "code": status}},
                             status=status)


def sampling_from(body: dict) -> Sampling:
    """OpenAI request fields -> Blink sampling (unsupported values are a 400, not ignored)."""
    if body.get("n", 1) != 1:
        raise BadRequest("only n = 1 is supported")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    try:
        return Sampling(max_tokens=None if max_tokens is None else int(max_tokens),
                        temperature=_opt_float(body, "temperature"),
                        top_p=_opt_float(body, "top_p"),
                        top_k=None if body.get("top_k") is None else int(body["top_k"]),
                        seed=None if body.get("seed") is None else int(body["seed"]), stop=stop)
    except (TypeError, ValueError) as e:
        raise BadRequest(f"bad sampling parameter: {e}") from None


def _opt_float(body: dict, key: str) -> float | None:
    return None if body.get(key) is None else float(body[key])


def _prompt(body: dict, chat: bool):
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list")
        out = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(content, str) or not isinstance(m.get("role"), str):
                raise BadRequest("each message needs a string 'role' and text 'content'")
            out.append({"role": m["role"], "content": content})
        return out
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(isinstance(t, int) for t in prompt)):
        return prompt
    raise BadRequest("'prompt' must be a string or a list of token ids (one prompt)")


FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def make_app(target: str):
    from aiohttp import web
    state: dict = {}

    async def client_for(request) -> AsyncBlinkClient:
        auth = request.headers.get("Authorization", "")
        token = auth[7:] if auth.startswith("Bearer ") else None
        if token not in state:
            state[token] = AsyncBlinkClient(target, token=token)
        return state[token]

    async def models(request):
        try:
            info = await (await client_for(request)).model_info(timeout=10)
        except BlinkError as e:
            return _error(web, HTTP_STATUS.get(e.code, 500), e.details, e.code.name.lower())
        return web.json_response({"object": "list", "data": [
            {"id": info.name, "object": "model", "created": 0, "owned_by": "blink"}]})

    async def generate(request, chat: bool):
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            prompt, sampling = _prompt(body, chat), sampling_from(body)
        except (BadRequest, json.JSONDecodeError) as e:
            return _error(web, 400, str(e), "invalid_request_error")
        client = await client_for(request)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        created, model = int(time.time()), body.get("model") or ""
        kind = "chat.completion" if chat else "text_completion"

        def choice(text: str | None, finish: str | None, stream: bool) -> dict:
            if not chat:
                return {"index": 0, "text": text or "", "logprobs": None,
                        "finish_reason": finish}
            key = "delta" if stream else "message"
            msg = {"content": text} if text is not None else {}
            if not stream:
                msg["role"] = "assistant"
            return {"index": 0, key: msg, "logprobs": None, "finish_reason": finish}

        stream = client.stream(prompt, sampling)
        if not body.get("stream"):
            try:
                text = "".join([d.text async for d in stream])
            except BlinkError as e:
                return _error(web, HTTP_STATUS.get(e.code, 500), e.details, e.code.name.lower())
            done = stream.result
            return web.json_response({
                "id": rid, "object": kind, "created": created, "model": model,
                "choices": [choice(text, FINISH.get(done.finish_reason, "stop"), False)],
                "usage": {"prompt_tokens": done.prompt_tokens,
                          "completion_tokens": done.completion_tokens,
                          "total_tokens": done.prompt_tokens + done.completion_tokens,
                          # served from the prefix cache, as OpenAI reports its prompt caching
                          "prompt_tokens_details": {
                              "cached_tokens": done.cached_prompt_tokens}}})

        chunk_kind = "chat.completion.chunk" if chat else "text_completion"
        response = None

        async def send(payload) -> None:
            await response.write(f"data: {json.dumps(payload)}\n\n".encode())

        def frame(text, finish) -> dict:
            return {"id": rid, "object": chunk_kind, "created": created, "model": model,
                    "choices": [choice(text, finish, True)]}
        try:
            async for delta in stream:
                if response is None:  # headers only once the server accepted the request
                    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                           "Cache-Control": "no-cache"})
                    await response.prepare(request)
                    if chat:
                        await send({**frame(None, None), "choices": [{
                            "index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
                if delta.text:
                    await send(frame(delta.text, None))
        except BlinkError as e:
            if response is None:
                return _error(web, HTTP_STATUS.get(e.code, 500), e.details,
                              e.code.name.lower())
            await send({"error": {"message": e.details, "type": e.code.name.lower()}})
            await response.write(b"data: [DONE]\n\n")
            return response
        if response is None:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
        done = stream.result
        await send(frame(None if chat else "", FINISH.get(done.finish_reason, "stop")))
        await response.write(b"data: [DONE]\n\n")
        return response

    async def close(app) -> None:
        for c in state.values():
            await c.close()

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", lambda r: generate(r, chat=False))
    app.router.add_post("/v1/chat/completions", lambda r: generate(r, chat=True))
    app.on_cleanup.append(close)
    return app


def cmd_openai(args) -> None:
    try:
        from aiohttp import web
    except ImportError:
        raise SystemExit("blink openai needs aiohttp: pip install 'blink-serve[openai]'")
    print(f"blink openai: http://{args.host}:{args.port}/v1 -> Blink at {args.target}",
          flush=True)
    web.run_app(make_app(args.target), host=args.host, port=args.port, print=None)
