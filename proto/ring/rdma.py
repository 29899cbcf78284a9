"""The ring over RDMA (pyverbs): the engine exports its ring's memory, a front end on another
machine (a DPU's Arm cores) reaches it with one-sided RDMA WRITE and READ.

    NOT RUN ON A DEVICE. Written against pyverbs' sources and tests (rdma-core 44 to 64) but
    never run with the real pyverbs: no machine of this project has an RDMA device or
    soft-RoCE. CI runs it against tests/pyverbs_standin.py, a stand-in that encodes this
    module's reading of pyverbs' API (so it checks the logic, not that reading);
    tests/test_rdma_transport.py runs it against the real pyverbs where a device exists, and
    deploy/README.md says how to do that on a host with soft-RoCE.

What is written where, and in what order, is not decided here: EngineLink's submit, cancel and
poll (the same code for both transports) do that through RingTransport (shm.py). This transport
gives each operation what the ring protocol (layout.py) needs from it: `write` returns once the
RDMA WRITE's completion arrived, which says the engine's NIC took the bytes, not that they are
visible in its memory yet. RDMA WRITEs on one queue pair execute in order and a NIC's writes
to host memory are not relaxed-ordered, so a host ring sees the payload before the doorbell;
nothing says in what order a GPU polling GPU memory sees them, which the protocol does not need:
a slot is consumed only when its two sequence words and its CRC match (layout.py). `read`
returns once the RDMA READ's data is in a local registered mirror of the ring (same offsets),
`read_strided` posts its READs in batches of at most MAX_OUTSTANDING.

Engine side, RingExport (a thread of the engine process): binds IP:PORT with RDMA CM at once (a
wrong address fails before the engine loads anything), waits until this process serves its ring
and registers it with the NIC: the whole ring readable, the request slots also writable, so a
front end cannot write records or the header. Where the ring lives is the engine's choice
(`--ring-memory`): host, the default, is the pinned host memory the GPU maps, published in
/dev/shm (the export maps the same segment and registers its pages); gpu is a ring in GPU
memory that the CUDA engine hands over as a dma-buf file descriptor (serve_device_ring), which
is registered with pyverbs' DmaBufMR, so a front end's WRITEs and READs go straight to the
GPU's memory (GPUDirect RDMA; NOT RUN ON A DEVICE either). Then it listens; each front end's
connect request
(its Hello: layout version, a token) is answered with an RC queue pair and an Offer in the
accept's private data: the ring's address, rkeys, geometry and layout version.

Front-end side, RdmaDialer and RdmaTransport: the dialer connects (resolve address, route, RC
queue pair, connect, the Offer, queue pair to RTS, establish) in steps that each wait at most a
few milliseconds, so the front end's event loop never stalls on a slow or absent engine. A
failed work request or any CM event after the connection (DISCONNECTED, DEVICE_REMOVAL) ends
the transport with the reason (is_current turns False, reads raise RdmaPeerGone); EngineLink
then detaches and dials again, so either side may restart.

pyverbs limits this module works around:
  - it blocks in rdma_get_cm_event holding the GIL and does not expose the event channel's file
    descriptor; rdma_create_event_channel(3) allows polling it, so it is found in /proc/self/fd
    (the /dev/infiniband/rdma_cm file the channel opened) and polled;
  - a CMEvent does not say which connection it is about, so the engine cannot tell whose
    DISCONNECTED it got: a front end names its earlier connection by the token in its Hello when
    it reconnects and the engine closes that one; and the group in its Hello names the front end
    (its workers share it): one engine serves one front end, so a connection of another group
    closes the earlier group's (a restarted front end's idle queue pairs; or a second front end
    still running, which the engine cannot tell apart, and which then takes the engine back:
    both say so, rather than two front ends writing into the same slots);
  - a connection's CMID shares the listener's context and protection domain objects and clears
    them when closed: everything registered on them is made before the first connection.
"""
from __future__ import annotations

import errno
import importlib
import logging
import mmap
import os
import secrets
import select
import threading
import time
from typing import Callable

import numpy as np

from blink.ring.layout import HEADER_DTYPE, LAYOUT_VERSION, RING_MAGIC, EngineState, RingGeometry
from blink.ring.shm import ShmSegment, gather_strided

log = logging.getLogger("blink.rdma")

