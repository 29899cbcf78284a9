"""The gRPC front end: validates, tokenizes, submits through the ring, streams text back.

It never calls into the engine process: everything goes through `EngineLink`, i.e. one-sided
reads and writes on the engine's ring. Health (grpc.health.v1) follows the link's view of the
engine; reflection lets grpcurl and SDK generators discover the API.
"""
from __future__ import annotations

import array
import asyncio
import hmac
import json
import logging
import math
import secrets
import socket
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from tokenizers import Tokenizer

from blink.nic_service.chat_template import load_chat_template, load_special_tokens, render_chat
from blink.nic_service.detokenizer import IncrementalDetokenizer, StopStringMatcher
from blink.nic_service.metrics import FrontendMetrics, RequestClock
from blink.nic_service.engine_link import (
    EngineLink, EngineUnavailable, Finished, RequestHandle, SlotsExhausted, Tokens,
)
from blink.ring.layout import (
    MAX_STOP_IDS, EngineKind, FinishReason, RejectReason, cache_salt_word,
)
from blink.ring.lifecycle import watch_stop_signals
from blink.v1 import blink_pb2 as pb
from blink.v1 import blink_pb2_grpc as pb_grpc

log = logging.getLogger("blink.frontend")

ENGINE_NAMES = {EngineKind.CPU_REFERENCE: "cpu-reference", EngineKind.CUDA: "cuda",
                EngineKind.HOST_DRIVEN_CUDA: "cuda-host-driven",
                EngineKind.HF_TRANSFORMERS: "hf-transformers", EngineKind.SYNTHETIC: "synthetic"}
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Blink"].full_name
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# A prompt of more characters than this is tokenized (and, as messages, rendered) on the large
# prompts' own thread, one at a time, so that a few clients' megabyte prompts (which take
# seconds, and are often refused as over the context only after) do not take every thread of
# the event loop's default pool, where every other request's prompt waits for one: 8 of 2.3 MB
# held a 2-token request 44 s on the 2-core VM. 64 K characters take about 25 ms (the demo
# model's tokenizer, on that VM).
LARGE_PROMPT_CHARS = 64 * 1024


@dataclass(frozen=True)
class FrontendConfig:
    model_dir: Path                    # for tokenizer.json, tokenizer_config.json, config.json
    ring_name: str
    host: str = "127.0.0.1"
    port: int = 50051                  # 0 picks a free port
    queue_timeout_s: float = 30.0      # how long a request may wait for a free ring slot
    max_queued: int = 1024             # at most this many wait for a slot; more: RESOURCE_EXHAUSTED
    engine_timeout_s: float = 3.0      # no heartbeat for this long: the engine is dead
    max_request_bytes: int = 4 << 20   # larger requests get INVALID_ARGUMENT
    metrics_port: int | None = None    # Prometheus /metrics on this port (0: any free); None: off
    # the port is held for this worker by `blink serve` (cli._check_metrics_ports): its metrics
    # server binds beside that socket with SO_REUSEPORT; otherwise alone, so a port in use fails
    metrics_port_held: bool = False
    # its address; None: host's (unauthenticated: no more exposed than the gRPC port)
    metrics_host: str | None = None
    tls_cert: Path | None = None       # PEM certificate chain and key: TLS on the gRPC port
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # PEM CA bundle: clients must present a certificate it signed
    auth_token: str | None = None      # Blink RPCs need metadata "authorization: Bearer <token>"
    keepalive_time_s: float = 60.0     # server pings idle connections this often
    max_connection_age_s: float | None = None  # then GOAWAY: L4/L7 balancers get to rebalance
    max_connection_age_grace_s: float | None = None  # then its streams are cut (None: never)
    worker: tuple[int, int] = (0, 1)   # (index, count): front-end processes sharing port and ring
    # a stream's tokens go out at most once per this many seconds, several to a message when the
    # engine is faster (its first token and its end at once); 0: each engine step's as it comes
    stream_interval_s: float = 0.0
    poll_interval_s: float = 0.0002    # live records checked this often (EngineLink)
    rdma_engine: tuple[str, int] | None = None  # the engine's RDMA CM (IP, port): its ring by RDMA
    rdma_group: int = 0  # the same for every worker of one front end (EngineLink)


class InvalidRequest(ValueError):
    prompt_tokens = 0  # the prompt's, where it was refused after it was tokenized


@dataclass
class Prepared:
    prompt_ids: np.ndarray             # [prompt tokens] int32
    slot_fields: dict
    stops: list[str]
    terminal_ids: frozenset[int]       # tokens that end generation and are never shown as text
    return_token_ids: bool
    client_request_id: str = ""


