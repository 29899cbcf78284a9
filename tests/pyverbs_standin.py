"""A stand-in for the parts of pyverbs that blink.ring.rdma uses, in one process, so that
module's logic (handshake, Hello and Offer, memory regions, READ/WRITE through the local
mirror, chained batches, completion errors, disconnects, reconnects) runs in CI. It encodes this
project's reading of pyverbs' API, so it cannot show that reading right: only a device can.

Loopback semantics: a connect request reaches the listener bound to the destination address;
RDMA READ and WRITE copy between registered memory at once (ctypes.memmove) after checking the
keys, access flags and bounds a NIC checks, and complete with a work completion; a closed
connection's peer gets RDMA_CM_EVENT_DISCONNECTED and its later work requests fail with
IBV_WC_RETRY_EXC_ERR. The rdma_cm constants are enum classes (pyverbs built by Cython >= 3),
the verbs ones bare module names (older builds), so both of rdma._enum's ways are taken.
"""
from __future__ import annotations

import ctypes
import enum
import errno
import itertools
import mmap
import os
import sys
import time
import types
from collections import deque

IBV = dict(IBV_QPT_RC=2, IBV_QPS_RESET=0, IBV_QPS_INIT=1, IBV_QPS_RTR=2, IBV_QPS_RTS=3,
           IBV_WR_RDMA_WRITE=0, IBV_WR_RDMA_READ=4, IBV_SEND_SIGNALED=2, IBV_WC_SUCCESS=0,
           IBV_WC_REM_ACCESS_ERR=10, IBV_WC_RETRY_EXC_ERR=12, IBV_ACCESS_LOCAL_WRITE=1,
           IBV_ACCESS_REMOTE_WRITE=2, IBV_ACCESS_REMOTE_READ=4)
# when a work request to a vanished peer fails: (RETRY_COUNT + 1) x 4.096 us x 2^ACK_TIMEOUT
RETRY_EXHAUSTED_S = 4 * 4.096e-6 * 2 ** 14


class rdma_cm_event_type(enum.IntEnum):
    RDMA_CM_EVENT_ADDR_RESOLVED = 0
    RDMA_CM_EVENT_ADDR_ERROR = 1
    RDMA_CM_EVENT_ROUTE_RESOLVED = 2
    RDMA_CM_EVENT_CONNECT_REQUEST = 4
    RDMA_CM_EVENT_CONNECT_RESPONSE = 5
    RDMA_CM_EVENT_REJECTED = 8
    RDMA_CM_EVENT_ESTABLISHED = 9
    RDMA_CM_EVENT_DISCONNECTED = 10
    RDMA_CM_EVENT_DEVICE_REMOVAL = 11


class rdma_port_space(enum.IntEnum):
    RDMA_PS_TCP = 0x0106


E = rdma_cm_event_type


class PyverbsError(Exception):
    pass


class PyverbsRDMAError(PyverbsError):
    def __init__(self, msg, error_code=-1):
        super().__init__(f"{msg}. Errno: {error_code}" if error_code != -1 else msg)
        self.error_code = error_code


class Fabric:
    """Everything the stand-in's objects share: listeners, memory regions, channels."""

    def __init__(self, device_ips):
        self.device_ips = set(device_ips)
        self.listeners = {}        # (host, port) -> listening CMID
        self.regions = {}          # rkey -> MR
        self.channels = set()      # live CMEventChannels
        self.qps = {}              # qp_num -> QP
        self.keys = itertools.count(0x1000)
        self.qpns = itertools.count(100)
        self.connects = 0          # connect requests sent


FABRIC: Fabric | None = None


class CMEventChannel:
    def __init__(self):
        self.events = deque()
        self.fd, self._w = os.pipe()
        FABRIC.channels.add(self)

    def post(self, kind, data=b"", conn=None):
        self.events.append((kind, data, conn))
        os.write(self._w, b"e")

    def close(self):
        if self in FABRIC.channels:
            FABRIC.channels.discard(self)
            os.close(self.fd)
            os.close(self._w)


class CMEvent:
    def __init__(self, channel):
        if not channel.events:
            raise PyverbsRDMAError("Failed to create CMEvent", errno.EAGAIN)
        os.read(channel.fd, 1)
        self.event_type, self.private_data, self.conn = channel.events.popleft()
        self.acked = False

    def event_str(self):
        return self.event_type.name

    def ack_cm_event(self):
        assert not self.acked, "an event acknowledged twice"
        self.acked = True


