"""The floor of a first token's trip through gRPC and the client: a bare grpc.aio server of
Blink's Generate that answers each request, after a set wait, with one token and a final, and
does nothing else (no checks, no ring, no detokenizer). Sent the same requests by the same
client code, its client TTFT minus its own (from its receipt of a request to its send of the
token, reported in the final's timings as Blink's front end reports its own) is what gRPC and
the client cost both ways; against Blink's the same difference, it tells the front end's share
from the transport's.

The wait matters: after a few idle milliseconds the two sides' gRPC threads take longer to wake
and hand messages on (on a 2-core VM, a bare call's two legs 0.7 ms with no wait, 1.3-1.6 ms
after a wait of 6.6 ms: docs/performance.md, round 32), so the benchmark waits as long as the
engine took (bench_serving's shared-prefix workload: the warm requests' own median).

    python -m blink.client.bench_grpc_floor --wait-ms 7.5 --ready-file PATH   (a server)
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from blink.v1 import blink_pb2 as pb
from blink.v1 import blink_pb2_grpc as pb_grpc


class FloorServicer(pb_grpc.BlinkServicer):
    """Generate: the wait, then the prompt's first token id back and a final; nothing else."""

    def __init__(self, wait_s: float):
        self.wait_s = wait_s

    async def Generate(self, request, context):
        received = time.monotonic()
        await asyncio.sleep(self.wait_s)
        ids = request.token_ids.ids
        chunk = pb.GenerateResponse()
        chunk.chunk.text = "x"
        chunk.chunk.token_ids.append(ids[0] if ids else 0)
        sent = time.monotonic()
        yield chunk
        yield pb.GenerateResponse(final=pb.Final(
            finish_reason=pb.FINISH_REASON_LENGTH,
            usage=pb.Usage(prompt_tokens=len(ids), completion_tokens=1),
            timings=pb.Timings(time_to_first_token_s=sent - received,
                               total_s=time.monotonic() - received)))


async def serve(wait_s: float, ready_file: Path, host: str = "127.0.0.1") -> None:
    """Serves until SIGTERM; writes the port it took into ready_file."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    pb_grpc.add_BlinkServicer_to_server(FloorServicer(wait_s), server)
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    ready_file.write_text(str(port))
    await server.wait_for_termination()


@contextlib.contextmanager
def floor_server(wait_s: float) -> Iterator[str]:
    """A floor server in a process of its own (as the front end is: the client's GIL and
    threads apart from the server's) for the with-block; yields its target."""
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "port"
        proc = subprocess.Popen([sys.executable, "-m", "blink.client.bench_grpc_floor",
                                 "--wait-ms", str(wait_s * 1e3), "--ready-file", str(ready)],
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            deadline = time.monotonic() + 60
            while not (ready.exists() and ready.read_text()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the gRPC floor server did not start (exit {proc.poll()})")
                time.sleep(0.05)
            yield f"127.0.0.1:{int(ready.read_text())}"
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wait-ms", type=float, required=True,
                        help="how long each request waits before its token")
    parser.add_argument("--ready-file", type=Path, required=True,
                        help="the port is written here once the server listens")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.wait_ms / 1e3, args.ready_file))


if __name__ == "__main__":
    main()