PYVERBS_HINT = (".venv/bin/pip install -e '.[rdma]' (pyverbs builds only against rdma-core >= 57, "
                "with its headers and cython<3.1), or the distribution's python3-pyverbs in a "
                "virtual environment made with --system-site-packages")
DEVICE_HINT = ("ibv_devices lists none; on an Ethernet interface, soft-RoCE gives one: "
               "modprobe rdma_rxe && rdma link add rxe0 type rxe netdev eth0")

MAX_OUTSTANDING = 64   # work requests in flight on a front end's queue pair (and its CQ) at most
ACK_TIMEOUT = 14       # 4.096 us * 2^14 = 67 ms before an unacknowledged packet is resent ...
RETRY_COUNT = 3        # ... this many times, then the work request fails: a vanished peer shows
OP_TIMEOUT_S = 2.0     # a completion later than this: the peer is taken as gone
ROUTE_TIMEOUT_MS = 1000
RDMA_MAX_DEPTH = 0xFF  # rdma_cma.h's RDMA_MAX_INIT_DEPTH / RDMA_MAX_RESP_RES: the negotiated maximum
REFUSAL = b"blink: "   # the engine's reject messages start with this (private data, <= 148 bytes)

# Front end -> engine, the connect request's private data (RDMA_PS_TCP: at most 56 bytes).
HELLO_DTYPE = np.dtype([
    ("magic", "<u8"),           # RING_MAGIC
    ("layout_version", "<u4"),  # LAYOUT_VERSION of the front end
    ("pad", "<u4"),
    ("token", "<u8"),           # the same for every connection of one front-end process
    ("group", "<u8"),           # the same for a front end and its workers; 0: not said
])
# Engine -> front end, the accept's private data (RDMA_PS_TCP: at most 196 bytes).
OFFER_DTYPE = np.dtype([
    ("magic", "<u8"),
    ("layout_version", "<u4"),
    ("read_rkey", "<u4"),       # the whole ring: header, slots, records
    ("write_rkey", "<u4"),      # the request slots only
    ("num_slots", "<u4"),       # RingGeometry, as in the ring's header
    ("max_prompt_tokens", "<u4"),
    ("max_output_tokens", "<u4"),
    ("addr", "<u8"),            # the remote address of ring byte 0 (both regions; 0 for dma-buf)
])
assert HELLO_DTYPE.itemsize <= 56 and OFFER_DTYPE.itemsize <= 196


class RdmaError(RuntimeError):
    """A connection attempt, or an established connection, failed; the message says why."""


class RdmaPeerGone(RdmaError):
    """The engine's side of a connection went away (a failed work request or a CM event)."""


class RdmaUnavailable(RdmaError):
    """This machine cannot use --transport rdma (no pyverbs, no device, a wrong address)."""


def rdma_unavailable_reason() -> str | None:
    """What --transport rdma lacks on this machine, said for an operator; None when pyverbs
    imports and at least one RDMA device exists."""
    try:
        from pyverbs.device import get_device_list
    except ImportError as e:
        return f"needs pyverbs, which does not import here ({e}): {PYVERBS_HINT}"
    try:
        devices = get_device_list()
    except Exception as e:  # PyverbsRDMAError: libibverbs could not list devices
        return f"cannot list RDMA devices ({e}): {DEVICE_HINT}"
    if not devices:
        return f"found no RDMA device ({DEVICE_HINT})"
    try:  # every module and constant the transport takes (an older or partial pyverbs)
        _Verbs()
    except (ImportError, AttributeError) as e:
        return f"needs a pyverbs with what Blink uses, which this one lacks ({e}): {PYVERBS_HINT}"
    return None


def _module(*names: str):
    for name in names[:-1]:
        try:
            return importlib.import_module(name)
        except ImportError:
            pass
    return importlib.import_module(names[-1])


def _enum(module, enum: str | None, member: str):
    """An rdma-core constant: pyverbs built by Cython >= 3 has the enum classes
    (ibv_wr_opcode.IBV_WR_RDMA_READ), older builds only the bare module names."""
    cls = getattr(module, enum, None) if enum else None
    return getattr(cls, member) if cls is not None and hasattr(cls, member) \
        else getattr(module, member)