class AddrInfo:
    def __init__(self, src=None, dst=None, src_service=None, dst_service=None, port_space=0,
                 flags=0):
        assert port_space == rdma_port_space.RDMA_PS_TCP
        self.src = (src, int(src_service)) if src else None
        self.dst = (dst, int(dst_service)) if dst else None


class ConnParam:
    def __init__(self, resources=1, depth=1, flow_control=0, retry=5, rnr_retry=5, srq=0,
                 qp_num=0, data_len=0):
        self.qpn, self.data_len, self.private_data = qp_num, data_len, b""

    def set_private_data(self, data):
        self.private_data = bytes(data[:self.data_len])


class Context:
    alive = True  # pyverbs clears a CMID's context when the CMID closes


class PD:
    def __init__(self, ctx):
        self.ctx, self.alive = ctx, True


class CMID:
    def __init__(self, creator=None, qp_init_attr=None, pd=None, port_space=None,
                 listen_id=None):
        self.own_qp = None     # made by create_qp (the engine's side)
        self.conn_qp = None    # the queue pair this id connects: own_qp, or the connect's one
        self.peer = self.dst = self.addr = None
        self.closed = self.connected = False
        if isinstance(creator, CMEventChannel):
            self.channel, self.ctx, self.pd = creator, None, None
        else:  # a connect request's new id: shares the listener's context and PD (as pyverbs)
            assert isinstance(creator, CMEvent)
            assert creator.event_type == E.RDMA_CM_EVENT_CONNECT_REQUEST
            assert not creator.acked, "the new id is made from the event before its ack"
            self.channel, self.ctx, self.pd = listen_id.channel, listen_id.ctx, listen_id.pd
            self.peer = creator.conn
            self.peer.peer = self

    @property
    def context(self):
        return self.ctx

    def bind_addr(self, ai):
        if ai.src[0] not in FABRIC.device_ips:
            raise PyverbsRDMAError("Failed to Bind ID", errno.ENODEV)
        if ai.src in FABRIC.listeners:
            raise PyverbsRDMAError("Failed to Bind ID", errno.EADDRINUSE)
        self.addr, self.ctx = ai.src, Context()
        self.pd = PD(self.ctx)
        FABRIC.listeners[self.addr] = None    # bound, not yet listening

    def listen(self, backlog=0):
        FABRIC.listeners[self.addr] = self

    def resolve_addr(self, ai, timeout_ms=2000):
        self.dst = ai.dst
        ok = ai.dst[0] in FABRIC.device_ips
        self.channel.post(E.RDMA_CM_EVENT_ADDR_RESOLVED if ok else E.RDMA_CM_EVENT_ADDR_ERROR)

    def set_option(self, level, optname, optval, optlen):
        assert optlen == 1 and self.dst is not None

    def resolve_route(self, timeout_ms=2000):
        self.ctx = Context()
        self.pd = PD(self.ctx)
        self.channel.post(E.RDMA_CM_EVENT_ROUTE_RESOLVED)

    def connect(self, param):
        assert len(param.private_data) <= 56
        self.conn_qp = FABRIC.qps[param.qpn]
        FABRIC.connects += 1
        listener = FABRIC.listeners.get(self.dst)
        if listener is None:
            self.channel.post(E.RDMA_CM_EVENT_REJECTED, b"\0" * 148)   # no consumer there
        else:
            listener.channel.post(E.RDMA_CM_EVENT_CONNECT_REQUEST,
                                  param.private_data.ljust(56, b"\0"), conn=self)

    def create_qp(self, init):
        self.own_qp = self.conn_qp = QP(self.pd, init)
        self.own_qp.state = IBV["IBV_QPS_INIT"]

    def accept(self, param):
        assert self.own_qp is not None and len(param.private_data) <= 196
        self.own_qp.state = IBV["IBV_QPS_RTS"]
        self.own_qp.peer, self.peer.conn_qp.peer = self.peer.conn_qp, self.own_qp
        self.connected = self.peer.connected = True
        self.peer.channel.post(E.RDMA_CM_EVENT_CONNECT_RESPONSE,
                               param.private_data.ljust(196, b"\0"))

    def reject(self, private_data=None):
        assert len(private_data or b"") <= 148
        self.peer.channel.post(E.RDMA_CM_EVENT_REJECTED, (private_data or b"").ljust(148, b"\0"))

    def init_qp_attr(self, qp_state):
        return types.SimpleNamespace(qp_state=qp_state), 1

    def establish(self):
        assert self.conn_qp.state == IBV["IBV_QPS_RTS"]
        self.peer.channel.post(E.RDMA_CM_EVENT_ESTABLISHED)

    def close(self):
        if self.closed:
            return
        self.closed = True
        if self.own_qp is not None:
            self.own_qp.close()
        if self.connected and not self.peer.closed:
            self.peer.channel.post(E.RDMA_CM_EVENT_DISCONNECTED)
        if self.addr is not None and self.addr in FABRIC.listeners:
            del FABRIC.listeners[self.addr]
        for shared in (self.ctx, self.pd):   # what pyverbs' CMID.close does to them
            if shared is not None:
                shared.alive = False


