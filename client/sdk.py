"""Python client for the Blink gRPC API (blink.v1), blocking and asyncio.

    with BlinkClient("localhost:50051") as client:
        for delta in client.stream("Once upon a time", Sampling(max_tokens=32)):
            print(delta.text, end="", flush=True)

    async with AsyncBlinkClient("localhost:50051") as client:
        completion = await client.generate([{"role": "user", "content": "Hi"}])

Both clients share `build_request` (prompt + sampling -> GenerateRequest) and `_Folder`
(GenerateResponse messages -> Deltas, then one Completion); they differ only in how they wait.
Every failed call raises BlinkError; its codes are documented at the top of blink.proto.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import math
import numbers
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from blink.v1 import blink_pb2, blink_pb2_grpc

# The name the server registers with grpc.health.v1 (SERVING only while the engine answers).
HEALTH_SERVICE = "blink.v1.Blink"

# Long token-id prompts and chat transcripts exceed gRPC's 4 MiB default.
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    # While the server is down a channel waits between connection attempts, each wait 1.6
    # times the last, up to gRPC's 120 s; calls in a wait fail UNAVAILABLE at once, so after a
    # 30 s outage a client failed for 14 s more with the server back. At most 1 s now.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
_READY_POLL_S = 0.1
# gRPC keeps a deadline as int64 nanoseconds since the epoch: a timeout past about 9e9 s
# overflows it and the call failed DEADLINE_EXCEEDED at once (so did inf). One past 1e9 s
# (31 years) is taken as no deadline.
_NO_DEADLINE_PAST_S = 1e9

# Text, token ids, or chat messages ({"role": ..., "content": ...}, "name": ... optional).
Prompt = Union[str, Sequence[int], Sequence[Mapping[str, str]]]


class BlinkError(Exception):
    """A failed Blink call. `code` is the grpc.StatusCode, `details` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(code, details)  # both in args, so the error pickles
        self.code = code
        self.details = details

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}"


def _seconds(what: str, value: Any, *, zero_ok: bool = False) -> float:
    """value as float seconds; TypeError for a non-number (a bool too), ValueError for NaN or
    one below the range (gRPC failed such a call DEADLINE_EXCEEDED, with no word on why, and
    wait_ready(nan) polled forever)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__}")
    if not (value >= 0 if zero_ok else value > 0):  # (NaN compares false)
        raise ValueError(f"{what} must be {'>=' if zero_ok else '>'} 0 seconds, got {value!r}")
    return float(value)


def _deadline(timeout: float | None) -> float | None:
    """A call's timeout as gRPC takes it: None (or inf, or past _NO_DEADLINE_PAST_S) for none."""
    if timeout is None:
        return None
    timeout = _seconds("timeout", timeout)
    return None if timeout > _NO_DEADLINE_PAST_S else timeout


def _blink_error(error: grpc.RpcError) -> BlinkError:
    # Errors raised by calls are also grpc.Call objects; a bare RpcError carries no status.
    if not callable(getattr(error, "code", None)):
        return BlinkError(grpc.StatusCode.UNKNOWN, str(error))
    return BlinkError(error.code(), error.details() or "")


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters; a None field leaves the server's default (see SamplingParams)."""

    max_tokens: int | None = None
    temperature: float | None = None  # 0.0 is greedy
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()  # a single string is one stop sequence
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        # a str is iterable: stop="\n\n" must not become a stop at every "\n"
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        for name, value in (("stop", stop), ("stop_token_ids", self.stop_token_ids)):
            if isinstance(value, (bytes, Mapping)) or not isinstance(value, Iterable):
                raise TypeError(f"{name} must be a sequence, not {type(value).__name__}")
            object.__setattr__(self, name, tuple(value))

    def to_proto(self) -> blink_pb2.SamplingParams:
        """The message; TypeError or ValueError naming the field protobuf refuses (its own
        said not which, or "bad argument type for built-in operation" for a stop of 1)."""
        msg = blink_pb2.SamplingParams()
        # The scalars are proto3 `optional`: assigning one marks it present even when it is 0,
        # so only the caller's choices are assigned and temperature=0.0 still reaches the server.
        for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos"):
            value = getattr(self, name)
            if value is not None:
                # a bool is no number: protobuf took True as 1 (with a warning at most)
                if isinstance(value, bool) and name != "ignore_eos":
                    raise TypeError(f"{name} must be a number, not bool")
                with _naming(name):
                    setattr(msg, name, value)
                _check_float32(name, value, getattr(msg, name))
        for i, stop in enumerate(self.stop):
            if not isinstance(stop, str):  # protobuf also took bytes, as UTF-8
                raise TypeError(f"stop[{i}] must be a str, not {type(stop).__name__}")
        with _naming("stop"):
            msg.stop.extend(self.stop)
        if not all(_is_token_id(t) for t in self.stop_token_ids):
            raise TypeError(f"stop_token_ids must be token ids (int), got {self.stop_token_ids}")
        with _naming("stop_token_ids"):
            msg.stop_token_ids.extend(self.stop_token_ids)
        return msg