class _Verbs:
    """pyverbs' modules and the rdma-core constants used here, imported when first needed (the
    rest of Blink imports this module without pyverbs)."""

    def __init__(self):
        from pyverbs import cmid, cq, mr, qp, wr
        from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError
        self.cmid, self.cq, self.mr, self.qp, self.wr = cmid, cq, mr, qp, wr
        self.Error, self.RDMAError = PyverbsError, PyverbsRDMAError
        # rdma-core >= 59: libibverbs_enums / librdmacm_enums; 44 to 58: enums / cm_enums
        ibv = _module("pyverbs.libibverbs_enums", "pyverbs.enums")
        cm = _module("pyverbs.librdmacm_enums", "pyverbs.cm_enums")
        self.QPT_RC = _enum(ibv, "ibv_qp_type", "IBV_QPT_RC")
        self.QPS_INIT, self.QPS_RTR, self.QPS_RTS = (
            _enum(ibv, "ibv_qp_state", f"IBV_QPS_{s}") for s in ("INIT", "RTR", "RTS"))
        self.WR_READ, self.WR_WRITE = (
            _enum(ibv, "ibv_wr_opcode", f"IBV_WR_RDMA_{op}") for op in ("READ", "WRITE"))
        self.SIGNALED = _enum(ibv, "ibv_send_flags", "IBV_SEND_SIGNALED")
        self.WC_SUCCESS = _enum(ibv, "ibv_wc_status", "IBV_WC_SUCCESS")
        self.LOCAL_WRITE, self.REMOTE_WRITE, self.REMOTE_READ = (
            _enum(ibv, "ibv_access_flags", f"IBV_ACCESS_{a}")
            for a in ("LOCAL_WRITE", "REMOTE_WRITE", "REMOTE_READ"))
        self.PS_TCP = _enum(cm, "rdma_port_space", "RDMA_PS_TCP")
        self.RAI_PASSIVE = _enum(cm, None, "RAI_PASSIVE")
        self.OPTION_ID = _enum(cm, None, "RDMA_OPTION_ID")
        self.OPTION_ACK_TIMEOUT = _enum(cm, None, "RDMA_OPTION_ID_ACK_TIMEOUT")
        (self.ADDR_RESOLVED, self.ROUTE_RESOLVED, self.CONNECT_REQUEST, self.CONNECT_RESPONSE,
         self.REJECTED, self.ESTABLISHED, self.DEVICE_REMOVAL) = (
            _enum(cm, "rdma_cm_event_type", f"RDMA_CM_EVENT_{e}")
            for e in ("ADDR_RESOLVED", "ROUTE_RESOLVED", "CONNECT_REQUEST", "CONNECT_RESPONSE",
                      "REJECTED", "ESTABLISHED", "DEVICE_REMOVAL"))

    def wc_status(self, wc) -> str:
        try:
            text = self.cq.cqe_status_to_str(wc.status)
        except Exception:
            text = f"status {int(wc.status)}"
        return f"{text} (vendor error {int(wc.vendor_err):#x})"


def _rdma_cm_fds() -> set[int]:
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "/dev/infiniband/rdma_cm":
                fds.add(int(name))
        except OSError:
            pass  # closed meanwhile
    return fds


class _CmEvents:
    """An RDMA CM event channel whose events are waited for with a timeout (module docstring:
    pyverbs would block holding the GIL)."""

    def __init__(self, v: _Verbs):
        self.v = v
        v.cmid.CMEventChannel().close()   # librdmacm's first use opens its own files: not ours
        before = _rdma_cm_fds()
        self.channel = v.cmid.CMEventChannel()
        opened = _rdma_cm_fds() - before
        if len(opened) != 1:
            self.channel.close()
            raise RdmaError("cannot find the RDMA CM event channel's file descriptor "
                            f"(/proc/self/fd: {len(opened)} new rdma_cm files)")
        fd = opened.pop()
        os.set_blocking(fd, False)
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    def next(self, timeout_s: float):
        """The next event (a CMEvent the caller acknowledges), or None after timeout_s."""
        if not self._poll.poll(max(0, int(timeout_s * 1000))):
            return None
        try:
            return self.v.cmid.CMEvent(self.channel)
        except self.v.RDMAError as e:
            if e.error_code in (errno.EAGAIN, errno.EWOULDBLOCK):
                return None
            raise

    def close(self) -> None:
        self.channel.close()


def _close(*objs) -> None:
    """Closes pyverbs objects in the order given (a QP before its CQ, a CMID before its
    channel), skipping the ones never made."""
    for obj in objs:
        if obj is not None:
            try:
                obj.close()
            except Exception as e:  # closing is best effort: the process may be ending
                log.debug("closing %s: %s", type(obj).__name__, e)


