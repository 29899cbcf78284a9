"""The ring: the one binary layout shared by the front end and the engine.

This file is the single source of truth. The CUDA engine's view (`gpu_engine/csrc/ring_layout.h`)
is generated from it by `python -m blink.ring.layout --write-header` and a test checks the two
agree field for field (offsets compiled with a C compiler).

One segment, little-endian, every field naturally aligned:

    [0, HEADER_BYTES)                      RingHeader   (engine writes; front end reads)
    [slots_offset,   + num_slots*slot_bytes)   RequestSlot[num_slots]   (front end writes)
    [records_offset, + num_slots*record_bytes) OutputRecord[num_slots]  (engine writes)

Request slot protocol (designed for one-sided writes, RDMA or plain stores):
  * Slot i is owned by the front end between uses. To submit, it bumps the slot's generation g
    (1, 2, ..., 0xFFFFFFFF, then 1 again: never 0), writes the payload with `seq_end = g` at its
    end and the CRC32 of the payload, and only then writes the doorbell word `seq_begin = g` (a
    second write, ordered after the first). The engine consumes a slot only when seq_begin ==
    seq_end == g, g is not 0 and not the last generation it consumed there, and the CRC
    matches; a torn or reordered write is never consumed.
  * `cancel_gen` is written by the front end at any time; the engine cancels generation g when
    it reads cancel_gen == g.
Output record protocol (engine writes, front end polls):
  * On admission the engine resets `num_tokens` and `finish_reason`, then publishes `gen = g`.
    It appends tokens and then publishes the new `num_tokens` (release order); at the end it
    writes `finish_reason` last. A front end trusts a record only while `gen` equals its own
    generation, reads `finish_reason` before `num_tokens`, and frees the slot once it has seen
    a finish reason for its generation.
"""
from __future__ import annotations

import enum
import hashlib
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

RING_MAGIC = 0x31474E524B4E494C  # b"LINKRNG1" read as a little-endian u64
LAYOUT_VERSION = 4  # 4: RequestSlot.cache_salt
HEADER_BYTES = 4096
MAX_STOP_IDS = 16
MAX_EOS_IDS = 8
MODEL_NAME_BYTES = 64
ALIGN = 64  # slots and records start on cache-line boundaries


class EngineState(enum.IntEnum):
    STARTING = 0
    SERVING = 1
    STOPPED = 2


class EngineKind(enum.IntEnum):
    CPU_REFERENCE = 0
    CUDA = 1
    HOST_DRIVEN_CUDA = 2  # the benchmark's ablation: CUDA kernels launched by a host loop
    HF_TRANSFORMERS = 3   # the benchmark's peer: Hugging Face transformers' generate
    SYNTHETIC = 4         # no model: tokens at a set step time, to measure the front end alone


class FinishReason(enum.IntEnum):
    NONE = 0          # still running
    EOS = 1           # an end-of-sequence token (not returned as text)
    LENGTH = 2        # max_tokens generated
    STOP_TOKEN = 3    # one of the request's stop ids (detail = the id)
    CANCELLED = 4     # cancel_gen matched
    REJECTED = 5      # the slot failed validation (detail = RejectReason)
    CONTEXT_FULL = 6  # prompt + generated reached the model's context length


class RejectReason(enum.IntEnum):
    NONE = 0
    BAD_PROMPT_LEN = 1
    TOKEN_OUT_OF_RANGE = 2
    BAD_MAX_TOKENS = 3
    BAD_TEMPERATURE = 4
    BAD_TOP_P = 5
    BAD_TOP_K = 6
    BAD_STOP_IDS = 7
    CORRUPT = 8            # seq words agree but the CRC does not (after a grace period)
    EXCEEDS_CONTEXT = 9    # prompt_len + max_tokens > context length
    EXCEEDS_KV_CAPACITY = 10  # could never fit in the whole KV cache

    def describe(self) -> str:
        return _REJECT_TEXT[self]


_REJECT_TEXT = {
    RejectReason.NONE: "not rejected",
    RejectReason.BAD_PROMPT_LEN: "prompt length is 0 or larger than the slot holds",
    RejectReason.TOKEN_OUT_OF_RANGE: "a prompt token id is outside the vocabulary",
    RejectReason.BAD_MAX_TOKENS: "max_tokens must be at least 1",
    RejectReason.BAD_TEMPERATURE: "temperature must be finite and >= 0",
    RejectReason.BAD_TOP_P: "top_p must be in (0, 1]",
    RejectReason.BAD_TOP_K: "top_k must be >= 0",
    RejectReason.BAD_STOP_IDS: "too many stop token ids, or one outside the vocabulary",
    RejectReason.CORRUPT: "request slot failed its checksum",
    RejectReason.EXCEEDS_CONTEXT: "prompt plus max_tokens exceeds the context length",
    RejectReason.EXCEEDS_KV_CAPACITY: "prompt plus max_tokens exceeds the whole KV cache",
}