def _check_float32(name: str, value, sent) -> None:
    """ValueError for a finite number the message's float32 field cannot hold: 1e300 became
    inf and 1e-50 became 0, which the server refused as "got inf" and "got 0.0"."""
    if not isinstance(value, float) or not math.isfinite(value):
        return
    if math.isinf(sent) or (sent == 0) != (value == 0):
        raise ValueError(f"{name}: {value!r} is outside what a float32 holds (it would be sent "
                         f"as {sent!r})")


@contextlib.contextmanager
def _naming(field: str):
    """Prefixes protobuf's TypeError or ValueError with the field (its own names none; a str
    with a lone surrogate is its UnicodeEncodeError, a ValueError here)."""
    try:
        yield
    except (TypeError, ValueError) as e:
        raise (TypeError if isinstance(e, TypeError) else ValueError)(f"{field}: {e}") from None


@dataclass(frozen=True)
class Delta:
    """One streamed piece of generated text (whole characters)."""

    text: str
    token_ids: tuple[int, ...]  # empty unless return_token_ids was set


@dataclass(frozen=True)
class Completion:
    """A finished generation: the concatenated deltas plus the final message's fields."""

    text: str
    token_ids: tuple[int, ...]  # empty unless return_token_ids was set
    finish_reason: str  # "eos" | "length" | "stop"
    matched_stop: str  # the stop string, or stop token id as decimal text; "" if none
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token_s: float
    total_s: float
    preemptions: int
    cached_prompt_tokens: int  # prompt tokens reused from the prefix cache (no prefill for them)
    request_id: str  # the server's id, as in its logs


@dataclass(frozen=True)
class ModelInfo:
    name: str
    architecture: str
    context_length: int  # prompt plus generation, in tokens
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool
    engine: str  # "cpu-reference" | "cuda" | "cuda-host-driven" | "hf-transformers" | "synthetic"

    @classmethod
    def from_proto(cls, msg: blink_pb2.ModelInfo) -> ModelInfo:
        return cls(
            name=msg.name,
            architecture=msg.architecture,
            context_length=msg.context_length,
            vocab_size=msg.vocab_size,
            eos_token_ids=tuple(msg.eos_token_ids),
            has_chat_template=msg.has_chat_template,
            engine=msg.engine,
        )


def _stats_dict(msg: blink_pb2.ServerStats) -> dict[str, Any]:
    # Not MessageToDict: it follows JSON rules and turns the uint64 counters into strings.
    return {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}


