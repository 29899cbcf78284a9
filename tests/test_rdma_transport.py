"""--transport rdma: the start-up check on every machine (a real subprocess of the CLI: the
message, the exit status, nothing left behind), and the real RDMA path where a device exists
(soft-RoCE counts; deploy/README.md, "RDMA tests with soft-RoCE"), skipped elsewhere with the
reason."""
from __future__ import annotations

import asyncio
import importlib.util
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from blink.gpu_engine.ring_server import ModelLimits, RingServer
from blink.nic_service.engine_link import (EngineLink, EngineUnavailable, Finished, Tokens,
                                           WorkerCounts)
from blink.ring.layout import EngineState, FinishReason, RingGeometry
from blink.ring.rdma import rdma_unavailable_reason
from blink.ring.shm import shm_path

VOCAB = 500
LIMITS = ModelLimits(vocab_size=VOCAB, context_length=64, kv_capacity_tokens=4096)


def blink(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "blink.client.cli", *args], capture_output=True,
                          text=True, timeout=120, env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# -- the start-up check: on every machine ----------------------------------------------------

ROLES = {  # command -> its arguments besides the transport's
    "engine": [],
    "frontend": ["--port", "{port}"],
    "serve": ["--port", "{port}", "--engine", "cpu"],
}


def refused_start(command: str, tmp_path: Path, env: dict | None = None) -> str:
    """Runs `blink COMMAND --transport rdma` and checks it started nothing; returns stderr."""
    ring, port = f"blink-test-rdma-{secrets.token_hex(4)}", free_port()
    argv = [command, "--transport", "rdma", "--rdma-addr", "127.0.0.1:7471",
            "--ring-name", ring, "--model", str(tmp_path / "not-a-checkpoint"),
            *(a.format(port=port) for a in ROLES[command])]
    started = time.monotonic()
    out = blink(*argv, env=env)
    assert out.returncode == 1, out.stderr   # sys.exit with a message
    assert out.stdout == ""
    assert not shm_path(ring).exists()       # no ring created
    assert port_is_free(port)                # no port bound
    # checked before the model folder (which does not exist) and before any engine: the only
    # line is the transport's
    assert out.stderr.count("\n") == 1 and "not-a-checkpoint" not in out.stderr
    assert time.monotonic() - started < 60
    return out.stderr


def fake_pyverbs(tmp_path: Path, devices: list[str]) -> dict:
    """The environment of a process in which `pyverbs` is a package of one module, device, whose
    get_device_list() returns `devices`."""
    fake = tmp_path / "fake" / "pyverbs"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "device.py").write_text(f"def get_device_list():\n    return {devices!r}\n")
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(fake.parent), *filter(None, [os.environ.get("PYTHONPATH")])]))


@pytest.mark.parametrize("command", ROLES)
def test_rdma_without_pyverbs_refuses_to_start(command, tmp_path):
    if importlib.util.find_spec("pyverbs") is not None:
        pytest.skip("pyverbs is installed here: the no-device check below covers this machine")
    err = refused_start(command, tmp_path)
    assert err.startswith("blink: --transport rdma needs pyverbs, which does not import here")
    assert "pip install -e '.[rdma]'" in err and "rdma-core >= 57" in err


@pytest.mark.parametrize("command", ROLES)
def test_rdma_without_a_device_refuses_to_start(command, tmp_path):
    """pyverbs imports (a stand-in package on PYTHONPATH whose device list is empty, as on a
    machine with rdma-core but no RDMA NIC and no soft-RoCE)."""
    err = refused_start(command, tmp_path, fake_pyverbs(tmp_path, []))
    assert err.startswith("blink: --transport rdma found no RDMA device (ibv_devices lists none")
    assert "rdma link add rxe0 type rxe netdev" in err


@pytest.mark.parametrize("command", ROLES)
def test_rdma_with_a_pyverbs_that_lacks_a_module_refuses_to_start(command, tmp_path):
    """pyverbs imports and lists a device, but lacks a module the transport takes (an older or
    partial build): one line at start-up, not a traceback once the front end dials."""
    err = refused_start(command, tmp_path, fake_pyverbs(tmp_path, ["rxe0"]))
    assert err.startswith("blink: --transport rdma needs a pyverbs with what Blink uses, which "
                          "this one lacks (cannot import name 'cmid' from 'pyverbs'")
    assert "pip install -e '.[rdma]'" in err