class PromptCodec:
    """The model's tokenizer and chat template, loaded once."""

    def __init__(self, model_dir: Path):
        """Raises OSError with one line saying which file is missing or unreadable."""
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the front end needs the model's tokenizer")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises plain Exception on a malformed file
            raise OSError(f"cannot load {path}: {e}") from None
        if self.tokenizer.truncation is not None or self.tokenizer.padding is not None:
            # a setting saved with the file (a tokenizer saved after a call that truncated):
            # as in transformers, prompts are neither cut nor padded unless asked
            log.warning("%s has a saved truncation or padding setting: not applied to prompts",
                        path)
            self.tokenizer.no_truncation()
            self.tokenizer.no_padding()
        try:
            self.chat_template = load_chat_template(model_dir)
            self.special_tokens = load_special_tokens(model_dir)
        except (ValueError, OSError) as e:
            raise OSError(f"cannot read the chat template or the tokenizer's config: {e}") \
                from None
        config_path = Path(model_dir) / "config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        # `architectures`: a list of names, or one name, which load_config takes too
        archs = config.get("architectures") or ["unknown"]
        self.architecture = archs if isinstance(archs, str) else archs[0]

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch, not encode: tokenizers' encode holds the GIL for the whole text (2.7 s
        # for a 3.9 MB prompt), so the event loop's thread, and every stream it serves, would
        # wait on one large prompt even from another thread; encode_batch releases it
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def render(self, messages: list[dict[str, str]]) -> str:
        if self.chat_template is None:
            raise InvalidRequest("this model has no chat template; send `text` or `token_ids`")
        try:
            return render_chat(self.chat_template, messages, add_generation_prompt=True,
                               **self.special_tokens)
        except ValueError as e:
            raise InvalidRequest(f"chat template failed: {e}") from None


def token_id_array(ids: Sequence[int]) -> np.ndarray:
    """A TokenIds message's ids as a uint32 array. Through array.array: NumPy converts a list of
    ints one checked int at a time, so a 2,100-token prompt took 0.15 ms to list, check against
    the vocabulary and convert, and now 0.05 (the slice, one copy out of protobuf, is most of it).
    """
    return np.frombuffer(array.array("I", ids[:]), np.uint32)


def _check_float(name: str, value: float, ok: bool, want: str) -> None:
    if not math.isfinite(value) or not ok:
        raise InvalidRequest(f"{name} must be {want}, got {value}")


@dataclass(frozen=True)
class Undecodable:
    """What a request deserializes to when its bytes are not a valid message of its type
    (malformed wire data, invalid UTF-8 in a string field): the RPC answers INVALID_ARGUMENT
    instead of gRPC's own UNKNOWN and a server-side traceback."""
    error: str


def add_blink_service(servicer: pb_grpc.BlinkServicer, server: grpc.aio.Server) -> None:
    """blink_pb2_grpc.add_BlinkServicer_to_server, with request parsing that hands the servicer
    an Undecodable rather than failing inside gRPC. Built from the service descriptor, so every
    RPC of blink.proto is covered. A streaming RPC (Generate) is registered with a streaming
    request, the same call on the wire: its handler runs as the call arrives and reads its one
    request itself (context.read), so it sees a call that ends before its request is read (a
    deadline that passes first: gRPC ended those before a unary request's handler ran)."""
    from google.protobuf import message_factory
    from google.protobuf.message import DecodeError

    def tolerant(cls):
        def parse(data: bytes):
            try:
                return cls.FromString(data)
            except DecodeError as e:
                return Undecodable(str(e) or "malformed message")
        return parse

    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["Blink"].methods:
        make = (grpc.stream_stream_rpc_method_handler if method.server_streaming
                else grpc.unary_unary_rpc_method_handler)
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=tolerant(message_factory.GetMessageClass(method.input_type)),
            response_serializer=message_factory.GetMessageClass(
                method.output_type).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME,
                                                                         handlers),))


def undecodable_why(request) -> str | None:
    """Why the request could not be decoded, or None: it was."""
    if isinstance(request, Undecodable):
        return f"the request could not be decoded: {request.error}"
    return None


async def refuse_undecodable(request, context) -> None:
    if why := undecodable_why(request):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)


def chunk_message(text: str, token_ids: Sequence[int] = ()) -> pb.GenerateResponse:
    """A chunk of the stream, filled in place: a third of the cost of the nested constructors
    (which build a Chunk and copy it in), paid once per streamed message."""
    message = pb.GenerateResponse()
    message.chunk.text = text  # sets the oneof, also to an empty text
    if token_ids:
        message.chunk.token_ids.extend(token_ids)
    return message


# the most of a client's free-form text (its request id, a model name) that a log line or an
# error shows (a 1 MB id made a line of a million characters; a 100 KB model name, echoed in
# the error's status header, failed the call with RESOURCE_EXHAUSTED), then its length
LOGGED_CLIENT_ID_CHARS = 128


def _cut(text: str) -> str:
    """text, or its first LOGGED_CLIENT_ID_CHARS characters and its length."""
    if len(text) <= LOGGED_CLIENT_ID_CHARS:
        return text
    return f"{text[:LOGGED_CLIENT_ID_CHARS]}... ({len(text)} characters)"