def _is_token_id(t) -> bool:
    """An integer, NumPy's too, and not a bool (protobuf takes a bool for 1 or 0 with a
    deprecation warning only)."""
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def build_request(
    prompt: Prompt,
    sampling: Sampling | None = None,
    *,
    return_token_ids: bool = False,
    model: str = "",
    client_request_id: str = "",
    cache_salt: str = "",
    skip_special_tokens_in_prompt: bool = False,
) -> blink_pb2.GenerateRequest:
    """The GenerateRequest for a prompt: str -> text, ints -> token_ids, dicts -> messages.
    client_request_id: your id for the request, in the server's log line for it. cache_salt:
    the prefix cache's namespace (requests reuse cached prompt prefixes only under the same
    salt; see blink.proto). skip_special_tokens_in_prompt: a text prompt is tokenized without
    the tokenizer's special tokens (e.g. BOS) added. TypeError for a sequence of anything else
    (a bool is no token id), ValueError for an id outside uint32 (the server checks the model's
    vocabulary); either names the argument it refuses."""
    request = blink_pb2.GenerateRequest(
        return_token_ids=return_token_ids,
        skip_special_tokens_in_prompt=skip_special_tokens_in_prompt)
    for name, value in (("model", model), ("client_request_id", client_request_id),
                        ("cache_salt", cache_salt)):
        if value is None:  # (protobuf's constructor took None as unset)
            continue
        if not isinstance(value, str):  # protobuf: "bad argument type for built-in operation"
            raise TypeError(f"{name} must be a str, not {type(value).__name__}")
        with _naming(name):
            setattr(request, name, value)
    if sampling is not None:
        if not isinstance(sampling, Sampling):
            raise TypeError(f"sampling must be a Sampling, not {type(sampling).__name__}")
        request.sampling.CopyFrom(sampling.to_proto())
    if isinstance(prompt, str):
        with _naming("prompt"):
            request.text = prompt
        return request
    if isinstance(prompt, (bytes, Mapping)) or not isinstance(prompt, Iterable):
        raise TypeError(f"prompt must be str, token ids or chat messages, not {type(prompt).__name__}")
    items = list(prompt)
    # protobuf takes a bool as 1 or 0 with only a warning (until 7.34), which a program's
    # warning filters may silence: a bool is looked for first, by type and in C (about 17 ns an
    # id: a Python check of each id made a 2,100-token prompt's request twice as slow)
    if bool in set(map(type, items)) or getattr(prompt, "dtype", None) == bool:
        raise TypeError("a prompt sequence must hold only token ids (int) or only chat messages "
                        "(dict): a bool is no token id")
    try:
        # token ids, the usual case, handed straight to protobuf: it takes ints (NumPy's too) and
        # refuses anything else with TypeError, all in C and all or nothing; a Python check of
        # each id first made a 2,100-token prompt's request twice as slow (0.13 ms against
        # 0.066 on a 2-core VM).
        request.token_ids.ids.extend(items)
    except TypeError:
        pass  # chat messages, or a mixed or odd sequence: told apart below
    except ValueError as e:
        # an id outside uint32, or protobuf's deprecation warning for a bool made an error by
        # -W error: named here, and a sequence that is not all ints gets the type error below
        if all(_is_token_id(t) for t in items):
            bad = next((t for t in items if not 0 <= t < 2**32), None)
            if bad is None:
                raise
            raise ValueError(f"token ids are uint32 (0 .. 2**32 - 1), got {bad}") from e
    else:
        # selects the oneof even for [], so the server reports the empty prompt
        request.token_ids.SetInParent()
        return request
    if items and all(isinstance(m, Mapping) for m in items):
        request.messages.SetInParent()
        for i, m in enumerate(items):
            if "role" not in m or "content" not in m:
                raise ValueError(f"chat message {i} needs 'role' and 'content', got {sorted(m)}")
            fields = {"role": m["role"], "content": m["content"]}
            if m.get("name") is not None:  # optional: OpenAI's participant name, for the template
                fields["name"] = m["name"]
            for key, value in fields.items():  # (protobuf took None for "", named nothing else)
                if not isinstance(value, str):
                    raise TypeError(f"chat message {i}'s {key} must be a str, not "
                                    f"{type(value).__name__}")
            with _naming(f"chat message {i}"):
                request.messages.messages.add(**fields)
    elif all(_is_token_id(t) for t in items):  # integers without __index__
        request.token_ids.SetInParent()
        request.token_ids.ids.extend(int(t) for t in items)
    else:
        raise TypeError("a prompt sequence must hold only token ids (int) or only chat messages (dict)")
    return request