FLAG_IGNORE_EOS = 1

# The header: the engine's identity, liveness, model description and counters.
HEADER_DTYPE = np.dtype([
    ("magic", "<u8"),
    ("layout_version", "<u4"),
    ("header_bytes", "<u4"),
    ("num_slots", "<u4"),
    ("max_prompt_tokens", "<u4"),
    ("max_output_tokens", "<u4"),
    ("slot_bytes", "<u4"),
    ("record_bytes", "<u4"),
    ("engine_state", "<u4"),       # EngineState
    ("slots_offset", "<u8"),
    ("records_offset", "<u8"),
    ("total_bytes", "<u8"),
    ("engine_instance", "<u8"),    # random per engine start; front ends reattach when it changes
    ("heartbeat", "<u8"),          # bumped by the engine's loop; stalls when the engine hangs
    ("engine_pid", "<u4"),
    ("vocab_size", "<u4"),
    ("context_length", "<u4"),
    ("num_eos_ids", "<u4"),
    ("eos_ids", "<i4", (MAX_EOS_IDS,)),
    ("model_name", f"S{MODEL_NAME_BYTES}"),
    ("kv_blocks_total", "<u4"),
    ("kv_blocks_free", "<u4"),
    ("kv_block_size", "<u4"),
    ("sequences_running", "<u4"),
    ("sequences_waiting", "<u4"),
    ("engine_kind", "<u4"),        # EngineKind
    ("requests_admitted", "<u8"),
    ("requests_finished", "<u8"),
    ("requests_cancelled", "<u8"),
    ("requests_rejected", "<u8"),
    ("preemptions", "<u8"),
    ("tokens_generated", "<u8"),
    ("engine_steps", "<u8"),
    ("busy_ns", "<u8"),            # time in steps that ran a forward pass (batch, forward, samples)
    ("step_tokens", "<u8"),        # tokens those steps computed (prefill chunks + decode tokens)
    # prefix caching: full KV blocks kept for reuse (referenced or not), and at each admission
    # the prompt tokens looked up / found in the cache, and cached blocks evicted for memory
    ("kv_blocks_cached", "<u4"),
    ("prefix_caching", "<u4"),     # 1 when the engine reuses cached prompt prefixes
    ("prefix_query_tokens", "<u8"),
    ("prefix_hit_tokens", "<u8"),
    ("prefix_evicted_blocks", "<u8"),
])

# Fixed part of a request slot; the prompt follows, then seq_end at the end of the slot.
SLOT_DTYPE = np.dtype([
    ("seq_begin", "<u4"),      # doorbell: the generation, written last
    ("cancel_gen", "<u4"),     # the front end writes g here to cancel generation g
    ("payload_crc", "<u4"),    # CRC-32 of the generation (u32) then bytes [PAYLOAD_START, prompt end)
    ("pad0", "<u4"),
    ("request_id", "<u8"),     # front end's id, for logs and FCFS order
    ("prompt_len", "<u4"),
    ("max_tokens", "<u4"),
    ("temperature", "<f4"),
    ("top_p", "<f4"),
    ("top_k", "<i4"),
    ("flags", "<u4"),          # FLAG_IGNORE_EOS
    ("seed", "<u8"),
    ("cache_salt", "<u8"),     # the prefix cache's namespace: 0 or cache_salt_word's
    ("num_stop_ids", "<u4"),
    ("stop_ids", "<i4", (MAX_STOP_IDS,)),
    ("pad1", "<u4"),
])
PAYLOAD_START = SLOT_DTYPE.fields["request_id"][1]

RECORD_DTYPE = np.dtype([
    ("gen", "<u4"),            # the generation this record belongs to
    ("num_tokens", "<u4"),     # published count of tokens[]
    ("finish_reason", "<u4"),  # FinishReason, written last
    ("detail", "<u4"),         # RejectReason, or the stop id that matched
    ("prompt_len", "<u4"),
    ("preemptions", "<u4"),
    ("cached_tokens", "<u4"),  # prompt tokens its last admission took from the prefix cache
    ("pad0", "<u4"),
])