def log_request(handle: RequestHandle | None, prep: Prepared | None, clock: RequestClock,
                outcome: str, generated: int) -> None:
    """One line per finished request: ids, token counts, latencies and how it ended (as JSON
    fields too, under --log-format json). No handle: it ended before it had a slot (no request
    id); no prep: before its prompt was read."""
    now = time.monotonic()
    client_id = _cut(prep.client_request_id) if prep else ""
    fields = dict(request_id=handle.request_id if handle else None,
                  client_request_id=client_id,
                  prompt_tokens=len(prep.prompt_ids) if prep else clock.prompt_tokens,
                  completion_tokens=generated,
                  ttft_s=round(clock.first - clock.received, 6) if clock.first else None,
                  total_s=round(now - clock.received, 6), outcome=outcome)
    log.info("request %s%s: %d prompt + %d generated tokens, first token %s, total %.3f s: %s",
             handle.request_id if handle else "(no slot)",
             f" (client id {client_id!r})" if client_id else "",
             fields["prompt_tokens"], generated,
             f"{fields['ttft_s']:.3f} s" if fields["ttft_s"] is not None else "none",
             fields["total_s"], outcome, extra={"request": fields})


class BlinkServicer(pb_grpc.BlinkServicer):
    def __init__(self, config: FrontendConfig, codec: PromptCodec, link: EngineLink,
                 metrics: FrontendMetrics | None = None):
        self.config = config
        self.codec = codec
        self.link = link
        self.metrics = metrics
        self.draining = False  # set by Frontend.drain: new requests are refused
        self.large_prompts = ThreadPoolExecutor(1, thread_name_prefix="blink-large-prompt")

    async def _off_loop(self, chars: int, fn, *args):
        """fn(*args) on a thread: the event loop's default pool, or the large prompts' own
        thread for a prompt of more than LARGE_PROMPT_CHARS characters."""
        pool = self.large_prompts if chars > LARGE_PROMPT_CHARS else None
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    # -- validation (everything the engine would reject, with a message a person reads) -------

    async def _prepare(self, req: pb.GenerateRequest) -> Prepared:
        info = self.link.info
        size = req.ByteSize()  # a serialization's work: once
        if size > self.config.max_request_bytes:
            raise InvalidRequest(f"request is {size} bytes; the limit is "
                                 f"{self.config.max_request_bytes}")
        if req.model and req.model != info.model_name:  # (echoed cut: it goes in a header)
            raise InvalidRequest(f"unknown model {_cut(req.model)!r}; this server serves "
                                 f"{info.model_name!r}")
        kind = req.WhichOneof("prompt")
        if kind == "text":
            if not req.text:
                raise InvalidRequest("prompt is empty")
            ids = await self._off_loop(len(req.text), self.codec.encode, req.text,
                                       not req.skip_special_tokens_in_prompt)
        elif kind == "token_ids":
            ids = token_id_array(req.token_ids.ids)
            outside = ids >= info.vocab_size
            if outside.any():
                raise InvalidRequest(f"token id {ids[outside][0]} is outside the vocabulary "
                                     f"(size {info.vocab_size})")
            ids = ids.view(np.int32)  # every id below the vocabulary size: the same values
        elif kind == "messages":
            # a name only where one was given: templates test `message.name is defined`
            messages = [{"role": m.role, "content": m.content}
                        | ({"name": m.name} if m.name else {}) for m in req.messages.messages]
            if not messages:
                raise InvalidRequest("messages is empty")
            chars = sum(len(m.content) for m in req.messages.messages)
            text = await self._off_loop(chars, self.codec.render, messages)
            ids = await self._off_loop(len(text), self.codec.encode, text, False)
        else:
            raise InvalidRequest("prompt is empty: set text, token_ids or messages")
        try:
            return self._checked(req, info, ids)
        except InvalidRequest as e:  # its log line says how long the prompt it refused was
            e.prompt_tokens = len(ids)
            raise

    @staticmethod
    def _checked(req: pb.GenerateRequest, info, ids) -> Prepared:
        """The request with its prompt's ids, checked against the model (`info`, the engine's
        as the request was read) and the limits."""
        if not len(ids):
            raise InvalidRequest("prompt is empty after tokenization")
        ctx = info.context_length
        if len(ids) >= ctx:
            raise InvalidRequest(f"prompt has {len(ids)} tokens; the context length is {ctx} "
                                 f"and at least one token must be generated")

        s = req.sampling
        room = min(ctx, info.kv_capacity_tokens or ctx)  # what one sequence can hold
        if s.HasField("max_tokens"):
            max_tokens = s.max_tokens
        else:  # as much as the context, and the whole KV cache where that is smaller, allow
            if len(ids) >= room:
                raise InvalidRequest(f"prompt has {len(ids)} tokens; the KV cache holds {room} "
                                     f"and at least one token must be generated")
            max_tokens = room - len(ids)
        if max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1")
        if len(ids) + max_tokens > ctx:
            raise InvalidRequest(f"prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) "
                                 f"exceeds the context length {ctx}")
        if len(ids) + max_tokens > room:  # (the engine refused it, a slot's round trip later)
            raise InvalidRequest(f"prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) "
                                 f"exceeds the KV cache's {room} tokens")
        temperature = s.temperature if s.HasField("temperature") else 1.0
        _check_float("temperature", temperature, temperature >= 0, ">= 0")
        top_p = s.top_p if s.HasField("top_p") else 1.0
        _check_float("top_p", top_p, 0 < top_p <= 1, "in (0, 1]")
        top_k = s.top_k
        if top_k > info.vocab_size:
            raise InvalidRequest(f"top_k must be at most the vocabulary size {info.vocab_size}")
        if len(s.stop_token_ids) > MAX_STOP_IDS:
            raise InvalidRequest(f"at most {MAX_STOP_IDS} stop_token_ids")
        bad = [t for t in s.stop_token_ids if t >= info.vocab_size]
        if bad:
            raise InvalidRequest(f"stop token id {bad[0]} is outside the vocabulary "
                                 f"(size {info.vocab_size})")
        stops = list(s.stop)
        if len(stops) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not x or len(x) > MAX_STOP_STRING_CHARS for x in stops):
            raise InvalidRequest(f"stop strings must be 1 to {MAX_STOP_STRING_CHARS} characters")
        # the OS's random bits: NumPy's global generator took 0.1 ms of a request, its code
        # out of cache by the time the next request comes
        seed = s.seed if s.HasField("seed") else secrets.randbits(64)
        terminal = set(s.stop_token_ids)
        if not s.ignore_eos:
            terminal |= set(info.eos_ids)
        prompt = np.asarray(ids, np.int32)  # token_ids: already, without a copy
        return Prepared(
            prompt_ids=prompt,
            slot_fields=dict(prompt=prompt, max_tokens=max_tokens,
                             temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                             ignore_eos=s.ignore_eos, stop_ids=tuple(s.stop_token_ids),
                             cache_salt=cache_salt_word(req.cache_salt)),
            stops=stops, terminal_ids=frozenset(terminal),
            return_token_ids=req.return_token_ids, client_request_id=req.client_request_id)

    # -- RPCs -----------------------------------------------------------------------------------

    async def Generate(self, requests, context):
        """requests: unused; the one request is read here (add_blink_service says why)."""
        clock = RequestClock(self.metrics, time.monotonic())
        clock.budget = context.time_remaining()  # the deadline as the header gave it (_expired)
        try:
            request = await context.read()
        except asyncio.CancelledError:  # the client went away or the deadline passed first
            self._gone(context, clock, None, None)
            raise
        if request is grpc.aio.EOF:
            await self._no_request(context, clock)
            return
        # the timings from the request as read, as when gRPC read it before the handler ran
        clock.received = time.monotonic()
        # refusals before the prompt is read count and log as the later ones do (an engine
        # outage's UNAVAILABLE left request_failure_total silent)
        if why := undecodable_why(request):
            await self._fail(context, clock, grpc.StatusCode.INVALID_ARGUMENT, why)
        if self.draining:
            await self._fail(context, clock, grpc.StatusCode.UNAVAILABLE, "server shutting down")
        if not self.link.alive:
            await self._fail(context, clock, grpc.StatusCode.UNAVAILABLE,
                             "the engine is not available")
        prep = None
        try:
            prep = await self._prepare(request)
            clock.prompt_tokens = len(prep.prompt_ids)
            handle = await self.link.submit(prep.slot_fields)
        except InvalidRequest as e:
            clock.prompt_tokens = e.prompt_tokens  # (for its log line: it has no first token)
            await self._fail(context, clock, grpc.StatusCode.INVALID_ARGUMENT, str(e), prep)
        except SlotsExhausted as e:
            await self._fail(context, clock, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), prep)
        except EngineUnavailable as e:
            await self._fail(context, clock, grpc.StatusCode.UNAVAILABLE, str(e), prep)
        except asyncio.CancelledError:  # before it had a slot: queued for one, or tokenizing
            self._gone(context, clock, None, prep)
            raise
        try:
            async for response in self._stream(prep, handle, clock, context):
                yield response
        except Exception:  # (not an abort: those count their code first) a bug of ours
            if not clock.ended:
                log.exception("request %s failed", handle.request_id)
                log_request(handle, prep, clock, "internal error", clock.generated)
                clock.failed("INTERNAL")
            raise
        finally:
            if not clock.ended:
                # gRPC cancelled this handler, in the stream (CancelledError) or in its own
                # send of a message (then the generator is closed at its yield: only this runs)
                self._gone(context, clock, handle, prep)
            self.link.cancel(handle)  # no-op when the engine already finished it

    async def _no_request(self, context, clock: RequestClock) -> None:
        """The call's request stream ended without its message: gRPC ended the call before it
        came (its deadline passed, it was cancelled, or the message is over gRPC's size limit,
        which gRPC answered RESOURCE_EXHAUSTED), or the client sent none (INVALID_ARGUMENT)."""
        if _expired(context, clock):
            self._gone(context, clock, None, None)
            return
        try:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no request message")
        except grpc.aio.AbortError:  # the client did get it: a call without a request
            log_request(None, None, clock, "refused, INVALID_ARGUMENT: no request message", 0)
            clock.failed("INVALID_ARGUMENT")
            raise
        except Exception:
            # the call had ended in gRPC: the client cancelled it, or its message was over
            # gRPC's size limit (gRPC answered RESOURCE_EXHAUSTED). The two look the same here
            # (an EOF, then a status that cannot be sent), so both count as the client's
            # cancel: they went uncounted and unlogged.
            log_request(None, None, clock, "ended before its request was read: cancelled by "
                        "the client, or its message was over gRPC's size limit", 0)
            clock.failed("CANCELLED")

    def _gone(self, context, clock: RequestClock, handle: RequestHandle | None,
              prep: Prepared | None) -> None:
        """Counts and logs a request whose client went away or whose deadline passed, or that
        the server's stop cancelled."""
        expired = _expired(context, clock)
        why = ("deadline exceeded" if expired else "cancelled at shutdown" if self.draining
               else "cancelled by the client")
        log_request(handle, prep, clock, why if handle else f"{why} before it had a slot",
                    clock.generated)
        clock.failed("DEADLINE_EXCEEDED" if expired else "CANCELLED")

    async def _fail(self, context, clock: RequestClock, code: grpc.StatusCode, message: str,
                    prep: Prepared | None = None, handle: RequestHandle | None = None,
                    outcome: str | None = None):
        """Ends a request with an error: counted, logged once (a request refused before it had
        a slot as "refused", but a full queue's: an overload's retries would flood the log;
        the metric counts them; one that had a slot with its `outcome`), aborted."""
        if handle is not None:
            log_request(handle, prep, clock, outcome or code.name, clock.generated)
        elif code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            log_request(None, prep, clock, f"refused, {code.name}: {_cut(message)}", 0)
        clock.failed(code.name)
        await context.abort(code, message)

    async def _stream(self, prep: Prepared, handle: RequestHandle, clock: RequestClock,
                      context):
        detok = IncrementalDetokenizer(self.codec.tokenizer)
        stopper = StopStringMatcher(prep.stops) if prep.stops else None
        received = clock.received

        def final(reason, matched: str, preemptions: int,
                  cached_tokens: int) -> pb.GenerateResponse:
            now = time.monotonic()
            name = pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()
            clock.finished(name)
            log_request(handle, prep, clock, name, clock.generated)
            return pb.GenerateResponse(final=pb.Final(
                finish_reason=reason, matched_stop=matched,
                usage=pb.Usage(prompt_tokens=len(prep.prompt_ids),
                               completion_tokens=clock.generated),
                timings=pb.Timings(time_to_first_token_s=(clock.first or now) - received,
                                   total_s=now - received, preemptions=preemptions,
                                   cached_prompt_tokens=cached_tokens),
                request_id=str(handle.request_id)))

        def text_of(ids: list[int]) -> tuple[str, str | None, list[int]]:
            """(the text ids add to the stream, the stop string it completes or None, the ids
            up to the one that completes it). With stop strings, a token at a time: the stream
            ends on the token that completes one, as in vLLM, and usage and token_ids count
            no token the engine generated after it."""
            if stopper is None:
                return detok.push(ids if prep.terminal_ids.isdisjoint(ids) else
                                  [t for t in ids if t not in prep.terminal_ids]), None, ids
            pieces = []
            for k, token in enumerate(ids):
                piece, matched = stopper.feed(
                    detok.push(() if token in prep.terminal_ids else (token,)))
                pieces.append(piece)
                if matched is not None:
                    return "".join(pieces), matched, ids[:k + 1]
            return "".join(pieces), None, ids

        while True:
            event = await handle.events.get()
            # a client that is behind gets what is queued as one chunk: one detokenizer pass,
            # one message (the per-token cost that bounds the front end)
            while isinstance(event, Tokens) and not handle.events.empty():
                nxt = handle.events.get_nowait()
                if not isinstance(nxt, Tokens):
                    handle.events.put_nowait(nxt)  # the queue held only this: it stays last
                    break
                event = Tokens(event.ids + nxt.ids)
            if isinstance(event, Exception):
                await self._fail(context, clock, grpc.StatusCode.UNAVAILABLE, str(event), prep,
                                 handle, f"unavailable: {event}")
            if isinstance(event, Tokens):
                text, matched, ids = text_of(event.ids)
                clock.tokens(len(ids))
                # token_ids: every generated token, the final EOS or stop token too (so they
                # add up to usage.completion_tokens); text: never the terminal token
                if text or prep.return_token_ids:
                    yield chunk_message(text, ids if prep.return_token_ids else ())
                if matched is not None:
                    self.link.cancel(handle, stop_matched=True)
                    yield final(pb.FINISH_REASON_STOP, matched, *self.link.counts_so_far(handle))
                    return
                continue
            assert isinstance(event, Finished)
            if event.reason is FinishReason.REJECTED:
                code = (grpc.StatusCode.INTERNAL if event.detail == RejectReason.CORRUPT
                        else grpc.StatusCode.INVALID_ARGUMENT)
                why = RejectReason(event.detail).describe()
                await self._fail(context, clock, code, f"engine rejected the request: {why}",
                                 prep, handle, f"rejected: {why}")
            if event.reason is FinishReason.CANCELLED:
                await self._fail(context, clock, grpc.StatusCode.CANCELLED,
                                 "the request was cancelled", prep, handle, "cancelled")
            text = detok.flush()
            matched = None
            if stopper is not None:
                text, matched = stopper.feed(text)
                if matched is None:
                    text += stopper.flush()  # what could have started a stop, and did not
            if text:
                yield chunk_message(text)
            if matched is not None:
                reason = pb.FINISH_REASON_STOP
            elif event.reason is FinishReason.EOS:
                reason, matched = pb.FINISH_REASON_EOS, ""
            elif event.reason is FinishReason.STOP_TOKEN:
                reason, matched = pb.FINISH_REASON_STOP, str(event.detail)
            else:  # LENGTH, CONTEXT_FULL
                reason, matched = pb.FINISH_REASON_LENGTH, ""
            yield final(reason, matched, event.preemptions, event.cached_tokens)
            return

    async def GetModelInfo(self, request, context):
        await refuse_undecodable(request, context)
        info = self.link.info
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is not available")
        return pb.ModelInfo(name=info.model_name, architecture=self.codec.architecture,
                            context_length=info.context_length, vocab_size=info.vocab_size,
                            eos_token_ids=info.eos_ids,
                            has_chat_template=self.codec.chat_template is not None,
                            engine=ENGINE_NAMES[info.engine_kind])

    async def GetServerStats(self, request, context):
        await refuse_undecodable(request, context)
        link = self.link
        worker, workers = self.config.worker
        stats = pb.ServerStats(engine_alive=link.alive,
                               ring_slots_in_use=link.server_slots_in_use,  # every worker's
                               requests_waiting_for_slot=link.server_waiting_for_slot,
                               engine_attachments=link.attachments,
                               frontend_worker=worker, frontend_workers=workers)
        h = link.header_snapshot()
        if h is not None and link.info is not None:
            stats.ring_slots = link.info.geometry.num_slots
            for name in ("kv_blocks_total", "kv_blocks_free", "kv_block_size",
                         "kv_blocks_cached", "sequences_running", "sequences_waiting"):
                setattr(stats, name, int(h[name]))
            stats.prefix_caching = bool(h["prefix_caching"])
        totals = link.counter_totals()  # summed over engine restarts
        for name in ("requests_admitted", "requests_finished", "requests_cancelled",
                     "requests_rejected", "preemptions", "tokens_generated", "engine_steps",
                     "prefix_query_tokens", "prefix_hit_tokens", "prefix_evicted_blocks"):
            setattr(stats, name, totals[name])
        stats.engine_busy_ns = totals["busy_ns"]
        stats.engine_step_tokens = totals["step_tokens"]
        return stats


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def enable_reflection(server: grpc.aio.Server, services: tuple[str, ...]) -> None:
    """Server reflection under both names clients ask for: grpc.reflection.v1 (grpcurl and
    current tools try it first) and v1alpha (grpcio-reflection's own). The two protocols'
    messages are identical on the wire, so one servicer answers both."""
    from grpc_reflection.v1alpha import reflection_pb2
    names = (*services, reflection.SERVICE_NAME, REFLECTION_V1)
    servicer = reflection.aio.ReflectionServicer(names)
    for service in (reflection.SERVICE_NAME, REFLECTION_V1):
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString),
        }),))