class _Folder:
    """Folds one call's GenerateResponse messages into Deltas and, at `final`, a Completion."""

    def __init__(self) -> None:
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self.result: Completion | None = None

    def fold(self, response: blink_pb2.GenerateResponse) -> Delta | None:
        """The Delta a chunk carries; None for the final (which sets `result`)."""
        kind = response.WhichOneof("kind")
        if kind == "chunk":
            delta = Delta(response.chunk.text, tuple(response.chunk.token_ids))
            self._text.append(delta.text)
            self._token_ids.extend(delta.token_ids)
            return delta
        if kind == "final":
            f = response.final
            reason = blink_pb2.FinishReason.Name(f.finish_reason)
            self.result = Completion(
                text="".join(self._text),
                token_ids=tuple(self._token_ids),
                finish_reason=reason.removeprefix("FINISH_REASON_").lower(),
                matched_stop=f.matched_stop,
                prompt_tokens=f.usage.prompt_tokens,
                completion_tokens=f.usage.completion_tokens,
                time_to_first_token_s=f.timings.time_to_first_token_s,
                total_s=f.timings.total_s,
                preemptions=f.timings.preemptions,
                cached_prompt_tokens=f.timings.cached_prompt_tokens,
                request_id=f.request_id,
            )
        # Anything else is a kind added by a newer server: skipped.
        return None

    def end(self) -> None:
        """Called when the stream ends with OK status: the contract promises a final by then."""
        if self.result is None:
            raise BlinkError(grpc.StatusCode.UNKNOWN, "stream ended without a final message")


def _not_ready(timeout: float, last: str) -> BlinkError:
    return BlinkError(
        grpc.StatusCode.DEADLINE_EXCEEDED, f"{HEALTH_SERVICE} not SERVING after {timeout:g}s (last: {last})"
    )


def _health_request() -> health_pb2.HealthCheckRequest:
    return health_pb2.HealthCheckRequest(service=HEALTH_SERVICE)


def _status_name(response: health_pb2.HealthCheckResponse) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


class _Channel:
    """The gRPC channel (grpc or grpc.aio) a client and its with_token / with_session copies
    share, and whether one of them closed it: a call then is one clear error in both clients
    (gRPC's were a ValueError in grpc and a UsageError, no RpcError, in grpc.aio), and a stream
    it cut says so (grpc.aio's raised CancelledError in a task nobody cancelled)."""

    def __init__(self, channel: Any):
        self.grpc = channel
        self.closed = False

    def close(self) -> Any:  # (grpc.aio's close is a coroutine: the async client awaits this)
        self.closed = True
        return self.grpc.close()

    def check_open(self) -> None:
        if self.closed:
            raise ValueError("this Blink client is closed (by close() or its with block; its "
                             "with_token / with_session copies share its channel)")

    def stream_error(self, error: grpc.RpcError) -> BlinkError:
        if self.closed:
            return BlinkError(grpc.StatusCode.CANCELLED,
                              "the client was closed while this stream was open")
        return _blink_error(error)


class _Stream:
    """What both streams share: the call, the folding of its messages, and cancel()."""

    def __init__(self, call: Any, channel: _Channel):
        self._call = call  # grpc's response iterator (also a grpc.Call) or grpc.aio's call
        self._channel = channel
        self._folder = _Folder()
        self._cancelled = False

    @property
    def result(self) -> Completion | None:
        return self._folder.result

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()  # a no-op once the call has finished

    close = cancel


class GenerationStream(_Stream):
    """Iterator of Deltas for one Generate call; `result` is the Completion once the final arrived.

    `cancel()` (or `close()`, leaving a `with` block, or dropping the stream) cancels the call in
    the server; iteration then just stops.
    """

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> Delta:
        while True:
            try:
                response = next(self._call)
            except StopIteration:
                break
            except grpc.RpcError as e:
                if self._cancelled:
                    raise StopIteration from None
                raise self._channel.stream_error(e) from e
            delta = self._folder.fold(response)
            if delta is not None:
                return delta
        self._folder.end()
        raise StopIteration

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        if hasattr(self, "_call"):  # __init__ may not have run to the end
            self._call.cancel()