class QPCap:
    def __init__(self, max_send_wr=1, max_recv_wr=10, max_send_sge=1, max_recv_sge=1,
                 max_inline_data=0):
        self.max_send_wr = max_send_wr


class QPInitAttr:
    def __init__(self, qp_type=None, qp_context=None, scq=None, rcq=None, srq=None, cap=None,
                 sq_sig_all=1):
        assert qp_type == IBV["IBV_QPT_RC"] and isinstance(scq, CQ) and scq is rcq
        self.cq, self.cap = scq, cap


class QP:
    def __init__(self, pd, init, qp_attr=None):
        self.pd, self.cq, self.cap = pd, init.cq, init.cap
        self.qp_num, self.state, self.peer, self.closed = next(FABRIC.qpns), 0, None, False
        FABRIC.qps[self.qp_num] = self

    def modify(self, attr, mask):
        assert attr.qp_state == self.state + 1, "INIT, RTR, RTS in order"
        self.state = attr.qp_state

    def post_send(self, wr):
        assert self.state == IBV["IBV_QPS_RTS"] and not self.closed
        chain = []
        while wr is not None:
            chain.append(wr)
            wr = wr.next_wr
        assert len(chain) <= self.cap.max_send_wr, "more work requests than the queue holds"
        for wr in chain:
            status = self._execute(wr)
            # a packet to a queue pair that is gone is dropped, not refused: the requester
            # sees the failure once its retries run out, (retry_cnt + 1) x 4.096 us x
            # 2^timeout later (Blink's 3 and 14: about 0.27 s)
            due = time.monotonic() + (RETRY_EXHAUSTED_S
                                      if status == IBV["IBV_WC_RETRY_EXC_ERR"] else 0.0)
            if wr.send_flags & IBV["IBV_SEND_SIGNALED"]:
                self.cq.push(types.SimpleNamespace(status=status, vendor_err=0, due=due))

    def _execute(self, wr) -> int:
        if self.peer is None or self.peer.closed:
            return IBV["IBV_WC_RETRY_EXC_ERR"]
        (sge,) = wr.sg
        local = FABRIC.regions.get(("l", sge.lkey))
        remote = FABRIC.regions.get(wr.rkey)
        write = wr.opcode == IBV["IBV_WR_RDMA_WRITE"]
        need = IBV["IBV_ACCESS_REMOTE_WRITE"] if write else IBV["IBV_ACCESS_REMOTE_READ"]
        assert local is not None and local.holds(sge.addr, sge.length), "a bad local SGE"
        if (remote is None or not remote.access & need
                or not remote.holds(wr.remote_addr, sge.length)):
            return IBV["IBV_WC_REM_ACCESS_ERR"]
        at = remote.local_address(wr.remote_addr)
        src, dst = (sge.addr, at) if write else (at, sge.addr)
        ctypes.memmove(dst, src, sge.length)
        return IBV["IBV_WC_SUCCESS"]

    def close(self):
        self.closed = True
        FABRIC.qps.pop(self.qp_num, None)


class CQ:
    def __init__(self, context, cqe, cq_context=None, channel=None, comp_vector=0):
        assert context.alive, "a CQ on a context a closed CMID cleared"
        self.cqe, self.wcs = cqe, deque()

    def push(self, wc):
        assert len(self.wcs) < self.cqe, "CQ overrun"
        self.wcs.append(wc)

    def poll(self, num_entries=1):
        out = []
        while self.wcs and len(out) < num_entries and self.wcs[0].due <= time.monotonic():
            out.append(self.wcs.popleft())
        return len(out), out

    def close(self):
        pass