# ---------------------------------------------------------------------------------------------
# Engine side.

class RingExport:
    """Serves this engine process's ring to front ends over RDMA (see the module docstring).
    on_fatal(reason) is called (from the export's thread) if it stops for good."""

    def __init__(self, host: str, port: int, ring_name: str, *,
                 on_fatal: Callable[[str], None]):
        self.where = f"{host}:{port}"
        self.ring_name = ring_name
        self.on_fatal = on_fatal
        self.connections: dict[int, object] = {}   # a front end's token -> its CMID
        self.groups: dict[int, int] = {}           # a front end's token -> its group
        self.segment: ShmSegment | None = None     # this process's ring, mapped again here
        self._device_ring: tuple[int, RingGeometry] | None = None  # (dma-buf fd, geometry)
        self.memory = ""                           # what was registered, said for the log
        self._mem: np.ndarray | None = None        # [total_bytes] u8 view: the regions' address
        self._regions: list = []                   # the read MR, then the write MR
        self._offer = b""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.events = self.listen_id = self.cq = None
        self.v = v = _Verbs()
        try:
            self.events = _CmEvents(v)
            self.listen_id = v.cmid.CMID(creator=self.events.channel, port_space=v.PS_TCP)
            self.listen_id.bind_addr(v.cmid.AddrInfo(src=host, src_service=str(port),
                                                     port_space=v.PS_TCP, flags=v.RAI_PASSIVE))
            # the engine never posts: its queue pairs only answer the front ends' READs/WRITEs
            self.cq = v.cq.CQ(self.listen_id.context, 1)
        except (RdmaError, v.Error) as e:
            self.close()
            raise RdmaUnavailable(
                f"cannot take RDMA CM address {self.where}: {e} (it must be an IP address of an "
                f"RDMA device's network interface, see `rdma link`, and the port free)") from None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="blink-rdma-export",
                                        daemon=True)
        self._thread.start()

    def serve_device_ring(self, dmabuf_fd: int, geom: RingGeometry) -> None:
        """The engine serves its ring from GPU memory: register that (a dma-buf of the whole
        ring, byte 0 at offset 0, its header saying SERVING), not a /dev/shm segment. The
        export closes the descriptor once it is registered (the regions keep the memory)."""
        self._device_ring = (dmabuf_fd, geom)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2)
        _close(*self.connections.values(), *self._regions, self.cq, self.listen_id, self.events)
        self.connections.clear()
        self._regions = []
        self.cq = self.listen_id = self.events = None  # a second close closes nothing again
        if self._device_ring is not None:  # handed over, never registered
            os.close(self._device_ring[0])
            self._device_ring = None
        if self.segment is not None:
            self._mem = None
            self.segment.close()
            self.segment = None

    # -- the export's thread ----------------------------------------------------------------

    def _serve(self) -> None:
        try:
            if not self._register_ring():
                return
            self.listen_id.listen(16)
            log.info("RDMA: listening on %s for front ends (ring registered as %s)", self.where,
                     self.memory)
            while not self._stop.is_set():
                event = self.events.next(0.5)
                if event is not None:
                    self._on_event(event)
        except Exception as e:
            log.exception("RDMA ring export failed")
            self.on_fatal(f"the RDMA ring export on {self.where} failed: {e}")

    def _own_ring(self) -> ShmSegment | None:
        """The ring this process's engine published (not a dead engine's stale one)."""
        try:
            seg = ShmSegment.attach(self.ring_name)
        except (FileNotFoundError, PermissionError):
            return None
        h = np.frombuffer(seg.mmap[:HEADER_DTYPE.itemsize], HEADER_DTYPE)[0] \
            if seg.size >= HEADER_DTYPE.itemsize else None
        if h is not None and int(h["magic"]) == RING_MAGIC and int(h["engine_pid"]) == os.getpid():
            return seg
        seg.close()
        return None

    def _register_ring(self) -> bool:
        """Waits until this engine serves its ring, then registers it; False if stopped first."""
        while True:
            taken, self._device_ring = self._device_ring, None
            if taken is not None:
                self._register_device_ring(*taken)
                return True
            if self.segment is None:
                self.segment = self._own_ring()
            if self.segment is not None:
                h = np.frombuffer(self.segment.mmap[:HEADER_DTYPE.itemsize], HEADER_DTYPE)[0]
                if int(h["engine_state"]) == EngineState.SERVING:
                    break
            if self._stop.wait(0.05):
                return False
        if int(h["layout_version"]) != LAYOUT_VERSION:
            raise RdmaError(f"the ring's layout version is {int(h['layout_version'])}, "
                            f"this code's {LAYOUT_VERSION}")
        geom = RingGeometry.from_header(h)
        if self.segment.size < geom.total_bytes:
            raise RdmaError("the ring segment is shorter than its header says")
        v, pd = self.v, self.listen_id.pd
        self._mem = self.segment.array()
        addr = self._mem.ctypes.data
        read_mr = v.mr.MR(pd, geom.total_bytes, v.REMOTE_READ, address=addr)
        self._regions.append(read_mr)
        write_mr = v.mr.MR(pd, geom.num_slots * geom.slot_bytes,
                           v.LOCAL_WRITE | v.REMOTE_WRITE, address=addr + geom.slots_offset)
        self._regions.append(write_mr)
        self._make_offer(geom, addr)
        self.memory = (f"pinned host memory, /dev/shm/{self.ring_name}: the pages the GPU maps "
                       f"(--ring-memory host)")
        return True

    def _register_device_ring(self, fd: int, geom: RingGeometry) -> None:
        """The ring in GPU memory, by its dma-buf. DmaBufMR's I/O virtual address is its
        offset in the buffer, so a front end's remote address of ring byte n is n (addr 0)."""
        v, pd = self.v, self.listen_id.pd
        try:
            read_mr = v.mr.DmaBufMR(pd, geom.total_bytes, v.REMOTE_READ, fd, 0)
            self._regions.append(read_mr)
            write_mr = v.mr.DmaBufMR(pd, geom.num_slots * geom.slot_bytes,
                                     v.LOCAL_WRITE | v.REMOTE_WRITE, fd, geom.slots_offset)
            self._regions.append(write_mr)
        except v.Error as e:
            raise RdmaError(f"the NIC could not register the GPU-memory ring's dma-buf ({e}): "
                            f"the NIC's driver must import dma-buf (mlx5 on Linux >= 5.12), "
                            f"else run the engine with --ring-memory host") from None
        finally:
            os.close(fd)
        self._make_offer(geom, 0)
        self.memory = (f"GPU memory, a {geom.total_bytes}-byte dma-buf (--ring-memory gpu: the "
                       f"NIC reads and writes the GPU's memory, no host memory on the path)")

    def _make_offer(self, geom: RingGeometry, addr: int) -> None:
        read_mr, write_mr = self._regions
        offer = np.zeros((), OFFER_DTYPE)
        offer["magic"], offer["layout_version"] = RING_MAGIC, LAYOUT_VERSION
        offer["read_rkey"], offer["write_rkey"] = read_mr.rkey, write_mr.rkey
        offer["num_slots"] = geom.num_slots
        offer["max_prompt_tokens"] = geom.max_prompt_tokens
        offer["max_output_tokens"] = geom.max_output_tokens
        offer["addr"] = addr
        self._offer = offer.tobytes()

    def _on_event(self, event) -> None:
        v = self.v
        kind = event.event_type
        if kind != v.CONNECT_REQUEST:
            name = event.event_str()
            event.ack_cm_event()
            if kind == v.DEVICE_REMOVAL:
                raise RdmaError("the RDMA device was removed")
            log.info("RDMA: %s (%d front-end connections)", name, len(self.connections))
            return
        hello = event.private_data
        conn = v.cmid.CMID(creator=event, listen_id=self.listen_id)
        event.ack_cm_event()   # before anything that could close conn (destroy waits for acks)
        token, group, refusal = _read_hello(hello)
        if refusal is not None:
            log.warning("RDMA: refused a front end: %s", refusal)
            # a failure here is this connection's, not the export's (whose end stops the
            # engine: on_fatal)
            try:
                conn.reject(REFUSAL + refusal.encode()[:100])
            except v.Error as e:
                log.warning("RDMA: could not refuse it: %s", e)
            _close(conn)
            return
        try:
            conn.create_qp(v.qp.QPInitAttr(qp_type=v.QPT_RC, scq=self.cq, rcq=self.cq,
                                           cap=v.qp.QPCap(max_send_wr=1, max_recv_wr=1)))
            param = v.cmid.ConnParam(resources=RDMA_MAX_DEPTH, depth=0, retry=RETRY_COUNT,
                                     data_len=len(self._offer))
            param.set_private_data(self._offer)
            conn.accept(param)
        except v.Error as e:
            log.warning("RDMA: could not accept a front end: %s", e)
            _close(conn)  # (as a refusal's: this connection's failure, not the export's)
            return
        earlier = self.connections.pop(token, None)
        if earlier is not None:  # the same front end reconnected: its old connection is dead
            _close(earlier)
        others = [t for t, g in self.groups.items() if group and g and g != group]
        for other in others:  # one front end per engine: the earlier one's connections go
            _close(self.connections.pop(other))
            del self.groups[other]
        if others:
            log.warning("RDMA: front end %x is another front end than the one this engine "
                        "served: its %d connections are closed. One front end (with its "
                        "workers) per engine: if the other still runs, the two take the "
                        "engine from each other", group, len(others))
        self.connections[token], self.groups[token] = conn, group
        log.info("RDMA: accepted front end %x (%d connections)", token, len(self.connections))