class BearerTokenCheck(grpc.aio.ServerInterceptor):
    """Blink's RPCs need `authorization: Bearer <token>` metadata; health and reflection stay
    open (load balancers and probes call them without credentials). Each refusal logs a line
    with its peer, and a refused Generate counts in request_failure_total (neither did: a
    client guessing tokens left no trace)."""

    def __init__(self, token: str, metrics: FrontendMetrics | None = None):
        self.expected = token.encode()
        self.metrics = metrics

    async def intercept_service(self, continuation, details):
        if details.method.startswith(f"/{SERVICE_NAME}/"):
            # every authorization header must carry the token (of two, the last one decided),
            # the scheme's name in any case (RFC 7235)
            given = [str(value) for key, value in details.invocation_metadata or ()
                     if key == "authorization"]
            if not given or not all(
                    scheme.lower() == "bearer" and hmac.compare_digest(token.encode(),
                                                                       self.expected)
                    for scheme, _, token in (value.partition(" ") for value in given)):
                return _refusal(details.method, self.metrics)
        return await continuation(details)


# The client's stack rounds a deadline up as it writes it into the call's grpc-timeout header
# (gRPC's encoding keeps few digits: 1.0 s arrives as 1.008, 1,000.3 as 1,009.999), so the
# client's own deadline passes first, and its cancel reaches the server with up to about 1% of
# the header's time left: time that close to the server's deadline counts as the deadline's.
# (A client that cancels that close to its deadline is counted as its deadline.)
DEADLINE_ROUNDING = 0.011  # of the deadline the header gave (1 h: 3,601 s came as 3,610)
DEADLINE_SLACK_S = 0.05    # and a cancel's way from the client
DEADLINE_SLACK_MAX_S = 15.0  # (a day-long deadline's rounding is a smaller part of it)