class AsyncGenerationStream(_Stream):
    """Async iterator of Deltas for one Generate call; see GenerationStream.

    Cancelling the task that awaits the next delta cancels the call as well.
    """

    def __aiter__(self) -> AsyncGenerationStream:
        return self

    async def __anext__(self) -> Delta:
        while True:
            try:
                response = await self._call.read()
            except asyncio.CancelledError as e:
                if self._cancelled:  # our own cancel() surfaces as CancelledError in grpc.aio
                    raise StopAsyncIteration from None
                if self._channel.closed and not _task_cancelling():  # so does the channel's
                    raise self._channel.stream_error(e) from None
                self._call.cancel()  # the awaiting task was cancelled: end the call too
                raise
            except grpc.RpcError as e:
                if self._cancelled:
                    raise StopAsyncIteration from None
                raise self._channel.stream_error(e) from e
            if response is grpc.aio.EOF:
                break
            delta = self._folder.fold(response)
            if delta is not None:
                return delta
        self._folder.end()
        raise StopAsyncIteration

    async def aclose(self) -> None:  # for contextlib.aclosing
        self.cancel()

    async def __aenter__(self) -> AsyncGenerationStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        # A stream dropped before its end must not keep the server generating. grpc.aio's own
        # finalizer does not reliably cancel; ours only acts while the call's loop still runs.
        if not self._call.done():
            try:
                self._call.cancel()
            except RuntimeError:  # the event loop is already closed
                pass


def _task_cancelling() -> bool:
    """Whether someone asked to cancel the running task. False on Python 3.10 (no
    Task.cancelling): there a CancelledError after the channel closed is taken for the close's."""
    task = asyncio.current_task()
    return task is not None and getattr(task, "cancelling", lambda: 0)() > 0


@dataclass(frozen=True)
class Tls:
    """TLS for a client's channel: the CA that signed the server's certificate (PEM; None: the
    system's roots) and, for mutual TLS, the client's certificate chain and key (PEM)."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None

    def __post_init__(self):
        if (self.cert is None) != (self.key is None):  # gRPC's core aborts the process on it
            raise ValueError("Tls: cert and key go together (mutual TLS), or neither")


def _open_channel(grpc_module: Any, target: str, options: Sequence[tuple[str, Any]],
                  tls: Tls | None) -> Any:
    """grpc or grpc.aio: a secure channel with `tls`, else a plain one."""
    # the caller's options over the SDK's own (gRPC keeps the first of a repeated key)
    options = list({**dict(_CHANNEL_OPTIONS), **dict(options)}.items())
    if tls is None:
        return grpc_module.insecure_channel(target, options=options)
    creds = grpc.ssl_channel_credentials(tls.ca, tls.key, tls.cert)
    return grpc_module.secure_channel(target, creds, options=options)


# The header deploy/envoy/envoy.yaml routes by: the calls of one session (a conversation's turns)
# go to one replica, whose prefix cache holds what the turns before computed. The server itself
# ignores it.
SESSION_HEADER = "x-blink-session"


def _call_metadata(token: str | None, session: str | None) -> tuple[tuple[str, str], ...] | None:
    """A call's metadata; ValueError for a token or session gRPC cannot carry (a token read
    from a file with its newline failed every call with INTERNAL "Invalid metadata")."""
    _metadata_value("a bearer token", token)
    _metadata_value("a session id", session)
    metadata = ((("authorization", f"Bearer {token}"),) if token else ()) + (
        ((SESSION_HEADER, session),) if session else ())
    return metadata or None


class _Client:
    """What the blocking and the asyncio client share: one channel (grpc or grpc.aio), its
    bearer token, the stubs and the Generate call a request makes."""

    _grpc: Any  # the grpc module whose channels the subclass uses

    def __init__(self, target: str, *, options: Sequence[tuple[str, Any]] = (),
                 tls: Tls | None = None, token: str | None = None):
        self._metadata = _call_metadata(token, None)  # (before the channel: it may refuse)
        self._channel = _Channel(_open_channel(self._grpc, target, options, tls))
        self._token, self._session = token, None
        self._stub = blink_pb2_grpc.BlinkStub(self._channel.grpc)
        self._health = health_pb2_grpc.HealthStub(self._channel.grpc)

    def with_token(self, token: str | None):
        """This client's channel with another bearer token on its calls (one channel for many
        callers' tokens, as a gateway needs; closing either client closes the channel).
        ValueError for a token that is not printable ASCII (what gRPC metadata carries)."""
        return self._carrying(_metadata_value("a bearer token", token), self._session)

    def with_session(self, session: str | None):
        """This client's channel with `session` in the SESSION_HEADER of its calls: behind
        deploy/envoy/envoy.yaml, every call of one session (give each conversation its own
        id) goes to the same replica while the replicas stay the same, so a turn finds the
        turns before it in that replica's prefix cache. ValueError for an id that is not
        printable ASCII (what gRPC metadata carries: a UUID is)."""
        return self._carrying(self._token, _metadata_value("a session id", session))

    def _carrying(self, token: str | None, session: str | None):
        """A copy on this client's channel whose calls carry `token` and `session`."""
        other = copy.copy(self)
        other._token, other._session = token, session
        other._metadata = _call_metadata(token, session)
        return other

    def _generate_call(self, prompt: Prompt, sampling: Sampling | None, timeout: float | None,
                       return_token_ids: bool, model: str, client_request_id: str,
                       cache_salt: str, skip_special_tokens_in_prompt: bool) -> Any:
        request = build_request(prompt, sampling, return_token_ids=return_token_ids, model=model,
                                client_request_id=client_request_id, cache_salt=cache_salt,
                                skip_special_tokens_in_prompt=skip_special_tokens_in_prompt)
        return self._stub.Generate(request, timeout=self._call_timeout(timeout),
                                   metadata=self._metadata)

    def _call_timeout(self, timeout: float | None) -> float | None:
        """A call's timeout as gRPC takes it, once the call may be made (see _check_usable)."""
        timeout = _deadline(timeout)
        self._check_usable()
        return timeout

    def _check_usable(self) -> None:
        """ValueError for a closed client (before a call is made)."""
        self._channel.check_open()