def _read_hello(data: bytes) -> tuple[int, int, str | None]:
    """(token, group, None), or (0, 0, why the front end is refused)."""
    if len(data) < HELLO_DTYPE.itemsize:
        return 0, 0, "not a Blink front end (no hello)"
    hello = np.frombuffer(data[:HELLO_DTYPE.itemsize], HELLO_DTYPE)[0]
    if int(hello["magic"]) != RING_MAGIC:
        return 0, 0, "not a Blink front end"
    if int(hello["layout_version"]) != LAYOUT_VERSION:
        return 0, 0, (f"ring layout version {LAYOUT_VERSION} here, "
                      f"{int(hello['layout_version'])} in the front end")
    return int(hello["token"]), int(hello["group"]), None


# ---------------------------------------------------------------------------------------------
# Front-end side.

class RdmaDialer:
    """Connects a front end to an engine's RingExport. Each `step` waits at most
    step_budget_s: it returns the transport once connected, None while the handshake is under
    way, and raises RdmaError when an attempt failed (the next step starts a new one)."""

    def __init__(self, host: str, port: int, *, group: int = 0, timeout_s: float = 5.0,
                 step_budget_s: float = 0.01):
        """group: the same for a front end and its workers (RingExport keeps one group's
        connections); 0: not said."""
        self.v = _Verbs()
        self.host, self.port, self.where, self.group = host, port, f"{host}:{port}", group
        self.timeout_s, self.step_budget_s = timeout_s, step_budget_s
        self.token = secrets.randbits(63) | 1  # names this process's connection to the engine
        self._pending: RdmaTransport | None = None

    def step(self) -> RdmaTransport | None:
        try:
            if self._pending is None:
                self._pending = RdmaTransport(self)
            if self._pending.advance(self.step_budget_s):
                transport, self._pending = self._pending, None
                return transport
            if time.monotonic() - self._pending.started > self.timeout_s:
                raise RdmaError(f"no RDMA connection to the engine at {self.where} within "
                                f"{self.timeout_s:g} s")
            return None
        except (RdmaError, OSError, self.v.Error) as e:
            if self._pending is not None:
                self._pending.close()
                self._pending = None
            if isinstance(e, RdmaError):
                raise
            raise RdmaError(f"connecting to the engine at {self.where}: {e}") from None