def _expired(context, clock: RequestClock) -> bool:
    """Whether the call ended at its deadline (the server's, or the client's of the same
    call, which the header rounded up: DEADLINE_ROUNDING)."""
    remaining = context.time_remaining()
    if remaining is None:
        return False
    return remaining <= max(DEADLINE_SLACK_S,
                            min(DEADLINE_ROUNDING * (clock.budget or 0.0), DEADLINE_SLACK_MAX_S))


def announce(line: str) -> None:
    """A line for the operator (listening, serving) on stdout; where the logs are JSON lines
    (--log-format json: a formatter with json_lines), a log record of it instead: stdout and
    stderr both reach journald or the pod's log, whose parser a plain line breaks."""
    if any(getattr(h.formatter, "json_lines", False) for h in logging.getLogger().handlers):
        # at INFO, or at the level the logs are cut at (--log-level warning kept print's line)
        log.log(max(logging.INFO, log.getEffectiveLevel()), line)
    else:
        print(line, flush=True)


def unbracketed(host: str) -> str:
    """A host as a socket takes it: gRPC's "[::1]" is "::1"."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def metrics_address(host: str) -> str:
    """The metrics endpoint's address where --metrics-host is unset: gRPC's own `host`, but for
    0.0.0.0, which gRPC takes as every address of both families (it listens on [::]): "::"
    where the host has IPv6 (both families on Linux), so that an IPv6-only cluster scrapes the
    pod's metrics as it reaches its gRPC port (0.0.0.0 alone is IPv4's)."""
    if host != "0.0.0.0":
        return host
    try:  # prometheus_client's socket takes the system's default: both families unless
        # net.ipv6.bindv6only says IPv6 alone, where 0.0.0.0 stays (IPv4 scrapers keep it)
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::", 0))
            if probe.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY):
                return host
    except OSError:
        return host
    return "::"


def _is_loopback(host: str) -> bool:
    """Whether the address (or name) is this host's loopback: 127.0.0.0/8, ::1, localhost."""
    import ipaddress
    try:
        return ipaddress.ip_address(unbracketed(host)).is_loopback
    except ValueError:
        return host == "localhost"