def test_rdma_transport_flags(tmp_path):
    out = blink("engine", "--transport", "rdma", "--ring-name", "x")
    assert out.returncode == 1 and "--transport rdma needs --rdma-addr IP:PORT" in out.stderr
    out = blink("frontend", "--rdma-addr", "10.0.0.1:7471")
    assert out.returncode == 1 and "--rdma-addr is an option of --transport rdma" in out.stderr
    out = blink("engine", "--transport", "rdma", "--rdma-addr", "10.0.0.1")
    assert out.returncode == 2 and "'10.0.0.1' is not IP:PORT" in out.stderr
    # librdmacm binds no device to a wildcard: a crash (the resolver reads "0" as 0.0.0.0)
    for wildcard in ("0.0.0.0:7471", "[::]:7471", "0:7471", "[::ffff:0.0.0.0]:7471"):
        out = blink("engine", "--transport", "rdma", "--rdma-addr", wildcard)
        assert out.returncode == 2 and "not a wildcard" in out.stderr, out.stderr
    # an IPv6 address without brackets: fe80::1 was the address "fe80:" at port 1
    out = blink("engine", "--transport", "rdma", "--rdma-addr", "fe80::1")
    assert out.returncode == 2 and "an IPv6 address is written [ADDRESS]:PORT" in out.stderr
    out = blink("engine", "--ring-memory", "gpu", "--ring-name", "x")
    assert out.returncode == 1 and out.stderr == (
        "blink: --ring-memory gpu needs --transport rdma (a front end on this host reaches the "
        "ring in /dev/shm, and GPU memory is not there)\n")
    out = blink("serve", "--ring-memory", "gpu", "--engine", "cpu", "--ring-name", "x")
    assert out.returncode == 1 and out.stderr == (
        "blink: --ring-memory gpu is an option of the cuda engine\n")


# -- the real RDMA path: where a device exists -----------------------------------------------

def device_ip() -> str | None:
    """$BLINK_TEST_RDMA_IP, else an IPv4 address of the first RDMA device's network interface."""
    if os.environ.get("BLINK_TEST_RDMA_IP"):
        return os.environ["BLINK_TEST_RDMA_IP"]
    for ndev in sorted(Path("/sys/class/infiniband").glob("*/ports/*/gid_attrs/ndevs/*")):
        try:
            netdev = ndev.read_text().strip()
            out = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", netdev],
                                 capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        for line in out.splitlines():
            fields = line.split()
            if "inet" in fields:
                return fields[fields.index("inet") + 1].split("/")[0]
    return None


@pytest.fixture(params=["standin", "device"])
def rdma_ip(request, monkeypatch) -> str:
    """standin: pyverbs replaced by tests/pyverbs_standin.py (this module's logic, in CI);
    device: the real pyverbs and RDMA device, where there is one."""
    if request.param == "standin":
        import pyverbs_standin
        pyverbs_standin.install(monkeypatch)
        return "127.0.0.1"
    reason = rdma_unavailable_reason()
    if reason is not None:
        pytest.skip(f"no RDMA here: --transport rdma {reason}")
    ip = device_ip()
    if ip is None:
        pytest.skip("no IPv4 address on an RDMA device's network interface (set "
                    "BLINK_TEST_RDMA_IP)")
    return ip