class RdmaTransport:
    """RingTransport over one RC queue pair to an engine's RingExport. Made by RdmaDialer,
    which drives `advance` until it is connected."""

    mapped = False  # nothing is read from an engine that is gone

    def __init__(self, dialer: RdmaDialer):
        self.v, self.where, self.token, self.group = (dialer.v, dialer.where, dialer.token,
                                                      dialer.group)
        self.started = time.monotonic()
        self.connected = False
        self.size = 0
        self.events = self.cmid = self.cq = self.qp = self._mr = self._local = None
        self._mirror: np.ndarray | None = None   # [size] u8: the ring's bytes as last read
        self._gone: str | None = None             # why the connection ended
        self._batches: dict[tuple, list] = {}     # read_strided's chained READs, by arguments
        v = self.v
        try:
            self.events = _CmEvents(v)
            self.cmid = v.cmid.CMID(creator=self.events.channel, port_space=v.PS_TCP)
            self.cmid.resolve_addr(v.cmid.AddrInfo(dst=dialer.host, dst_service=str(dialer.port),
                                                   port_space=v.PS_TCP), ROUTE_TIMEOUT_MS)
        except BaseException:
            self.close()
            raise

    # -- the handshake ----------------------------------------------------------------------

    def advance(self, budget_s: float) -> bool:
        """Handles the CM events that arrive within budget_s; True once connected."""
        v = self.v
        deadline = time.monotonic() + budget_s
        while not self.connected:
            event = self.events.next(deadline - time.monotonic())
            if event is None:
                return False
            kind, name = event.event_type, event.event_str()
            data = event.private_data if kind in (v.CONNECT_RESPONSE, v.REJECTED) else b""
            event.ack_cm_event()
            if kind == v.ADDR_RESOLVED:
                self.cmid.set_option(v.OPTION_ID, v.OPTION_ACK_TIMEOUT, ACK_TIMEOUT, 1)
                self.cmid.resolve_route(ROUTE_TIMEOUT_MS)
            elif kind == v.ROUTE_RESOLVED:
                self._connect()
            elif kind == v.CONNECT_RESPONSE:
                self._establish(data)
            elif kind == v.REJECTED:
                text = data.rstrip(b"\0")
                if text.startswith(REFUSAL):
                    raise RdmaError(f"the engine at {self.where} refused the connection: "
                                    f"{text[len(REFUSAL):].decode(errors='replace')}")
                raise RdmaError(f"nothing accepts RDMA connections at {self.where} (is the "
                                f"engine up and serving, with --transport rdma --rdma-addr "
                                f"{self.where}?)")
            else:
                raise RdmaError(f"connecting to the engine at {self.where}: {name}")
        return True

    def _connect(self) -> None:
        v = self.v
        self.cq = v.cq.CQ(self.cmid.context, MAX_OUTSTANDING)
        self.qp = v.qp.QP(self.cmid.pd, v.qp.QPInitAttr(
            qp_type=v.QPT_RC, scq=self.cq, rcq=self.cq, sq_sig_all=0,
            cap=v.qp.QPCap(max_send_wr=MAX_OUTSTANDING, max_recv_wr=1)))
        hello = np.zeros((), HELLO_DTYPE)
        hello["magic"], hello["layout_version"], hello["token"], hello["group"] = \
            RING_MAGIC, LAYOUT_VERSION, self.token, self.group
        # no READs from the engine; as many outstanding READs to it as both devices allow
        param = v.cmid.ConnParam(resources=0, depth=RDMA_MAX_DEPTH, retry=RETRY_COUNT,
                                 qp_num=self.qp.qp_num, data_len=HELLO_DTYPE.itemsize)
        param.set_private_data(hello.tobytes())
        self.cmid.connect(param)

    def _establish(self, data: bytes) -> None:
        """The engine accepted: its Offer, a local mirror of the ring, the queue pair to RTS."""
        v = self.v
        if len(data) < OFFER_DTYPE.itemsize:
            raise RdmaError(f"the engine at {self.where} sent no ring description")
        offer = np.frombuffer(data[:OFFER_DTYPE.itemsize], OFFER_DTYPE)[0]
        if int(offer["magic"]) != RING_MAGIC or int(offer["layout_version"]) != LAYOUT_VERSION:
            raise RdmaError(f"the engine at {self.where} offers ring layout version "
                            f"{int(offer['layout_version'])}; this front end has {LAYOUT_VERSION}")
        try:
            geom = RingGeometry(int(offer["num_slots"]), int(offer["max_prompt_tokens"]),
                                int(offer["max_output_tokens"]))
        except ValueError as e:
            raise RdmaError(f"the engine at {self.where} offers a bad ring: {e}") from None
        self.size = geom.total_bytes
        self._slots = (geom.slots_offset, geom.slots_offset + geom.num_slots * geom.slot_bytes)
        self._remote = int(offer["addr"])
        self._read_rkey, self._write_rkey = int(offer["read_rkey"]), int(offer["write_rkey"])
        self._local = mmap.mmap(-1, self.size)
        self._mirror = np.frombuffer(self._local, np.uint8)
        self._mr = v.mr.MR(self.cmid.pd, self.size, v.LOCAL_WRITE,
                           address=self._mirror.ctypes.data)
        for state in (v.QPS_INIT, v.QPS_RTR, v.QPS_RTS):
            attr, mask = self.cmid.init_qp_attr(state)
            self.qp.modify(attr, mask)
        self.cmid.establish()
        self.connected = True

    # -- RingTransport ----------------------------------------------------------------------

    def read(self, offset: int, length: int) -> bytes:
        self._check(offset, length)
        self._run([self._wr(self.v.WR_READ, offset, length)])
        return self._mirror[offset:offset + length].tobytes()

    def write(self, offset: int, data: bytes) -> None:
        end = offset + len(data)
        if not self._slots[0] <= offset <= end <= self._slots[1]:
            raise ValueError(f"ring bytes [{offset}, {end}) are not in the request slots: "
                             f"the engine lets front ends write only those")
        self._mirror[offset:end] = np.frombuffer(data, np.uint8)
        self._run([self._wr(self.v.WR_WRITE, offset, len(data))])

    def read_strided(self, offset: int, stride: int, count: int, length: int) -> bytes:
        key = (offset, stride, count, length)
        batches = self._batches.get(key)
        if batches is None:   # the same few reads every poll: their work requests are kept
            if count:
                self._check(offset, (count - 1) * stride + length)
            wrs = [self._wr(self.v.WR_READ, offset + i * stride, length) for i in range(count)]
            batches = [wrs[i:i + MAX_OUTSTANDING] for i in range(0, count, MAX_OUTSTANDING)]
            for batch in batches:   # each batch one chain, posted at once
                for wr, after in zip(batch, batch[1:]):
                    wr.next_wr = after
            if len(self._batches) >= 16:
                self._batches.clear()
            self._batches[key] = batches
        for batch in batches:
            self._run(batch)
        return gather_strided(self._mirror, offset, stride, count, length)

    def is_current(self) -> bool:
        """False once the connection ended: a failed work request, or any CM event on it."""
        if self._gone is None and self.connected:
            event = self.events.next(0)
            if event is not None:
                kind, name = event.event_type, event.event_str()
                event.ack_cm_event()
                if kind != self.v.ESTABLISHED:
                    self._gone = f"the engine at {self.where} disconnected ({name})"
                    log.warning("RDMA: %s", self._gone)
        return self._gone is None

    def close(self) -> None:
        # the queue pair before its CQ; the CM id (its destruction disconnects) before its channel
        _close(self.qp, self.cq, self._mr, self.cmid, self.events)
        self.qp = self.cq = self._mr = self.cmid = self.events = None
        self._batches.clear()
        self._mirror = None
        if self._local is not None:
            self._local.close()
            self._local = None

    # -- work requests ----------------------------------------------------------------------

    def _check(self, offset: int, length: int) -> None:
        if self._gone is not None:
            raise RdmaPeerGone(self._gone)
        if not 0 <= offset <= offset + length <= self.size:
            raise ValueError(f"ring bytes [{offset}, {offset + length}) are past its "
                             f"{self.size} bytes")

    def _wr(self, opcode, offset: int, length: int):
        """A signalled RDMA READ or WRITE between mirror[offset:] and the ring's same bytes."""
        v = self.v
        sge = v.wr.SGE(self._mirror.ctypes.data + offset, length, self._mr.lkey)
        wr = v.wr.SendWR(opcode=opcode, num_sge=1, sg=[sge], send_flags=v.SIGNALED)
        rkey = self._write_rkey if opcode == v.WR_WRITE else self._read_rkey
        wr.set_wr_rdma(rkey, self._remote + offset)
        return wr

    def _run(self, wrs: list) -> None:
        """Posts a chain of work requests (wrs[0] -> ... -> wrs[-1], at most MAX_OUTSTANDING)
        and waits for all their completions: none is in flight when this returns."""
        if self._gone is not None:
            raise RdmaPeerGone(self._gone)
        try:
            self.qp.post_send(wrs[0])
        except self.v.Error as e:
            self._fail(f"posting to the engine at {self.where} failed: {e}")
        left, deadline = len(wrs), time.monotonic() + OP_TIMEOUT_S
        while left:
            try:
                polled, wcs = self.cq.poll(left)
            except self.v.Error as e:
                self._fail(f"polling the completions of the engine at {self.where} failed: {e}")
            for wc in wcs:
                if wc.status != self.v.WC_SUCCESS:
                    self._fail(f"an RDMA operation on the engine at {self.where} failed: "
                               f"{self.v.wc_status(wc)}")
            left -= polled
            if left and not polled and time.monotonic() > deadline:
                self._fail(f"the engine at {self.where} did not answer within "
                           f"{OP_TIMEOUT_S:g} s")

    def _fail(self, why: str) -> None:
        self._gone = why
        log.warning("RDMA: %s", why)
        raise RdmaPeerGone(why)