assert HEADER_DTYPE.itemsize <= HEADER_BYTES


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class RingGeometry:
    """Sizes and offsets of one ring segment; both sides derive them from the header."""

    num_slots: int
    max_prompt_tokens: int
    max_output_tokens: int

    def __post_init__(self):
        if self.num_slots < 1 or self.max_prompt_tokens < 1 or self.max_output_tokens < 1:
            raise ValueError(f"ring geometry must be positive: {self}")

    @property
    def slot_bytes(self) -> int:
        return _round_up(SLOT_DTYPE.itemsize + 4 * self.max_prompt_tokens + 4, ALIGN)

    @property
    def seq_end_offset(self) -> int:
        return self.slot_bytes - 4

    @property
    def record_bytes(self) -> int:
        return _round_up(RECORD_DTYPE.itemsize + 4 * self.max_output_tokens, ALIGN)

    @property
    def slots_offset(self) -> int:
        return HEADER_BYTES

    @property
    def records_offset(self) -> int:
        return _round_up(self.slots_offset + self.num_slots * self.slot_bytes, 4096)

    @property
    def total_bytes(self) -> int:
        return _round_up(self.records_offset + self.num_slots * self.record_bytes, 4096)

    def slot_offset(self, i: int) -> int:
        return self.slots_offset + i * self.slot_bytes

    def record_offset(self, i: int) -> int:
        return self.records_offset + i * self.record_bytes

    @classmethod
    def from_header(cls, header: np.void) -> "RingGeometry":
        return cls(int(header["num_slots"]), int(header["max_prompt_tokens"]),
                   int(header["max_output_tokens"]))


@dataclass(frozen=True)
class SlotRequest:
    """What the front end puts into a slot (already tokenized and validated)."""

    request_id: int
    prompt: np.ndarray          # [prompt_len] int32
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    ignore_eos: bool = False
    stop_ids: tuple[int, ...] = ()
    cache_salt: int = 0         # cache_salt_word(the request's cache_salt)


def cache_salt_word(salt: str) -> int:
    """The slot's word for a request's cache salt: 0 for none (""), else 63 bits of its BLAKE2b
    digest with the top bit set. The engine hangs a salted sequence's first KV block from this
    word where an unsalted one's hangs from 0, and block uids count up from 1, so blocks cached
    under different words never share an identity: a request can reuse only the prefixes that
    requests with its own salt computed (a tenant's, where an operator gives each tenant one),
    and its time to first token cannot reveal whether another tenant sent a prefix. The digest,
    not the text, crosses the ring: the slot's size stays fixed whatever the salt's length."""
    if not salt:
        return 0
    digest = hashlib.blake2b(salt.encode(), digest_size=8,
                             person=b"blink cache salt").digest()
    return int.from_bytes(digest, "little") | 1 << 63


def encode_slot(geom: RingGeometry, gen: int, req: SlotRequest) -> tuple[bytes, int]:
    """Returns (payload bytes to write at the slot's offset + 4, end-of-payload offset).

    The payload covers everything after seq_begin up to the prompt's end, with seq_end written
    separately by `encode_seq_end`; seq_begin is the doorbell, written last by the caller.
    """
    prompt = np.ascontiguousarray(req.prompt, dtype="<i4")
    if not 1 <= prompt.size <= geom.max_prompt_tokens:
        raise ValueError(f"prompt of {prompt.size} tokens does not fit a slot of "
                         f"{geom.max_prompt_tokens}")
    if len(req.stop_ids) > MAX_STOP_IDS:
        raise ValueError(f"at most {MAX_STOP_IDS} stop token ids")
    fixed = np.zeros((), SLOT_DTYPE)
    fixed["request_id"] = req.request_id
    fixed["prompt_len"] = prompt.size
    fixed["max_tokens"] = req.max_tokens
    fixed["temperature"] = req.temperature
    fixed["top_p"] = req.top_p
    fixed["top_k"] = req.top_k
    fixed["flags"] = FLAG_IGNORE_EOS if req.ignore_eos else 0
    fixed["seed"] = req.seed & 0xFFFF_FFFF_FFFF_FFFF
    fixed["cache_salt"] = req.cache_salt & 0xFFFF_FFFF_FFFF_FFFF
    fixed["num_stop_ids"] = len(req.stop_ids)
    fixed["stop_ids"][: len(req.stop_ids)] = req.stop_ids
    payload = fixed.tobytes()[PAYLOAD_START:] + prompt.tobytes()
    fixed["payload_crc"] = zlib.crc32(payload, zlib.crc32(u32_bytes(gen)))
    # bytes [4, end): cancel_gen (left 0), crc, pad, then the payload proper
    head = fixed.tobytes()[4:PAYLOAD_START]
    return head + payload, SLOT_DTYPE.itemsize + prompt.nbytes


def payload_crc(slot: memoryview | bytes, prompt_len: int, gen: int) -> int:
    """The generation is part of the checksum: otherwise a new doorbell and seq_end landing
    on top of the previous request's intact payload would pass as the new request."""
    return zlib.crc32(slot[PAYLOAD_START:SLOT_DTYPE.itemsize + 4 * prompt_len],
                      zlib.crc32(u32_bytes(gen)))