def _refusal(method: str, metrics: FrontendMetrics | None):
    """A handler that answers UNAUTHENTICATED, in the method's streaming shape."""
    generate = method.endswith("/Generate")  # (a request: counted as the others are)

    async def refuse(request, context):
        why = "missing or wrong bearer token (metadata 'authorization')"
        log.info("refused %s from %s, UNAUTHENTICATED: %s", _cut(method), context.peer(), why)
        if generate:
            RequestClock(metrics, time.monotonic()).failed("UNAUTHENTICATED")
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
    if generate:  # (with a streaming request, as add_blink_service has it: runs unread)
        return grpc.stream_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class Frontend:
    """The running front end: gRPC server, health, reflection and the engine link."""

    def __init__(self, config: FrontendConfig):
        self.config = config
        self.codec = PromptCodec(config.model_dir)
        self.health = health.aio.HealthServicer()
        self.link = EngineLink(config.ring_name, queue_timeout_s=config.queue_timeout_s,
                               max_queued=config.max_queued,
                               engine_timeout_s=config.engine_timeout_s,
                               stream_interval_s=config.stream_interval_s,
                               poll_interval_s=config.poll_interval_s,
                               on_alive_change=self._on_alive_change,
                               worker=config.worker, rdma_engine=config.rdma_engine,
                               rdma_group=config.rdma_group)
        # the engine's own gauges and counters from the first worker only
        self.metrics = FrontendMetrics(self.link, engine_wide=config.worker[0] == 0) \
            if config.metrics_port is not None else None
        self.metrics_port: int | None = None
        self.server: grpc.aio.Server | None = None
        self.servicer: BlinkServicer | None = None
        self.port: int | None = None

    def _on_alive_change(self, alive: bool) -> None:
        if self.servicer is not None and self.servicer.draining:
            return  # shutting down: stays NOT_SERVING
        status = (health_pb2.HealthCheckResponse.SERVING if alive
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", SERVICE_NAME):
            asyncio.ensure_future(self.health.set(name, status))

    async def start(self) -> int:
        limit = self.config.max_request_bytes
        # gRPC's own limit sits above ours so an oversized prompt gets our INVALID_ARGUMENT
        cfg = self.config
        options = [
            ("grpc.max_receive_message_length", 2 * limit + (1 << 20)),
            ("grpc.max_send_message_length", 64 << 20),
            # a port in use is an error, not a silent second server; workers share theirs
            ("grpc.so_reuseport", 1 if cfg.worker[1] > 1 else 0),
            ("grpc.keepalive_time_ms", int(cfg.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
        ]
        if cfg.max_connection_age_s:
            options.append(("grpc.max_connection_age_ms", int(cfg.max_connection_age_s * 1000)))
            if cfg.max_connection_age_grace_s is not None:  # gRPC's default: no limit
                options.append(("grpc.max_connection_age_grace_ms",
                                 int(cfg.max_connection_age_grace_s * 1000)))
        interceptors = [BearerTokenCheck(cfg.auth_token, self.metrics)] if cfg.auth_token else []
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        self.servicer = BlinkServicer(self.config, self.codec, self.link, self.metrics)
        add_blink_service(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_reflection(self.server, (SERVICE_NAME, health.SERVICE_NAME))
        address = f"{self.config.host}:{self.config.port}"
        try:
            if cfg.tls_cert:
                self.port = self.server.add_secure_port(address, self._tls_credentials())
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError:  # grpc raises this when the bind fails
            self.port = 0
        if self.port == 0:
            raise OSError(f"cannot listen on {address} (in use, or not an address of this "
                          f"host)")
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.metrics is not None:
            host = (metrics_address(unbracketed(cfg.host)) if cfg.metrics_host is None
                    else unbracketed(cfg.metrics_host))
            self.metrics_port = self.metrics.serve(cfg.metrics_port, host,
                                                   reuse_port=cfg.metrics_port_held)
            log.info("Prometheus metrics on http://%s:%d/metrics",
                     f"[{host}]" if ":" in host else host, self.metrics_port)
        await self.link.start()
        if self.config.worker[0] > 0:
            # an extra worker takes connections (SO_REUSEPORT hands it some) only once it can
            # serve them; worker 0 listens at once and answers health while the engine starts
            while not self.link.alive:
                await asyncio.sleep(0.05)
        await self.server.start()
        index, count = self.config.worker
        log.info("front end%s listening on %s:%d (ring %s)",
                 f" worker {index + 1}/{count}" if count > 1 else "", self.config.host,
                 self.port, self.link.ring_where)
        if cfg.auth_token and not cfg.tls_cert and index == 0 and not _is_loopback(cfg.host):
            log.warning("the bearer token travels in clear text on %s: add --tls-cert and "
                        "--tls-key unless a proxy terminates TLS in front", cfg.host)
        return self.port

    def _tls_credentials(self) -> grpc.ServerCredentials:
        cfg = self.config
        if not cfg.tls_key:
            raise OSError("--tls-cert needs --tls-key")
        try:
            pair = (cfg.tls_key.read_bytes(), cfg.tls_cert.read_bytes())
            ca = cfg.tls_client_ca.read_bytes() if cfg.tls_client_ca else None
        except OSError as e:
            raise OSError(f"cannot read the TLS files: {e}") from None
        return grpc.ssl_server_credentials([pair], root_certificates=ca,
                                           require_client_auth=ca is not None)

    async def drain(self, timeout_s: float, hurry: asyncio.Event | None = None) -> None:
        """Graceful shutdown, first half: health NOT_SERVING, new requests UNAVAILABLE
        "server shutting down", and up to timeout_s for the streams in flight to finish, or
        until `hurry` is set (a second stop signal: an operator who pressed Ctrl-C twice)."""
        self.servicer.draining = True
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + timeout_s
        hurried = hurry.is_set if hurry is not None else lambda: False
        while (self.link.slots_in_use or self.link.waiting_for_slot) \
                and time.monotonic() < deadline and not hurried():
            await asyncio.sleep(0.05)
        left = self.link.slots_in_use + self.link.waiting_for_slot
        log.info("drained: %s", f"{left} streams still open at "
                 f"{'a second stop signal' if hurried() else 'the timeout'}" if left
                 else "no stream in flight")
        # what is still open ends as shutting down (not as an engine that went away, which is
        # what it would say once the engine stops)
        self.link.give_up_live(EngineUnavailable("server shutting down"))

    async def stop(self, grace: float = 1.0) -> None:
        await self.health.enter_graceful_shutdown()
        if self.server is not None:
            await self.server.stop(grace)
            self.servicer.large_prompts.shutdown(wait=False, cancel_futures=True)
        await self.link.stop()


async def serve(config: FrontendConfig, ready_file: Path | None = None, *,
                shutdown_timeout_s: float = 30.0, on_stop=None, on_hurry=None,
                repeats_hurry: bool = True) -> None:
    """Runs one front end until a STOP_SIGNALS signal, then drains; a second signal, or
    HURRY_SIGNAL, ends the drain at once (blink.ring.lifecycle.watch_stop_signals; a worker
    process passes repeats_hurry=False). on_stop() and on_hurry(): called when each arrives
    (the parent of several workers passes them on). The signals
    are taken from the start: an extra worker waits in start() for the engine, and one stopped
    there still ends through this function (its caller's clean-up runs)."""
    frontend = Frontend(config)
    stop, hurry = asyncio.Event(), asyncio.Event()
    watch_stop_signals(asyncio.get_running_loop(), stop, hurry, repeats_hurry=repeats_hurry)
    starting, stopping = (asyncio.ensure_future(frontend.start()),
                          asyncio.ensure_future(stop.wait()))
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():  # stopped before it ever served
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        if on_stop is not None:
            on_stop()
        await frontend.stop(grace=0)
        return
    stopping.cancel()
    port = starting.result()
    if ready_file is not None:
        ready_file.write_text(str(port))
    if config.worker[0] == 0:
        announce(f"blink front end listening on {config.host}:{port}")
    await stop.wait()
    if on_stop is not None:
        on_stop()
    passing_on = asyncio.ensure_future(when_set(hurry, on_hurry))
    try:
        await frontend.drain(shutdown_timeout_s, hurry=hurry)
        await frontend.stop()  # (its grace lets the streams given up end with their error)
    finally:
        passing_on.cancel()


async def when_set(event: asyncio.Event, then) -> None:
    """then() once `event` is set (nothing for None)."""
    await event.wait()
    if then is not None:
        then()