def cqe_status_to_str(status):
    return {v: k for k, v in IBV.items() if k.startswith("IBV_WC_")}[status]


class MR:
    """Memory at a user address; the address is also its I/O virtual address (remote address)."""

    def __init__(self, creator, length=0, access=0, address=None, implicit=False):
        assert isinstance(creator, PD) and address
        self._register(creator, length, access, iova=address)

    def _register(self, pd, length, access, iova):
        assert pd.alive, "a memory region on a PD a closed CMID cleared"
        self.buf, self.length, self.access = iova, length, access
        self.lkey, self.rkey = next(FABRIC.keys), next(FABRIC.keys)
        FABRIC.regions[self.rkey] = FABRIC.regions[("l", self.lkey)] = self

    def holds(self, addr, length):
        return self.buf <= addr and addr + length <= self.buf + self.length

    def local_address(self, addr):
        return addr

    def close(self):
        FABRIC.regions.pop(self.rkey, None)
        FABRIC.regions.pop(("l", self.lkey), None)


class DmaBufMR(MR):
    """pyverbs >= 44's DmaBufMR(pd, length, access, dmabuf, offset) given a file descriptor:
    bytes offset .. offset + length of the buffer, at I/O virtual address `offset` (what
    ibv_reg_dmabuf_mr gets from pyverbs). Here any mmap-able descriptor serves as the dma-buf
    (a /dev/shm file in the tests); it is mapped at registration, so the caller may close it."""

    def __init__(self, pd, length, access, dmabuf=None, offset=0, gpu=0, gtt=0):
        assert isinstance(pd, PD) and isinstance(dmabuf, int), "an fd, not a pyverbs DmaBuf"
        self._map = mmap.mmap(dmabuf, offset + length)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._register(pd, length, access, iova=offset)

    def local_address(self, addr):
        return self._base + addr


class SGE:
    def __init__(self, addr, length, lkey):
        self.addr, self.length, self.lkey = addr, length, lkey


class SendWR:
    def __init__(self, wr_id=0, opcode=0, num_sge=0, imm_data=0, sg=None, send_flags=0,
                 next_wr=None):
        assert num_sge == len(sg) == 1
        self.opcode, self.sg, self.send_flags, self.next_wr = opcode, list(sg), send_flags, next_wr
        self.rkey = self.remote_addr = None

    def set_wr_rdma(self, rkey, addr):
        self.rkey, self.remote_addr = rkey, addr


def install(monkeypatch, device_ips=("127.0.0.1",)) -> Fabric:
    """Puts the stand-in in sys.modules as `pyverbs` (and its submodules)."""
    global FABRIC
    FABRIC = Fabric(device_ips)
    mods = {}

    def module(name, **attrs):
        mods[name] = mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
        return mod

    module("pyverbs.pyverbs_error", PyverbsError=PyverbsError, PyverbsRDMAError=PyverbsRDMAError)
    module("pyverbs.device", get_device_list=lambda: ["standin0"])
    module("pyverbs.cmid", CMID=CMID, CMEvent=CMEvent, CMEventChannel=CMEventChannel,
           AddrInfo=AddrInfo, ConnParam=ConnParam)
    module("pyverbs.cq", CQ=CQ, cqe_status_to_str=cqe_status_to_str)
    module("pyverbs.mr", MR=MR, DmaBufMR=DmaBufMR)
    module("pyverbs.qp", QP=QP, QPInitAttr=QPInitAttr, QPCap=QPCap)
    module("pyverbs.wr", SGE=SGE, SendWR=SendWR)
    module("pyverbs.libibverbs_enums", **IBV)
    module("pyverbs.librdmacm_enums", rdma_cm_event_type=rdma_cm_event_type,
           rdma_port_space=rdma_port_space, RAI_PASSIVE=1, RDMA_OPTION_ID=0,
           RDMA_OPTION_ID_ACK_TIMEOUT=3)
    module("pyverbs", **{n.split(".")[1]: m for n, m in mods.items()})
    from blink.ring import rdma
    monkeypatch.setattr(rdma, "_rdma_cm_fds", lambda: {c.fd for c in FABRIC.channels})
    return FABRIC
