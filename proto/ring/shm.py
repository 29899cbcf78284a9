"""Ring transports: how bytes reach the other side's memory.

The front end only ever does one-sided operations on the engine's ring: `write` a byte range,
`read` a byte range. `RingTransport` is that interface; `ShmTransport` implements it on one host
over a POSIX shared-memory segment that the engine creates with owner-only permissions, and
`blink.ring.rdma.RdmaTransport` with RDMA WRITE/READ from another machine (a DPU's Arm cores).
What is written where, and in what order, is the front end's EngineLink, the same for both.

Ordering: on x86 (TSO) stores from one thread become visible in program order, so writing the
payload and then the doorbell word is enough for the shared-memory case. A transport without
that guarantee (RDMA) must not let the doorbell overtake the payload (rdma.py says how it
orders them); and the engine consumes a slot only once its sequence words and CRC match, so
bytes that land in another order are never taken for a request.
"""
from __future__ import annotations

import mmap
import os
import secrets
import threading
from pathlib import Path
from typing import Protocol

import numpy as np

SHM_DIR = Path("/dev/shm")


class RingTransport(Protocol):
    size: int  # bytes of the ring reachable through the transport
    def read(self, offset: int, length: int) -> bytes: ...
    def write(self, offset: int, data: bytes) -> None: ...
    # `count` ranges of `length` bytes, `stride` apart, concatenated (RDMA: one batch of READs)
    def read_strided(self, offset: int, stride: int, count: int, length: int) -> bytes: ...
    # False once the memory behind the transport is known to be gone (e.g. replaced segment)
    def is_current(self) -> bool: ...
    # whether `read` still works once is_current() is False (a mapping of the old memory)
    mapped: bool
    def close(self) -> None: ...


def gather_strided(mem, offset: int, stride: int, count: int, length: int) -> bytes:
    """`count` ranges of `length` bytes, `stride` apart from `offset` in `mem` (a buffer of the
    ring: a memoryview, a [size] u8 array), concatenated; each range one opaque item."""
    if count and offset + (count - 1) * stride + length > mem.nbytes:
        raise ValueError("strided read past the end of the ring")
    return np.ndarray((count,), f"V{length}", mem, offset, (stride,)).tobytes()


def shm_path(name: str) -> Path:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"invalid shared-memory name {name!r}")
    return SHM_DIR / name


def default_ring_name() -> str:
    return f"blink-ring-{os.getuid()}"


# The ring files this process has created and not yet unlinked: what unlink_created_segments
# removes when start-up stops before the engine serves. _CREATION_LOCK is held across a
# creation (from before its file exists to its entry here) and a publication, and by
# unlink_created_segments.
_CREATED: set["ShmSegment"] = set()
_CREATION_LOCK = threading.Lock()


def unlink_created_segments(*, for_good: bool = False) -> None:
    """Removes every file this process created and still owns, under its temporary name or its
    public one (only while it is still this process's inode). From another thread, while the
    main thread may be creating one: it waits for that creation to end, and with for_good it
    keeps the lock, so that no creation starts after it (the caller is about to end the
    process)."""
    _CREATION_LOCK.acquire()
    try:
        for seg in list(_CREATED):
            seg.unlink()
    finally:
        if not for_good:
            _CREATION_LOCK.release()


class ShmSegment:
    """A mapped /dev/shm file. The engine `create`s it (replacing a stale one from a previous
    engine: a new inode, so front ends still mapping the old one see its heartbeat stop);
    front ends `attach`."""

    def __init__(self, path: Path, fd: int, size: int):
        self.path = path
        self.size = size
        self._fd = fd
        self.mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.inode = os.fstat(fd).st_ino
        self._tmp_path: Path | None = None  # a created segment's name until it is published

    @classmethod
    def create(cls, name: str, size: int) -> "ShmSegment":
        path = shm_path(name)
        # Build under a private temporary name, then rename over the public one, so an
        # attaching front end never maps a half-initialised or half-sized file.
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        with _CREATION_LOCK:
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, size)
                seg = cls(path, fd, size)
            except BaseException:
                os.close(fd)
                tmp.unlink(missing_ok=True)
                raise
            seg._tmp_path = tmp
            _CREATED.add(seg)
        return seg

    def publish(self) -> None:
        """Makes a created segment visible under its public name (after its header is set)."""
        with _CREATION_LOCK:
            os.replace(self._tmp_path, self.path)
            self._tmp_path = None

    @classmethod
    def attach(cls, name: str) -> "ShmSegment":
        path = shm_path(name)
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise FileNotFoundError(f"{path} is empty")
            return cls(path, fd, size)
        except BaseException:
            os.close(fd)
            raise

    def is_current(self) -> bool:
        """False once another engine has replaced the public file (or it was removed)."""
        try:
            return os.stat(self.path).st_ino == self.inode
        except FileNotFoundError:
            return False

    def array(self) -> np.ndarray:
        return np.frombuffer(self.mmap, dtype=np.uint8)

    def unlink(self) -> None:
        """Removes the file, if it is still this segment's (a created one not yet published:
        its temporary name)."""
        if self._tmp_path is not None:
            self._tmp_path.unlink(missing_ok=True)
        if self.is_current():
            self.path.unlink(missing_ok=True)
        _CREATED.discard(self)

    def close(self) -> None:
        try:
            self.mmap.close()
        except BufferError:
            pass  # numpy views still alive; the mapping goes with the process
        os.close(self._fd)


class ShmTransport:
    """RingTransport over an attached shared-memory segment (single-host mode)."""

    mapped = True  # a removed or replaced segment stays mapped here until close

    def __init__(self, segment: ShmSegment):
        self.segment = segment
        self.size = segment.size
        self._mem = memoryview(segment.mmap)

    def read(self, offset: int, length: int) -> bytes:
        return bytes(self._mem[offset:offset + length])

    def write(self, offset: int, data: bytes) -> None:
        self._mem[offset:offset + len(data)] = data

    def is_current(self) -> bool:
        return self.segment.is_current()

    def read_strided(self, offset: int, stride: int, count: int, length: int) -> bytes:
        return gather_strided(self._mem, offset, stride, count, length)

    def strided_u32(self, offset: int, stride: int, count: int) -> np.ndarray:
        """A live [count] u32 view of the words `stride` apart from `offset`: its reads see the
        engine's writes as they land (shared memory only; drop it before `close`). It holds an
        export of the mapping, so a view left behind keeps the mapping (close leaves it to the
        process) rather than reading unmapped memory."""
        if count and offset + (count - 1) * stride + 4 > self.size:
            raise ValueError("strided view past the end of the ring")
        return np.ndarray((count,), "<u4", np.frombuffer(self.segment.mmap, np.uint8), offset,
                          (stride,))

    def close(self) -> None:
        self._mem.release()
        self.segment.close()