class RdmaRing:
    """An engine's ring (RingServer) exported over RDMA in this process, and a front end's
    EngineLink reaching it through a real queue pair. dmabuf: the ring handed to the export as
    a dma-buf file descriptor (serve_device_ring, as the CUDA engine hands its GPU-memory ring;
    here the /dev/shm segment's own descriptor, which only the stand-in can register)."""

    def __init__(self, ip: str, slots: int = 4, dmabuf: bool = False, serving: bool = True):
        from blink.ring.rdma import RingExport
        self.name = f"blink-test-rdma-{secrets.token_hex(4)}"
        self.addr = (ip, 20000 + secrets.randbelow(20000))
        geom = RingGeometry(slots, max_prompt_tokens=63, max_output_tokens=64)
        self.server = RingServer(self.name, geom, model_name="rdma", vocab_size=VOCAB,
                                 context_length=64, eos_ids=(1,))
        self.fatal: list[str] = []
        self.export = RingExport(*self.addr, self.name, on_fatal=self.fatal.append)
        if serving:  # (else the test says when)
            self.server.set_state(EngineState.SERVING)
        if dmabuf:
            self.export.serve_device_ring(os.open(shm_path(self.name), os.O_RDWR), geom)
        self.export.start()
        self.link = EngineLink(self.name, rdma_engine=self.addr, engine_timeout_s=1e9)
        self.loop = asyncio.new_event_loop()

    def attach(self, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        while self.link._transport is None:
            assert not self.fatal and time.monotonic() < deadline, self.fatal
            self.link._try_attach()
            time.sleep(0.01)
        self.server.beat()
        self.link._poll_once()
        assert self.link.alive and self.link.ring_where == f"rdma://{self.addr[0]}:{self.addr[1]}"

    def submit(self, prompt, max_tokens=4):
        return self.loop.run_until_complete(self.link.submit(dict(
            prompt=np.asarray(prompt, np.int32), max_tokens=max_tokens)))

    def admitted(self, timeout_s: float = 5):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            new, rejected = self.server.poll(LIMITS)
            assert rejected == []
            if new:
                return new
            time.sleep(0.001)
        raise AssertionError("the engine never saw the request")

    def events(self, handle) -> list:
        self.server.beat()
        self.link._poll_once()
        out = []
        while not handle.events.empty():
            out.append(handle.events.get_nowait())
        return out

    def close(self) -> None:
        try:  # (a link whose task died raises its error here: the ring still goes)
            self.loop.run_until_complete(self.link.stop())
        finally:
            self.loop.close()
            self.export.close()
            self.server.close()


@pytest.mark.parametrize("memory", ["host", "dmabuf"])
def test_ring_round_trip_over_rdma(rdma_ip, memory):
    """A request written, admitted, answered, and a cancel, over RDMA; the ring registered as
    host memory or by a dma-buf (the regions then addressed from 0, pyverbs' DmaBufMR's I/O
    virtual address being its offset)."""
    from pyverbs.mr import DmaBufMR
    if memory == "dmabuf" and DmaBufMR.__module__ != "pyverbs_standin":
        pytest.skip("a /dev/shm file is no dma-buf a real NIC registers: the GPU tests export "
                    "a real one (test_device_ring_exports_a_dmabuf_or_says_why_not)")
    ring = RdmaRing(rdma_ip, dmabuf=memory == "dmabuf")
    try:
        ring.attach()
        assert ring.link._transport._remote == (0 if memory == "dmabuf" else
                                                ring.export._mem.ctypes.data)
        assert ring.export.memory.startswith("GPU memory" if memory == "dmabuf" else
                                             "pinned host memory")
        handle = ring.submit([5, 6, 7], max_tokens=3)
        (req,) = ring.admitted()
        assert (req.slot, req.gen, req.prompt) == (handle.slot, handle.gen, [5, 6, 7])
        ring.server.open_record(req.slot, req.gen, 3)
        for i, token in enumerate([9, 10, 11]):
            ring.server.append_token(req.slot, i, token)
        ring.server.finish(req.slot, req.gen, FinishReason.LENGTH)
        events = ring.events(handle)
        assert [e.ids for e in events if isinstance(e, Tokens)] == [[9, 10, 11]]
        assert isinstance(events[-1], Finished) and events[-1].reason == FinishReason.LENGTH

        second = ring.submit([8], max_tokens=50)   # the cancel word, by RDMA WRITE
        (req,) = ring.admitted()
        ring.server.open_record(req.slot, req.gen, 1)
        ring.link.cancel(second)
        deadline = time.monotonic() + 5
        while not ring.server.cancel_requested(req.slot, req.gen):
            assert time.monotonic() < deadline, "the cancel word never landed"
            time.sleep(0.001)
        ring.server.finish(req.slot, req.gen, FinishReason.CANCELLED)
        assert ring.events(second)[-1].reason == FinishReason.CANCELLED

        with pytest.raises(ValueError, match="not in the request slots"):
            ring.link._transport.write(0, b"\0" * 8)   # the header is not the front end's
    finally:
        ring.close()
    assert not ring.fatal


def test_engine_side_gone_then_back(rdma_ip):
    """The export closes its connections (as when the engine process dies): the link's next
    poll says so at once, from the disconnect event (a READ posted to the vanished queue pair
    held the event loop until the NIC's retries ran out, about 0.27 s on real hardware, as the
    stand-in now models), and fails the stream in flight; a new export on the same address:
    the link reconnects, cancels the request it had written (the engine's ring still holds it)
    and keeps that slot until the engine has finished it."""
    from blink.ring.rdma import RingExport
    ring = RdmaRing(rdma_ip)
    try:
        ring.attach()
        handle = ring.submit([5], max_tokens=50)
        ring.export.close()
        start = time.monotonic()
        ring.link._poll_once()
        assert ring.link._transport is None and time.monotonic() - start < 0.1
        assert isinstance(handle.events.get_nowait(), EngineUnavailable)
        ring.export = RingExport(*ring.addr, ring.name, on_fatal=ring.fatal.append)
        ring.export.start()
        ring.attach()
        ring.submit([6])
        seen = []
        while len(seen) < 2:
            seen += ring.admitted()
        old, new = sorted(seen, key=lambda r: list(r.prompt))
        assert (list(old.prompt), list(new.prompt)) == ([5], [6]) and new.slot != old.slot
        deadline = time.monotonic() + 5
        while not ring.server.cancel_requested(old.slot, old.gen):
            assert time.monotonic() < deadline, "the cancel word never landed"
            time.sleep(0.001)
        assert old.slot not in ring.link._free
        ring.server.open_record(old.slot, old.gen, 1)
        ring.server.finish(old.slot, old.gen, FinishReason.CANCELLED)
        ring.server.beat()
        ring.link._poll_once()
        assert old.slot in ring.link._free
    finally:
        ring.close()


def test_an_engine_gone_between_the_handshake_and_the_header_is_tried_again(rdma_ip):
    """The engine's side vanishes right after the dialer connects (an engine stopping while its
    export still listens, a link flap): the header's READ fails. That error escaped the attach
    and ended the link's task, and the front end never attached again. It is a failed try
    now, and the next one attaches once the engine is back."""
    if rdma_ip != "127.0.0.1":
        pytest.skip("the fault is injected into the stand-in's queue pairs")
    from blink.ring.rdma import RdmaDialer
    ring = RdmaRing(rdma_ip)
    real_step, vanished = RdmaDialer.step, []

    def step(dialer):  # the engine's queue pairs gone as the first connection is made
        transport = real_step(dialer)
        if transport is not None and not vanished:
            deadline = time.monotonic() + 10  # (the export's thread files it after accepting)
            while not ring.export.connections and time.monotonic() < deadline:
                time.sleep(0.001)
            vanished.extend(ring.export.connections.values())
            assert vanished
            for connection in vanished:
                connection.own_qp.closed = True
        return transport

    async def run():
        ring.link.attach_interval_s = 0.01  # (a loaded CI machine: each try is a few steps)
        await ring.link.start()
        deadline = time.monotonic() + 60
        while not (vanished and ring.link.alive):
            assert time.monotonic() < deadline and not ring.link._task.done(), \
                ring.link._task.exception() if ring.link._task.done() else "never attached"
            ring.server.beat()
            await asyncio.sleep(0.02)

    try:
        RdmaDialer.step = step
        ring.loop.run_until_complete(run())
    finally:
        RdmaDialer.step = real_step
        ring.close()


def test_a_cancel_after_the_engine_vanished_raises_nothing(rdma_ip):
    """The engine's connections close before the link's next poll has seen it; then a client
    goes away (the handler's cancel), a stop string matches (cancel and counts_so_far), or a
    drain gives up every live stream: each raised RdmaPeerGone into the gRPC handler (a
    traceback and UNKNOWN, or a drain that stopped at the first stream). Now the failed write
    waits for the poll, which detaches, and every stream gets its end."""
    ring = RdmaRing(rdma_ip)
    try:
        ring.attach()
        handles = [ring.submit([5 + i], max_tokens=50) for i in range(4)]
        ring.admitted()
        ring.export.close()  # the engine process is gone
        ring.link.cancel(handles[0])
        ring.link.cancel(handles[1], stop_matched=True)
        assert ring.link.counts_so_far(handles[1]) == (0, 0)
        ring.link.give_up_live(EngineUnavailable("server shutting down"))
        assert all(not h.events.empty() for h in handles[2:])
        ring.link._poll_once()
        assert ring.link._transport is None and not ring.link.alive
        assert ring.link._stop_cancels_pending.total() == 0
    finally:
        ring.close()


def test_a_doorbell_that_lands_after_its_write_failed_spends_its_generation(rdma_ip):
    """A doorbell WRITE whose completion failed (the NIC's retries ran out) may still land,
    after the front end has re-attached and read the slot's last generation: the next request
    in that slot took the same generation, the engine ran the first, and the second read the
    first's record, another client's tokens. Back on the same engine, the link's own count of
    a slot's generations now stands over what it reads."""
    ring = RdmaRing(rdma_ip, slots=1)
    try:
        ring.attach()
        link, transport = ring.link, ring.link._transport
        real_write, late = transport.write, []

        def doorbell_lost_in_the_fabric(offset, data):
            if offset == link.info.geometry.slot_offset(0):  # the doorbell: on the wire
                late.append((offset, bytes(data)))
                transport._fail("an RDMA operation failed: IBV_WC_RETRY_EXC_ERR")
            real_write(offset, data)

        transport.write = doorbell_lost_in_the_fabric
        with pytest.raises(EngineUnavailable):
            ring.submit([11, 12, 13], max_tokens=4)  # request A: its client is told
        ring.attach()
        offset, data = late[0]  # A's doorbell lands now
        ring.server.segment.array()[offset:offset + 4] = np.frombuffer(data, np.uint8)
        (a,) = ring.admitted()  # the engine runs A
        b = ring.submit([77], max_tokens=4)  # request B, the same slot
        assert b.gen != a.gen
        (admitted,) = ring.admitted()  # B replaces A in the engine (A's client has gone)
        assert (admitted.gen, list(admitted.prompt)) == (b.gen, [77])
        for r in (a, admitted):  # each answers its prompt + 100; A's record first, then B's
            ring.server.open_record(r.slot, r.gen, len(r.prompt))
            for i, token in enumerate(r.prompt):
                ring.server.append_token(r.slot, i, int(token) + 100)
            ring.server.finish(r.slot, r.gen, FinishReason.LENGTH)
        tokens = [t for e in ring.events(b) if isinstance(e, Tokens) for t in e.ids]
        assert tokens == [177]
    finally:
        ring.close()


def test_one_front_end_per_engine_over_rdma(rdma_ip):
    """Two workers of one front end (one group) share the engine; a connection of another
    front end's group closes theirs, and their next poll says so (the second front end took
    the engine: no two front ends write into the same slots and read each other's tokens, as
    two DPUs dialing one engine did). A front end that does not say its group (0) is kept."""
    ring = RdmaRing(rdma_ip, slots=4)
    links = [EngineLink(ring.name, rdma_engine=ring.addr, engine_timeout_s=1e9, worker=w,
                        rdma_group=group)
             for w, group in (((0, 2), 11), ((1, 2), 11), ((0, 1), 22))]

    def attach(link):
        deadline = time.monotonic() + 20
        while link._transport is None:
            assert time.monotonic() < deadline
            link._try_attach()
            time.sleep(0.01)
        ring.server.beat()
        link._poll_once()
        return link.alive

    def export_holds(groups):  # (the export's thread files a connection after accepting it)
        deadline = time.monotonic() + 10
        while sorted(ring.export.groups.values()) != groups:
            assert time.monotonic() < deadline, ring.export.groups
            time.sleep(0.001)
        return True

    try:
        assert attach(links[0]) and attach(links[1]) and attach(ring.link)  # (group 0)
        assert export_holds([0, 11, 11])
        assert attach(links[2])
        assert export_holds([0, 22])
        for link in links[:2]:
            ring.server.beat()
            link._poll_once()
            assert link._transport is None and not link.alive
        ring.server.beat()
        ring.link._poll_once()
        assert ring.link.alive
    finally:
        for link in links:
            ring.loop.run_until_complete(link.stop())
        ring.close()
        WorkerCounts.reset(ring.name)  # (the two workers' shared counts, in /dev/shm)


def test_many_slots_in_bounded_batches(rdma_ip):
    """More slots than work requests in flight: each strided read is several chained batches
    (the stand-in refuses a chain longer than the send queue, or a completion queue overrun)."""
    from blink.ring.rdma import MAX_OUTSTANDING
    ring = RdmaRing(rdma_ip, slots=2 * MAX_OUTSTANDING + 3)
    try:
        ring.attach()
        handles = [ring.submit([i + 2], max_tokens=1) for i in range(2 * MAX_OUTSTANDING + 3)]
        new = []
        while len(new) < len(handles):
            new += ring.admitted()
        for r in new:
            ring.server.open_record(r.slot, r.gen, 1)
            ring.server.append_token(r.slot, 0, r.prompt[0] + 100)
            ring.server.finish(r.slot, r.gen, FinishReason.LENGTH)
        ring.server.beat()
        ring.link._poll_once()
        for h in handles:
            events = [h.events.get_nowait() for _ in range(h.events.qsize())]
            assert events[0].ids == [h.slot + 102] and events[-1].reason == FinishReason.LENGTH
    finally:
        ring.close()


def test_front_end_reconnect_replaces_its_connection(rdma_ip):
    """The front end drops its connection (as on a queue pair error) and dials again: the
    engine closes the earlier one (the same token), so it keeps one per front end."""
    ring = RdmaRing(rdma_ip)

    def connections(n: int) -> list:  # (the export's thread files a connection after accepting)
        deadline = time.monotonic() + 5
        while len(ring.export.connections) != n:
            assert time.monotonic() < deadline, ring.export.connections
            time.sleep(0.01)
        return list(ring.export.connections.values())
    try:
        ring.attach()
        (first,) = connections(1)
        ring.link._detach(EngineUnavailable("dropped by the test"))
        ring.attach()
        deadline = time.monotonic() + 5
        while connections(1) == [first]:
            assert time.monotonic() < deadline, "the new connection was never filed"
            time.sleep(0.01)
        if rdma_ip == "127.0.0.1":  # (the stand-in's ids say whether they were closed)
            assert first.closed
        ring.submit([7])
        assert [r.prompt for r in ring.admitted()] == [[7]]
    finally:
        ring.close()


def test_refusals_are_said(monkeypatch):
    """Against the stand-in: nothing listening (each failed try closes what it opened: a front
    end dials again and again while its engine is away), an address without an RDMA device
    (nothing left open either), a read past the ring, a write the engine's memory regions do
    not allow (the front end's own check bypassed: then every operation says the connection is
    gone, a strided read already made too), a Hello of another layout version."""
    import pyverbs_standin
    pyverbs_standin.install(monkeypatch)
    from blink.ring import rdma
    dialer = rdma.RdmaDialer("127.0.0.1", 7471)
    fds = None
    for _ in range(3):
        with pytest.raises(rdma.RdmaError, match=r"nothing accepts RDMA connections at "
                                                 r"127.0.0.1:7471 \(is the engine up"):
            while dialer.step() is None:
                pass
        fds = fds or len(os.listdir("/proc/self/fd"))
    with pytest.raises(rdma.RdmaUnavailable, match="cannot take RDMA CM address 203.0.113.9"):
        rdma.RingExport("203.0.113.9", 7471, "x", on_fatal=print)
    assert len(os.listdir("/proc/self/fd")) == fds
    ring = RdmaRing("127.0.0.1")
    try:
        ring.attach()
        t, cmid = ring.link._transport, ring.link._transport.cmid
        with pytest.raises(ValueError, match=rf"ring bytes \[{t.size - 4}, {t.size + 1}\) are "
                                             rf"past its {t.size} bytes"):
            t.read(t.size - 4, 5)
        strided = t.read_strided(0, 8, 2, 4)
        with pytest.raises(rdma.RdmaPeerGone, match="IBV_WC_REM_ACCESS_ERR"):
            t._run([t._wr(t.v.WR_WRITE, 0, 8)])
        assert not t.is_current()
        with pytest.raises(rdma.RdmaPeerGone, match="IBV_WC_REM_ACCESS_ERR"):
            t.read_strided(0, 8, 2, 4)
        assert len(strided) == 8
    finally:
        ring.close()
    assert cmid.closed  # (its destruction disconnects: the engine hears of it)
    hello = np.zeros((), rdma.HELLO_DTYPE)
    hello["magic"], hello["layout_version"], hello["token"] = rdma.RING_MAGIC, 1, 5
    assert rdma._read_hello(hello.tobytes()) == (
        0, 0, f"ring layout version {rdma.LAYOUT_VERSION} here, 1 in the front end")
    hello["layout_version"], hello["group"] = rdma.LAYOUT_VERSION, 9
    assert rdma._read_hello(hello.tobytes().ljust(56, b"\0")) == (5, 9, None)


def test_a_refusal_that_fails_leaves_the_export_serving(monkeypatch):
    """Refusing a front end's connection (here every hello refused) with a reject that
    itself fails: the error ended the export's thread, whose end stops the engine (on_fatal).
    Now it is that connection's alone, and the next front end attaches."""
    import pyverbs_standin
    pyverbs_standin.install(monkeypatch)
    from blink.ring import rdma
    ring = RdmaRing("127.0.0.1")
    try:
        ring.attach()  # the export listens
        refused = []
        with monkeypatch.context() as m:
            def refuse(data):
                refused.append(data)
                return 0, 0, "refused by the test"

            def failing_reject(self, private_data=None):
                raise pyverbs_standin.PyverbsError("reject failed")
            m.setattr(rdma, "_read_hello", refuse)
            m.setattr(pyverbs_standin.CMID, "reject", failing_reject)
            dialer = rdma.RdmaDialer(*ring.addr, timeout_s=0.5)
            with pytest.raises(rdma.RdmaError, match="within 0.5 s"):  # never answered
                while dialer.step() is None:
                    pass
        assert refused and ring.fatal == []
        ring.link._detach(RuntimeError("again"))
        ring.attach()
    finally:
        ring.close()


def test_a_connection_that_cannot_be_accepted_leaves_the_export_serving(monkeypatch):
    """A front end's connection the export cannot accept, and whose close then fails too: that
    close's error ended the export's thread, whose end stops the engine (on_fatal). Now it is
    that connection's alone, and the next front end attaches."""
    import pyverbs_standin
    pyverbs_standin.install(monkeypatch)
    from blink.ring import rdma
    ring = RdmaRing("127.0.0.1")
    try:
        ring.attach()  # the export listens
        with monkeypatch.context() as m:
            def fail(self, *args):
                raise pyverbs_standin.PyverbsError("failed by the test")
            m.setattr(pyverbs_standin.CMID, "accept", fail)
            m.setattr(pyverbs_standin.CMID, "close", fail)
            dialer = rdma.RdmaDialer(*ring.addr, timeout_s=0.5)
            started = time.monotonic()
            with pytest.raises(rdma.RdmaError, match="within 0.5 s"):  # never answered
                while dialer.step() is None:
                    pass
            assert time.monotonic() - started < 5
        assert ring.fatal == []
        ring.link._detach(RuntimeError("again"))
        ring.attach()
    finally:
        ring.close()


def test_a_removed_device_stops_the_export(monkeypatch):
    """RDMA_CM_EVENT_DEVICE_REMOVAL on the export's channel: no front end can reach the ring
    any more, and the export stops the engine saying so (on_fatal; it served on, unreachable)."""
    import pyverbs_standin
    pyverbs_standin.install(monkeypatch)
    ring = RdmaRing("127.0.0.1")
    try:
        ring.attach()
        ring.export.events.channel.post(pyverbs_standin.E.RDMA_CM_EVENT_DEVICE_REMOVAL)
        deadline = time.monotonic() + 10
        while not ring.fatal:
            assert time.monotonic() < deadline, "the export served on"
            time.sleep(0.01)
    finally:
        ring.close()
    assert ring.fatal == [f"the RDMA ring export on 127.0.0.1:{ring.addr[1]} failed: the RDMA "
                          f"device was removed"]


def test_the_export_listens_once_this_engine_serves_its_ring(monkeypatch):
    """Until this process's engine serves its ring nothing accepts a front end's connection;
    then it does. A ring of another engine (a dead one's, its pid not ours) is not exported,
    and each look at it closes it again (the export looks every 50 ms while it waits)."""
    import pyverbs_standin
    pyverbs_standin.install(monkeypatch)
    from blink.ring import rdma
    ring = RdmaRing("127.0.0.1", serving=False)
    try:
        dialer = rdma.RdmaDialer(*ring.addr)
        with pytest.raises(rdma.RdmaError, match="nothing accepts RDMA connections"):
            while dialer.step() is None:
                pass
        ring.server.header["engine_pid"] = os.getpid() + 1  # (no pid of this process's)
        fds = len(os.listdir("/proc/self/fd"))
        assert [ring.export._own_ring() for _ in range(10)] == [None] * 10
        # ten looks that each left the ring open would leave ten descriptors; the export's own
        # look (its thread's, every 50 ms) may hold one at either count
        assert len(os.listdir("/proc/self/fd")) <= fds + 1
        ring.server.header["engine_pid"] = os.getpid()
        ring.server.set_state(EngineState.SERVING)
        ring.attach()
    finally:
        ring.close()
    assert not ring.fatal


@pytest.mark.parametrize("field", ["layout_version", "num_slots"])
def test_a_ring_the_export_cannot_serve_stops_it_with_the_reason(monkeypatch, field):
    """A ring whose header says another layout version, or more slots than its file holds: the
    export does not register it and says why (on_fatal, which stops the engine)."""
    import pyverbs_standin
    pyverbs_standin.install(monkeypatch)
    from blink.ring.layout import LAYOUT_VERSION
    ring = RdmaRing("127.0.0.1", slots=4, serving=False)
    try:
        ring.server.header[field] = LAYOUT_VERSION + 1 if field == "layout_version" else 400
        ring.server.set_state(EngineState.SERVING)
        deadline = time.monotonic() + 10
        while not ring.fatal:
            assert time.monotonic() < deadline, "the export took the ring"
            time.sleep(0.01)
        assert ring.export._regions == []
    finally:
        ring.close()
    where = f"the RDMA ring export on 127.0.0.1:{ring.addr[1]} failed: "
    assert ring.fatal == [where + (
        f"the ring's layout version is {LAYOUT_VERSION + 1}, this code's {LAYOUT_VERSION}"
        if field == "layout_version" else "the ring segment is shorter than its header says")]


def test_the_export_lets_go_of_what_it_holds(monkeypatch):
    """The dma-buf descriptor the engine hands over is closed once registered (the regions keep
    the memory); closed, the export has closed its front ends' connections and the ring
    segment it mapped; one closed before it registered its dma-buf (the engine stopped first)
    has closed that descriptor. Each was left open."""
    import pyverbs_standin
    pyverbs_standin.install(monkeypatch)
    from blink.ring.rdma import RingExport

    def is_open(fd: int, path: Path) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}") == str(path)
        except FileNotFoundError:
            return False
    ring = RdmaRing("127.0.0.1", serving=False)
    try:
        deadline = time.monotonic() + 10
        while ring.export.segment is None:  # (it maps the ring, STARTING, and waits)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        dmabuf = os.open(shm_path(ring.name), os.O_RDWR)
        ring.export.serve_device_ring(dmabuf, ring.server.geom)
        ring.server.set_state(EngineState.SERVING)
        ring.attach()
        assert ring.link._transport._remote == 0  # (the dma-buf registered)
        assert not is_open(dmabuf, shm_path(ring.name))
        segment, (connection,) = ring.export.segment, ring.export.connections.values()
    finally:
        ring.close()
    assert segment.mmap.closed and connection.closed and ring.export.connections == {}
    export = RingExport("127.0.0.1", ring.addr[1], "never-served", on_fatal=print)
    never = os.open("/dev/null", os.O_RDWR)
    export.serve_device_ring(never, ring.server.geom)
    export.close()
    assert not is_open(never, Path("/dev/null"))


@pytest.mark.slow
def test_engine_and_frontend_processes_over_rdma(checkpoints, make_stack):
    """`blink engine` and `blink frontend` with --transport rdma, as on a host and its DPU: the
    engine process exports its ring, the front end reaches it through the device, greedy tokens
    come back."""
    from blink.client.sdk import BlinkClient, Sampling
    reason, ip = rdma_unavailable_reason(), device_ip()
    if reason is not None or ip is None:
        pytest.skip(f"no RDMA here: --transport rdma {reason}" if reason else
                    "no IPv4 address on an RDMA device's network interface")
    rdma = ["--transport", "rdma", "--rdma-addr", f"{ip}:{20000 + secrets.randbelow(20000)}"]
    stack = make_stack(checkpoints["llama"], engine_args=["--engine", "cpu", *rdma],
                       frontend_args=rdma)
    with BlinkClient(stack.target) as client:
        done = client.generate("Hello", Sampling(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert (done.finish_reason, done.completion_tokens) == ("length", 8)
    assert "attached to engine ring rdma://" in stack.logs()