class BlinkClient(_Client):
    """Blocking client over one channel. Use as a context manager or call close().
    tls: a secure channel (Tls); token: sent as 'authorization: Bearer <token>'."""

    _grpc = grpc

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> BlinkClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stream(
        self,
        prompt: Prompt,
        sampling: Sampling | None = None,
        *,
        timeout: float | None = None,
        return_token_ids: bool = False,
        model: str = "",
        client_request_id: str = "",
        cache_salt: str = "",
        skip_special_tokens_in_prompt: bool = False,
    ) -> GenerationStream:
        return GenerationStream(self._generate_call(prompt, sampling, timeout, return_token_ids,
                                                    model, client_request_id, cache_salt,
                                                    skip_special_tokens_in_prompt),
                                self._channel)

    def generate(
        self,
        prompt: Prompt,
        sampling: Sampling | None = None,
        *,
        timeout: float | None = None,
        return_token_ids: bool = False,
        model: str = "",
        client_request_id: str = "",
        cache_salt: str = "",
        skip_special_tokens_in_prompt: bool = False,
    ) -> Completion:
        with self.stream(
            prompt, sampling, timeout=timeout, return_token_ids=return_token_ids, model=model,
            client_request_id=client_request_id, cache_salt=cache_salt,
            skip_special_tokens_in_prompt=skip_special_tokens_in_prompt,
        ) as stream:
            for _ in stream:
                pass
            return stream.result

    def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        timeout = self._call_timeout(timeout)
        try:
            return method(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise _blink_error(e) from e

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        msg = self._unary(self._stub.GetModelInfo, blink_pb2.GetModelInfoRequest(), timeout)
        return ModelInfo.from_proto(msg)

    def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        return _stats_dict(self._unary(self._stub.GetServerStats, blink_pb2.GetServerStatsRequest(), timeout))

    def health(self, *, timeout: float | None = None) -> str:
        """"SERVING", "NOT_SERVING", ... as grpc.health.v1 reports it for blink.v1.Blink."""
        return _status_name(self._unary(self._health.Check, _health_request(), timeout))

    def wait_ready(self, timeout: float) -> None:
        """Polls health until SERVING; BlinkError(DEADLINE_EXCEEDED) after `timeout` seconds
        (0: one poll; inf: no end)."""
        deadline = time.monotonic() + _seconds("wait_ready's timeout", timeout, zero_ok=True)
        while True:
            try:
                last = self.health(timeout=max(deadline - time.monotonic(), 0.001))
            except BlinkError as e:  # e.g. UNAVAILABLE while the server is still starting
                last = str(e)
            if last == "SERVING":
                return
            if time.monotonic() + _READY_POLL_S > deadline:
                raise _not_ready(timeout, last)
            time.sleep(_READY_POLL_S)


class AsyncBlinkClient(_Client):
    """BlinkClient on grpc.aio: the same methods, awaited. Use `async with` or `await close()`."""

    _grpc = grpc.aio

    def __init__(self, target: str, *, options: Sequence[tuple[str, Any]] = (),
                 tls: Tls | None = None, token: str | None = None):
        """Made in a coroutine: grpc.aio binds the channel to the loop running it, and a call
        from another loop failed with "got Future attached to a different loop", its request
        task left pending."""
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("AsyncBlinkClient must be created in a coroutine, on the event "
                               "loop that will use it") from None
        super().__init__(target, options=options, tls=tls, token=token)

    def _check_usable(self) -> None:
        """RuntimeError for a call outside the client's event loop, as well."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not self._loop:
            raise RuntimeError("this AsyncBlinkClient belongs to the event loop it was created "
                               "on: make one in each loop that calls it")
        super()._check_usable()

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncBlinkClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def stream(
        self,
        prompt: Prompt,
        sampling: Sampling | None = None,
        *,
        timeout: float | None = None,
        return_token_ids: bool = False,
        model: str = "",
        client_request_id: str = "",
        cache_salt: str = "",
        skip_special_tokens_in_prompt: bool = False,
    ) -> AsyncGenerationStream:
        return AsyncGenerationStream(self._generate_call(prompt, sampling, timeout,
                                                         return_token_ids, model,
                                                         client_request_id, cache_salt,
                                                         skip_special_tokens_in_prompt),
                                     self._channel)

    async def generate(
        self,
        prompt: Prompt,
        sampling: Sampling | None = None,
        *,
        timeout: float | None = None,
        return_token_ids: bool = False,
        model: str = "",
        client_request_id: str = "",
        cache_salt: str = "",
        skip_special_tokens_in_prompt: bool = False,
    ) -> Completion:
        async with self.stream(
            prompt, sampling, timeout=timeout, return_token_ids=return_token_ids, model=model,
            client_request_id=client_request_id, cache_salt=cache_salt,
            skip_special_tokens_in_prompt=skip_special_tokens_in_prompt,
        ) as stream:
            async for _ in stream:
                pass
            return stream.result

    async def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        timeout = self._call_timeout(timeout)
        try:
            return await method(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise _blink_error(e) from e

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        msg = await self._unary(self._stub.GetModelInfo, blink_pb2.GetModelInfoRequest(), timeout)
        return ModelInfo.from_proto(msg)

    async def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        msg = await self._unary(self._stub.GetServerStats, blink_pb2.GetServerStatsRequest(), timeout)
        return _stats_dict(msg)

    async def health(self, *, timeout: float | None = None) -> str:
        return _status_name(await self._unary(self._health.Check, _health_request(), timeout))

    async def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + _seconds("wait_ready's timeout", timeout, zero_ok=True)
        while True:
            try:
                last = await self.health(timeout=max(deadline - time.monotonic(), 0.001))
            except BlinkError as e:
                last = str(e)
            if last == "SERVING":
                return
            if time.monotonic() + _READY_POLL_S > deadline:
                raise _not_ready(timeout, last)
            await asyncio.sleep(_READY_POLL_S)


def _metadata_value(what: str, value: str | None) -> str | None:
    """value, if gRPC metadata can carry it (printable ASCII); ValueError otherwise, which
    shows a session id but not a token (a secret: it would land in logs)."""
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")
    if value and not (value.isascii() and value.isprintable()):
        bad = next(i for i, c in enumerate(value) if not (c.isascii() and c.isprintable()))
        shown = f"{value!r}" if "token" not in what else f"character {bad + 1} of {len(value)}"
        raise ValueError(f"{what} must be printable ASCII, got {shown}")
    return value