def u32_bytes(value: int) -> bytes:
    """A ring word's bytes (a generation, a doorbell): NumPy's scalar took 40 us from cold
    caches, on the path of a request's submit."""
    return int(value).to_bytes(4, "little")


# ---------------------------------------------------------------------------------------------
# C view, generated for the CUDA engine. The helpers below also generate the engine's own shared
# structs (gpu_engine/engine_layout.py). Optional dtype metadata they honour: on a field, "c_type"
# (a u64 address that C declares as this pointer type) and "doc" (its comment); on a nested
# structured dtype, "c_name" (the C struct it is).

_C_TYPES = {"<u8": "uint64_t", "<u4": "uint32_t", "<i4": "int32_t", "<f4": "float"}


def c_name(name: str) -> str:
    """A Python CONSTANT_NAME as the C kConstantName."""
    return "k" + "".join(p.title() for p in name.split("_"))


def _c_field(field: str, ftype: np.dtype) -> str:
    meta = ftype.metadata or {}
    if ftype.subdtype is not None:
        base, shape = ftype.subdtype
        return f"{_C_TYPES[base.str]} {field}[{shape[0]}]"
    if ftype.kind == "S":
        return f"char {field}[{ftype.itemsize}]"
    if ftype.names is not None:
        return f"{meta['c_name']} {field}"
    if "c_type" in meta:
        if ftype.str != "<u8":
            raise TypeError(f"{field}: a pointer is a u64 address on the Python side")
        return f"{meta['c_type']} {field}"
    return f"{_C_TYPES[ftype.str]} {field}"


def c_struct(name: str, dtype: np.dtype) -> list[str]:
    """The C struct of a structured dtype, with static_asserts of its size and every offset."""
    lines = [f"struct {name} {{"]
    for field, (ftype, offset) in dtype.fields.items():
        doc = (ftype.metadata or {}).get("doc")
        lines.append(f"  {_c_field(field, ftype)};  // @{offset}" + (f" {doc}" if doc else ""))
    lines.append("};")
    lines.append(f"static_assert(sizeof({name}) == {dtype.itemsize}, \"{name} size\");")
    for field, (_, offset) in dtype.fields.items():
        lines.append(f"static_assert(offsetof({name}, {field}) == {offset}, \"{name}.{field}\");")
    return lines


def c_header_text(module: str, source: str, test: str, namespace: str, body: list[str]) -> str:
    """A generated header: the do-not-edit banner, the C headers it needs, `body` in `namespace`.
    module: the `python -m` module that writes it; source: its file, relative to the repo."""
    out = [
        f"// Generated by `python -m {module} --write-header` from {source}.",
        f"// Do not edit: change {source.rsplit('/', 1)[-1]} and regenerate ({test} checks it).",
        "#pragma once",
        "#include <stddef.h>",
        "#include <stdint.h>",
        "",
        f"namespace {namespace} {{",
        "",
        *body,
        f"}}  // namespace {namespace}",
        "",
    ]
    return "\n".join(out)


def header_main(argv: list[str], text: str, target: Path) -> None:
    """`--write-header` writes `text` to `target`; no argument prints it."""
    if argv == ["--write-header"]:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        print(f"wrote {target}")
    else:
        print(text)


def c_header() -> str:
    out = [
        f"static constexpr uint64_t kRingMagic = {RING_MAGIC:#x}ull;",
        f"static constexpr uint32_t kLayoutVersion = {LAYOUT_VERSION};",
        f"static constexpr uint32_t kHeaderBytes = {HEADER_BYTES};",
        f"static constexpr uint32_t kMaxStopIds = {MAX_STOP_IDS};",
        f"static constexpr uint32_t kMaxEosIds = {MAX_EOS_IDS};",
        f"static constexpr uint32_t kPayloadStart = {PAYLOAD_START};",
        f"static constexpr uint32_t kFlagIgnoreEos = {FLAG_IGNORE_EOS};",
        "",
    ]
    for enum_cls in (EngineState, EngineKind, FinishReason, RejectReason):
        out.append(f"enum class {enum_cls.__name__} : uint32_t {{")
        out += [f"  {c_name(m.name)} = {m.value}," for m in enum_cls]
        out += ["};", ""]
    out += c_struct("RingHeader", HEADER_DTYPE) + [""]
    out += c_struct("RequestSlotFixed", SLOT_DTYPE) + [""]
    out += c_struct("OutputRecordFixed", RECORD_DTYPE) + [""]
    return c_header_text("blink.ring.layout", "proto/ring/layout.py", "tests/test_ring_protocol.py",
                         "blink::ring", out)


if __name__ == "__main__":
    header_main(sys.argv[1:], c_header(),
                Path(__file__).resolve().parents[2] / "gpu_engine" / "csrc" / "ring_layout.h")
