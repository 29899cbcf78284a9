"""The `blink` command line: serve, engine, frontend, generate, info, stats."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path

DEMO_NOTE = ("serving the built-in demo model: random weights, so its text is meaningless. "
             "Serve a real checkpoint with `blink serve --model DIR` (a Hugging Face folder with "
             "config.json, *.safetensors and tokenizer.json; Llama, Qwen2 or Qwen3).")


def _model_dir(arg: str | None, *, need_weights: bool = True) -> Path:
    """The checkpoint folder, checked before anything starts: config.json with a supported
    architecture, tokenizer.json, and weights (unless need_weights is False: --load-format
    dummy). Any problem ends the command with one line."""
    if not arg:
        from blink.gpu_engine.demo_model import ensure_demo_model
        print(f"blink: {DEMO_NOTE}", file=sys.stderr)
        return ensure_demo_model()
    from blink.gpu_engine.checkpoint import CheckpointError, check_weights, load_config
    path = Path(arg).expanduser()
    if not (path / "config.json").is_file():
        sys.exit(f"blink: {path} is not a Hugging Face checkpoint folder (no config.json)")
    try:
        cfg = load_config(path)
    except CheckpointError as e:
        sys.exit(f"blink: {path}: {e}")
    if not (path / "tokenizer.json").is_file():
        sys.exit(f"blink: {path} has no tokenizer.json (the front end tokenizes with it)")
    if need_weights and not any(path.glob("*.safetensors")):
        sys.exit(f"blink: {path} has no *.safetensors weights (--load-format dummy serves "
                 f"random weights in its shapes)")
    if need_weights:
        try:  # the weight files' headers: names, shapes and dtypes, before anything starts
            check_weights(path, cfg)
        except CheckpointError as e:
            sys.exit(f"blink: {path}: {e}")
    return path


def _check_engine_args(args) -> None:
    """Flag values the engine would refuse, refused before anything starts."""
    for name in ("slots", "block_size", "max_num_seqs", "max_batched_tokens"):
        if getattr(args, name) < 1:
            sys.exit(f"blink: --{name.replace('_', '-')} must be >= 1")
    if args.num_kv_blocks is not None and args.num_kv_blocks < 1:
        sys.exit("blink: --num-kv-blocks must be >= 1")
    if args.kv_cache_mb < 1:
        sys.exit("blink: --kv-cache-mb must be >= 1")
    if args.sm_count_target is not None and args.sm_count_target < 0:
        sys.exit("blink: --sm-count-target must be >= 0 (0: every SM)")
    if args.slots < args.max_num_seqs:
        print(f"blink: warning: --slots {args.slots} is below --max-num-seqs "
              f"{args.max_num_seqs}: a request holds its slot while it runs, so at most "
              f"{args.slots} sequences run at once", file=sys.stderr)
    if args.max_model_len is not None and args.max_model_len < 2:
        sys.exit("blink: --max-model-len must be >= 2")
    if not 0 < args.gpu_memory_utilization <= 1:
        sys.exit("blink: --gpu-memory-utilization must be in (0, 1]")
    if args.hf_static_cache and args.engine != "hf":
        sys.exit("blink: --hf-static-cache is an option of --engine hf")
    fp8 = [flag for flag, on in (("--quantization fp8", args.quantization == "fp8"),
                                 ("--kv-cache-dtype fp8", args.kv_cache_dtype == "fp8")) if on]
    if fp8 and args.engine in ("hf", "synthetic"):
        sys.exit(f"blink: {' and '.join(fp8)}: an option of the cuda, host-cuda and cpu "
                 f"engines, not {args.engine}")
    if args.step_log is not None and args.engine not in ("cuda", "auto"):
        sys.exit("blink: --step-log is an option of the cuda engine")
    if args.ring_memory == "gpu":
        if args.engine not in ("cuda", "auto"):
            sys.exit("blink: --ring-memory gpu is an option of the cuda engine")
        if args.transport != "rdma":
            sys.exit("blink: --ring-memory gpu needs --transport rdma (a front end on this host "
                     "reaches the ring in /dev/shm, and GPU memory is not there)")
    folder = args.step_log.resolve().parent if args.step_log is not None else None
    if folder is not None and not (folder.is_dir() and os.access(folder, os.W_OK)):
        sys.exit(f"blink: --step-log {args.step_log}: its folder does not exist or cannot be "
                 f"written")


def _rdma_addr(text: str) -> tuple[str, int]:
    """IP:PORT, [IPv6]:PORT or NAME:PORT -> (the numeric address, the port). A name is resolved
    here, once (rdma_getaddrinfo would resolve it on the front end's event loop at every try).
    An IPv6 address needs its brackets: fe80::1 was read as the address "fe80:" and port 1."""
    import ipaddress
    import socket
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
    elif text.count(":") > 1:
        raise argparse.ArgumentTypeError(f"{text!r}: an IPv6 address is written [ADDRESS]:PORT")
    else:
        host, sep, port = text.rpartition(":")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise argparse.ArgumentTypeError(f"{text!r} is not IP:PORT")
    try:
        address = ipaddress.ip_address(host.split("%")[0])  # (a link-local address's %scope)
    except ValueError:  # a name (or "0", which the resolver reads as 0.0.0.0)
        try:
            host = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0]
        except (OSError, UnicodeError) as e:
            raise argparse.ArgumentTypeError(f"{text!r}: cannot resolve {host!r}: {e}") \
                from None
        address = ipaddress.ip_address(host.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    if address.is_unspecified or (mapped is not None and mapped.is_unspecified):
        # librdmacm binds no device to it, and pyverbs then crashes the process
        raise argparse.ArgumentTypeError(f"{text!r}: the IP must be an RDMA device's interface "
                                         f"address, not a wildcard")
    return host, int(port)


def _add_transport_args(p: argparse.ArgumentParser, addr_help: str) -> None:
    p.add_argument("--transport", choices=["shm", "rdma"], default="shm",
                   help="how the front end reaches the engine's ring: shm, shared memory on "
                        "one host; rdma, RDMA WRITE/READ from another machine (a DPU's Arm "
                        "cores) through pyverbs, see deploy/README.md")
    p.add_argument("--rdma-addr", type=_rdma_addr, default=None, metavar="IP:PORT",
                   help=addr_help)


def _name_frontend(args) -> None:
    """The group that names this front end and its workers (args go to them) to an RDMA
    engine, which keeps one front end's connections (RingExport)."""
    import secrets
    if args.frontend_group is None:
        args.frontend_group = secrets.randbits(63) | 1


def _check_transport(args) -> None:
    """--transport rdma: its address, pyverbs and an RDMA device, checked before anything
    starts (no ring, no port, no engine process); any lack ends the command with one line."""
    if args.transport != "rdma":
        if args.rdma_addr is not None:
            sys.exit("blink: --rdma-addr is an option of --transport rdma")
        return
    if args.rdma_addr is None:
        sys.exit("blink: --transport rdma needs --rdma-addr IP:PORT (the engine's RDMA CM "
                 "address: an IP address of its RDMA device's network interface)")
    from blink.ring.rdma import rdma_unavailable_reason
    reason = rdma_unavailable_reason()
    if reason is not None:
        sys.exit(f"blink: --transport rdma {reason}")


def _ring_export(args):
    """--transport rdma: the engine's RDMA CM listener, bound now (a wrong or taken address
    fails before the engine loads anything); it serves the ring once this engine does."""
    if args.transport != "rdma":
        return None
    from blink.ring.rdma import RdmaUnavailable, RingExport

    def stop_engine(reason: str) -> None:  # front ends cannot reach a ring it does not export
        logging.getLogger("blink.engine").error("%s: stopping the engine", reason)
        os.kill(os.getpid(), signal.SIGTERM)

    try:
        export = RingExport(*args.rdma_addr, args.ring_name, on_fatal=stop_engine)
    except RdmaUnavailable as e:
        sys.exit(f"blink engine: {e}")
    export.start()
    return export


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=["auto", "cuda", "cpu", "host-cuda", "hf", "synthetic"],
                   default="auto",
                   help="cuda: the CPU-free GPU engine; cpu: the NumPy reference engine; "
                        "auto: cuda when a GPU is usable, else cpu. The benchmark's peers: "
                        "host-cuda, the CUDA engine's graphs driven by a host loop; hf, "
                        "Hugging Face transformers' generate (needs torch and transformers); "
                        "synthetic: no model, tokens every --synthetic-step-ms (measures the "
                        "front end alone)")
    p.add_argument("--synthetic-step-ms", type=_step_ms, default=0.0,
                   help="synthetic engine: milliseconds per step")
    p.add_argument("--hf-static-cache", action="store_true",
                   help="hf engine: one request at a time through a static KV cache sized for "
                        "the context, the decoding step compiled by transformers on a GPU "
                        "(its fast path for batch-1 latency; the compile runs at start-up)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory for weights, activations and KV cache (cuda)")
    p.add_argument("--slots", type=int, default=128, help="request slots in the ring")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-cache-mb", type=int, default=256, help="KV cache size in MiB")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks (overrides --kv-cache-mb)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step at most")
    p.add_argument("--max-batched-tokens", type=int, default=512, help="token budget per step")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's)")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights generated on the GPU in the checkpoint's shapes, "
                        "for benchmarks (cuda engine only; the folder needs no weight files)")
    p.add_argument("--no-gemm-tuning", dest="gemm_tuning", action="store_false",
                   help="cuda and host-cuda engines: run every cuBLAS GEMM with cuBLAS's own "
                        "choice of kernel. By default a shape where one of cuBLASLt's "
                        "candidates, timed at start-up, is at least 3%% faster runs that one "
                        "(choices cached in $BLINK_CACHE_DIR/gemm, default ~/.cache/blink/gemm)")
    p.add_argument("--gemm-split-k", action="store_true",
                   help="cuda and host-cuda engines: the GEMM tuner also times split-K "
                        "variants of cuBLASLt's first candidates for GEMMs of up to 256 rows "
                        "(prefill chunks of few tokens); off by default: on the H200 no "
                        "step gained (docs/performance.md, round 34)")
    p.add_argument("--fine-buckets-from", type=_fine_buckets_from, default=128, metavar="N",
                   help="cuda and host-cuda engines: the forward graphs' token buckets are "
                        "powers of two up to N, then four an octave (default 128: 128, 160, "
                        "192, ...); 64 adds graphs of 80, 96 and 112 tokens, so a 100-token "
                        "prefill chunk (a warm prefix-cache request) runs as 112 rows, not 128")
    p.add_argument("--sm-count-target", type=int, default=None,
                   help="cuda and host-cuda engines: the SMs the forward pass's kernels are "
                        "sized for (cuBLAS's SM count target, the attention grids); default: "
                        "the GPU's, less the one the cuda engine's scheduler kernel holds; 0: "
                        "all of them")
    p.add_argument("--no-decode-weight-copy", dest="decode_weight_copy", action="store_false",
                   help="cuda and host-cuda engines: the decode-sized steps' projections read "
                        "the row-major weights cuBLAS reads, and cuBLAS runs the LM head. By "
                        "default they read a copy of the projections and the LM head in a "
                        "tiled layout that streams faster (8B shape at batch 1: ~10%% a step) "
                        "and run the LM head of steps with up to 16 logit rows, "
                        "which takes those weights' memory a second time (~15 GB for 8B)")
    p.add_argument("--quantization", choices=["fp8", "none"], default=None,
                   help="fp8: the projections' weights as E4M3 with a scale per output row, "
                        "quantized at load from bf16/f16/f32 checkpoints (an FP8 checkpoint, "
                        "quantization_config quant_method fp8, compressed-tensors, "
                        "fbgemm_fp8 or modelopt, is served so without the flag); "
                        "decode-sized steps dequantize them in registers, larger ones run FP8 "
                        "GEMMs on activations quantized per token (cuda and host-cuda engines: "
                        "Hopper GPUs; the cpu engine emulates the rounding). none: an FP8 "
                        "checkpoint's values in bf16 (the default for one on a GPU without "
                        "FP8 GEMMs)")
    p.add_argument("--fp8-lm-head", action=argparse.BooleanOptionalAction, default=None,
                   help="with FP8 weights, the LM head as E4M3 with a scale per vocabulary row "
                        "too, which halves its reads (8B shape: 1 GB a decode step) and adds "
                        "its rounding to the logits; --no-fp8-lm-head: bf16. By default as the "
                        "weights come: FP8 where --quantization fp8 converts them, as an FP8 "
                        "checkpoint stores it (most keep it bf16)")
    p.add_argument("--no-fp8-fast-accum", dest="fp8_fast_accum", action="store_false",
                   help="with FP8 weights, have cuBLASLt's FP8 GEMMs (prefill-sized steps, "
                        "batches past 16 rows) promote their sums to fp32 as they go: by "
                        "default they accumulate in the tensor cores' own precision, as "
                        "vLLM's and TensorRT-LLM's do (faster; the README's FP8 section has "
                        "both ways' speed and accuracy)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="fp8: keys and values as E4M3 with a scale per layer and KV head (the "
                        "checkpoint's k_scale / v_scale, or calibrated at start-up): the cache "
                        "holds twice the tokens and attention reads half the bytes (cuda and "
                        "host-cuda engines: head_dim 64 or 128; the cpu engine emulates it)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="compute every prompt whole: by default full KV blocks are kept after "
                        "their requests finish (until memory is needed, least recently used "
                        "first) and a prompt that starts with the same tokens reuses them")
    p.add_argument("--ring-memory", choices=["host", "gpu"], default="host",
                   help="cuda engine: where the ring lives. host: page-locked host memory the "
                        "GPU maps, reached in /dev/shm or by RDMA; gpu (with --transport rdma): "
                        "GPU memory, which the NIC registers as dma-buf, so front ends' RDMA "
                        "WRITEs and READs go to the GPU and the scheduler kernel polls its own "
                        "memory, not across PCIe (needs NVIDIA's open kernel modules and a NIC "
                        "driver that imports dma-buf)")
    p.add_argument("--step-log", type=Path, default=None, metavar="PATH",
                   help="cuda engine: time every step's phases on the GPU and write the last "
                        "262,144 steps to PATH (.npy) when the engine stops; "
                        "python -m blink.gpu_engine.step_log PATH summarizes them")


def _port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535: argparse refuses anything else in one line."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0 to 65535)")
    return port


def _whole(text: str, least: int, what: str) -> int:
    """An int of at least `least`: argparse refuses anything else in one line."""
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def _fine_buckets_from(text: str) -> int:
    """The token count from which the forward graphs' buckets go four an octave: at least 4
    (engine_layout.default_buckets)."""
    return _whole(text, 4, "a token count of at least 4")


def _ring_name(text: str) -> str:
    """A name the ring's file in /dev/shm and its claim can take (lifecycle.check_ring_name)."""
    from blink.ring.lifecycle import check_ring_name
    try:
        return check_ring_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _seconds(text: str) -> float:
    """A duration, a finite number of seconds >= 0."""
    return _finite(text, "a number of seconds >= 0", positive=False)


def _positive_seconds(text: str) -> float:
    """A duration, a finite number of seconds > 0."""
    return _finite(text, "a number of seconds > 0", positive=True)


def _megabytes(text: str) -> float:
    """A size in MiB, finite and > 0."""
    return _finite(text, "a size in MB > 0", positive=True)


def _finite(text: str, what: str, positive: bool, most: float = math.inf) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (0 < value if positive else 0 <= value) or not value <= most or value == math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def _step_ms(text: str) -> float:
    """The synthetic engine's step, a finite number of milliseconds >= 0 (-1, nan and inf were
    taken, and the engine's first step raised in time.sleep and crashed it, every restart)."""
    return _finite(text, "a number of milliseconds >= 0", positive=False)


def _stream_interval_ms(text: str) -> float:
    """How long a stream's later tokens may wait to go together: 0 to 10 s, in milliseconds
    (-5 was taken, as was nan, which sent nothing until the end)."""
    return _finite(text, "a number of milliseconds from 0 to 10000", positive=False,
                   most=10_000)


def _poll_interval_us(text: str) -> float:
    """How often live records are looked at: more than 0, at most a second, in microseconds
    (inf was taken, and the poll thread's sleep raised OverflowError once a request came)."""
    return _finite(text, "a number of microseconds > 0 and at most 1000000", positive=True,
                   most=1_000_000)


def _count(text: str) -> int:
    """A whole number >= 0 (--max-queued -3 was taken)."""
    return _whole(text, 0, "a whole number >= 0")


def _ready_file(text: str) -> Path:
    path = Path(text)
    if not path.resolve().parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: its folder does not exist")
    return path


def _add_frontend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=_port, default=50051, help="port to listen on (0: any free)")
    p.add_argument("--queue-timeout", type=_seconds, default=30.0,
                   help="seconds a request may wait for a free ring slot")
    p.add_argument("--max-queued", type=_count, default=1024,
                   help="requests allowed to wait for a slot")
    p.add_argument("--engine-timeout", type=_positive_seconds, default=3.0,
                   help="seconds without an engine heartbeat before streams fail UNAVAILABLE")
    p.add_argument("--max-request-mb", type=_megabytes, default=4.0,
                   help="largest request accepted")
    p.add_argument("--stream-interval-ms", type=_stream_interval_ms, default=0.0,
                   help="send a stream's later tokens at most this often, together (its first "
                        "token and its end go at once): fewer gRPC messages, less front-end CPU "
                        "per token, burstier arrival (0: every step's token as it comes)")
    p.add_argument("--poll-interval-us", type=_poll_interval_us, default=200.0,
                   help="how often live requests' output records are checked for new tokens "
                        "(shared memory: by a thread, 3-6%% more of a core at one stream; RDMA: "
                        "the event loop's timer, whole milliseconds)")
    p.add_argument("--ready-file", type=_ready_file, default=None,
                   help="write the bound port here once listening")
    p.add_argument("--tls-cert", type=Path, default=None,
                   help="PEM certificate chain: serve gRPC over TLS (with --tls-key)")
    p.add_argument("--tls-key", type=Path, default=None, help="PEM private key for --tls-cert")
    p.add_argument("--tls-client-ca", type=Path, default=None,
                   help="PEM CA bundle: mutual TLS, clients must present a certificate it signed")
    p.add_argument("--auth-token-file", type=Path, default=None,
                   help="file holding a bearer token that Blink RPCs must carry "
                        "(metadata 'authorization: Bearer TOKEN'; health stays open)")
    p.add_argument("--keepalive-time", type=_seconds, default=60.0,
                   help="seconds between the server's pings on idle connections")
    p.add_argument("--max-connection-age", type=_seconds, default=None,
                   help="seconds after which a connection is asked to reconnect (GOAWAY), so "
                        "load balancers can rebalance long-lived channels; its streams in "
                        "flight go on (see --max-connection-age-grace)")
    p.add_argument("--max-connection-age-grace", type=_seconds, default=None,
                   help="with --max-connection-age: seconds the streams in flight on an aged "
                        "connection may still run before it closes and cuts them (default: no "
                        "limit: a stream as long as the context is never cut)")
    p.add_argument("--metrics-port", type=_port, default=None,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port; "
                        "default: off)")
    p.add_argument("--metrics-host", default=None,
                   help="address of the metrics endpoint (None: --host's, so that it is no "
                        "more exposed than the gRPC port, and for --host 0.0.0.0 every "
                        "interface of both families, as gRPC listens; 0.0.0.0: every IPv4 "
                        "interface)")
    p.add_argument("--workers", type=int, default=1,
                   help="front-end processes sharing the port (SO_REUSEPORT) and the ring, "
                        "each with its share of the slots")
    p.add_argument("--worker-index", type=int, default=0, help=argparse.SUPPRESS)
    # names this front end and its workers to an RDMA engine (RingExport keeps one front end)
    p.add_argument("--frontend-group", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--shutdown-timeout", type=_seconds, default=30.0,
                   help="on SIGTERM, SIGINT, SIGHUP or SIGQUIT: seconds in-flight streams may "
                        "take to finish (new requests get UNAVAILABLE meanwhile)")


def _engine_config(args, model_dir: Path):
    from blink.gpu_engine.reference_engine import EngineConfig
    return EngineConfig(model_dir=model_dir, ring_name=args.ring_name, num_slots=args.slots,
                        block_size=args.block_size, kv_cache_bytes=args.kv_cache_mb << 20,
                        num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_batched_tokens,
                        max_model_len=args.max_model_len, load_format=args.load_format,
                        gemm_tuning=args.gemm_tuning, gemm_split_k=args.gemm_split_k,
                        fine_buckets_from=args.fine_buckets_from,
                        sm_count_target=args.sm_count_target,
                        decode_weight_copy=args.decode_weight_copy,
                        quantization=args.quantization, fp8_lm_head=args.fp8_lm_head,
                        fp8_fast_accum=args.fp8_fast_accum, kv_cache_dtype=args.kv_cache_dtype,
                        prefix_caching=args.prefix_caching)


# a bearer token's length at most: gRPC fails calls whose metadata passes 8 KB at random, and
# every one past 16 KB (a longer token locked every client out, the server started as if
# nothing were wrong)
MAX_TOKEN_CHARS = 4096


def _auth_token(path: Path | None) -> str | None:
    """The token in the file (whitespace around it ignored), if gRPC metadata can carry it:
    one line of printable ASCII (a second line, or a non-ASCII one, locked every client out)."""
    if path is None:
        return None
    try:
        token = path.read_bytes().strip()
    except OSError as e:
        sys.exit(f"blink: cannot read the auth token: {e}")
    if not token:
        sys.exit(f"blink: {path} holds no token")
    if not (token.isascii() and token.decode().isprintable()) or len(token) > MAX_TOKEN_CHARS:
        sys.exit(f"blink: {path}: a token must be one line of printable ASCII of at most "
                 f"{MAX_TOKEN_CHARS} characters (what gRPC metadata carries)")
    return token.decode()


def _check_tls_files(args) -> None:
    """The TLS files loaded before the port is bound, each named if it is wrong: gRPC only
    failed the bind, which read as a port in use; an empty --tls-client-ca refused every
    client. Encrypted keys are refused (a service has no one to type the passphrase). What the
    files hold is read, not judged: OpenSSL's security level 0, as gRPC (BoringSSL) takes an
    RSA-1024 or SHA-1 certificate that level 2, Python's default, refuses."""
    import ssl

    def context() -> ssl.SSLContext:
        made = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        made.set_ciphers("DEFAULT:@SECLEVEL=0")
        return made
    try:
        context().load_cert_chain(args.tls_cert, args.tls_key, password=lambda: b"")
    except (OSError, ssl.SSLError) as e:
        sys.exit(f"blink: --tls-cert {args.tls_cert} and --tls-key {args.tls_key} must be a "
                 f"PEM certificate chain and its unencrypted PEM private key: {e}")
    if args.tls_client_ca:
        trusted = context()
        try:  # (any certificate: a pinned client certificate need not be a CA's)
            trusted.load_verify_locations(cafile=args.tls_client_ca)
            why = "" if trusted.cert_store_stats()["x509"] else "none found"
        except (OSError, ssl.SSLError) as e:
            why = str(e)
        if why:
            sys.exit(f"blink: --tls-client-ca {args.tls_client_ca} holds no PEM certificate "
                     f"that can be read ({why}): every client would be refused")


def _frontend_config(args, model_dir: Path):
    from blink.nic_service.server import FrontendConfig
    if bool(args.tls_cert) != bool(args.tls_key) or (args.tls_client_ca and not args.tls_cert):
        sys.exit("blink: TLS needs --tls-cert and --tls-key (and --tls-client-ca only with them)")
    if args.tls_cert:
        _check_tls_files(args)
    return FrontendConfig(model_dir=model_dir, ring_name=args.ring_name, host=args.host,
                          port=args.port, queue_timeout_s=args.queue_timeout,
                          max_queued=args.max_queued, engine_timeout_s=args.engine_timeout,
                          max_request_bytes=int(args.max_request_mb * (1 << 20)),
                          stream_interval_s=args.stream_interval_ms / 1e3,
                          poll_interval_s=args.poll_interval_us / 1e6,
                          metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                          metrics_port_held=args.metrics_port in getattr(
                              args, "metrics_ports_held", ()),
                          tls_cert=args.tls_cert, tls_key=args.tls_key,
                          tls_client_ca=args.tls_client_ca,
                          auth_token=_auth_token(args.auth_token_file),
                          keepalive_time_s=args.keepalive_time,
                          max_connection_age_s=args.max_connection_age,
                          max_connection_age_grace_s=args.max_connection_age_grace,
                          worker=(args.worker_index, args.workers),
                          rdma_engine=args.rdma_addr if args.transport == "rdma" else None,
                          rdma_group=args.frontend_group or 0)


def choose_engine(requested: str) -> str:
    """auto: the CUDA engine when cuda-python, a GPU and nvcc are there, else the CPU one."""
    if requested != "auto":
        return requested
    try:
        from blink.gpu_engine.cuda_runtime import device_attribute, gpu_unusable_reason, nvcc_path
        from blink.gpu_engine.engine_layout import COMPUTE_CAPABILITY
        reason = gpu_unusable_reason() or (None if nvcc_path() else "nvcc not found")
        if reason is None:
            capability = (device_attribute("COMPUTE_CAPABILITY_MAJOR"),
                          device_attribute("COMPUTE_CAPABILITY_MINOR"))
            if capability != COMPUTE_CAPABILITY:
                reason = (f"the GPU's compute capability is {capability[0]}.{capability[1]}, "
                          f"the CUDA engine's {COMPUTE_CAPABILITY[0]}.{COMPUTE_CAPABILITY[1]}")
    except Exception as e:  # cuda-python not installed
        reason = str(e)
    if reason is None:
        return "cuda"
    logging.getLogger("blink.engine").info("using the CPU reference engine: %s", reason)
    return "cpu"


def _for_this_gpu(config, kind: str):
    """The CUDA engines' config on this GPU (_fp8_for_this_gpu), and what their kernels cannot
    serve (the model's shape, the flags, the GPU) refused in one line before a weight is read."""
    from blink.gpu_engine.checkpoint import load_config
    from blink.gpu_engine.engine_layout import cuda_engine_refusal
    try:
        from blink.gpu_engine.cuda_runtime import device_attribute, gpu_unusable_reason
    except ImportError as e:
        sys.exit(f"blink engine: --engine {kind} needs NVIDIA's cuda-python (pip install "
                 f"-e '.[gpu]'): {e}")
    if (reason := gpu_unusable_reason()) is not None:
        sys.exit(f"blink engine: --engine {kind}: {reason}")
    capability = (device_attribute("COMPUTE_CAPABILITY_MAJOR"),
                  device_attribute("COMPUTE_CAPABILITY_MINOR"))
    cfg = load_config(config.model_dir)
    config = _fp8_for_this_gpu(config, capability, cfg)
    refusal = cuda_engine_refusal(
        cfg, kind=kind, quantization=config.quantization_for(cfg),
        kv_cache_dtype=config.kv_cache_dtype, max_num_seqs=config.max_num_seqs,
        slots=config.num_slots, sm_count_target=config.sm_count_target,
        compute_capability=capability, sm_count=device_attribute("MULTIPROCESSOR_COUNT"))
    if refusal is not None:
        sys.exit(f"blink engine: {refusal}")
    return config


def _fp8_for_this_gpu(config, compute_capability: tuple[int, int], cfg=None):
    """The engine's config on a GPU of this compute capability: FP8 flags it cannot run stop
    here, in one line, before any weight is read; an FP8 checkpoint there (no flag asked for
    FP8) is served in bf16, its values, with a warning. cfg: the model's config, when the
    caller has read it already."""
    from blink.gpu_engine.checkpoint import load_config
    from blink.gpu_engine.fp8 import fp8_refusal
    refusal = fp8_refusal(config.quantization, config.kv_cache_dtype, compute_capability)
    if refusal is not None:
        sys.exit(f"blink engine: {refusal}")
    cfg = cfg if cfg is not None else load_config(config.model_dir)
    refusal = fp8_refusal(config.quantization_for(cfg), "auto", compute_capability)
    if refusal is None:
        return config
    logging.getLogger("blink.engine").warning(
        "%s holds FP8 weights, which this GPU cannot serve as FP8 (%s): serving their values "
        "in bf16 (--quantization none)", cfg.name, refusal)
    return dataclasses.replace(config, quantization="none")


def cmd_engine(args) -> None:
    from blink.gpu_engine.checkpoint import CheckpointError
    from blink.gpu_engine.engine_layout import GpuSetupError, KvCacheTooLarge
    from blink.gpu_engine.ring_server import RingInUse
    if args.exit_with_parent is not None:
        _exit_with_parent(args.exit_with_parent, "blink engine")
    _check_transport(args)
    _check_engine_args(args)
    config = _engine_config(args, _model_dir(
        args.model, need_weights=args.load_format != "dummy" and args.engine != "synthetic"))
    kind = choose_engine(args.engine)
    if args.step_log is not None and kind != "cuda":
        sys.exit(f"blink engine: --step-log is an option of the cuda engine, not {kind}")
    if args.ring_memory == "gpu":
        if kind != "cuda":
            sys.exit(f"blink engine: --ring-memory gpu is an option of the cuda engine, not "
                     f"{kind}")
        from blink.gpu_engine.cuda_runtime import dmabuf_unsupported_reason
        reason = dmabuf_unsupported_reason()
        if reason is not None:
            sys.exit(f"blink engine: --ring-memory gpu: {reason}")
    if kind in ("cuda", "host-cuda"):
        config = _for_this_gpu(config, kind)
    export = _ring_export(args)
    try:
        if kind == "cuda":
            from blink.gpu_engine.cuda_engine import run_cuda_engine
            run_cuda_engine(config, args.gpu_memory_utilization, step_log=args.step_log,
                            ring_memory=args.ring_memory, ring_export=export)
            return
        from blink.gpu_engine.reference_engine import run_engine
        if kind == "host-cuda":
            from blink.gpu_engine.host_cuda_engine import HostDrivenCudaEngine
            run_engine(config, HostDrivenCudaEngine,
                       gpu_memory_utilization=args.gpu_memory_utilization)
        elif kind == "hf":
            try:
                import transformers  # noqa: F401  (here, for a clear message)
                from blink.gpu_engine.hf_engine import HfTransformersEngine
            except ImportError as e:
                sys.exit(f"blink engine: --engine hf needs torch and transformers ({e})")
            run_engine(config, HfTransformersEngine, static_cache=args.hf_static_cache)
        elif kind == "synthetic":
            from blink.gpu_engine.synthetic_engine import SyntheticEngine
            run_engine(config, SyntheticEngine, step_ms=args.synthetic_step_ms)
        elif config.load_format == "dummy":
            sys.exit("blink engine: --load-format dummy needs the cuda, host-cuda or hf engine")
        else:
            run_engine(config)
    except (RingInUse, CheckpointError) as e:  # weights the headers' check could not see
        sys.exit(f"blink engine: {e}")
    except KvCacheTooLarge as e:
        sys.exit(f"blink engine: {e} ({e.flags})")
    except GpuSetupError as e:  # (weights past the GPU's memory: cuMemAlloc's out of memory)
        logging.getLogger("blink.engine").debug("the GPU call's traceback", exc_info=True)
        sys.exit(f"blink engine: {e}")
    finally:
        if export is not None:
            export.close()


def cmd_frontend(args) -> None:
    from blink.nic_service.server import serve
    _check_transport(args)
    _name_frontend(args)
    model_dir = _model_dir(args.model, need_weights=False)
    _claim_port(args)
    workers = FrontendWorkers(args, model_dir)
    workers.start()
    config = _frontend_config(args, model_dir)
    try:
        asyncio.run(serve(config, args.ready_file, shutdown_timeout_s=args.shutdown_timeout,
                          on_stop=workers.stop, on_hurry=workers.hurry))
    except OSError as e:
        sys.exit(f"blink frontend: {e}")
    finally:
        workers.stop()
        workers.join(args.shutdown_timeout)


# --- front-end workers: processes sharing one port (SO_REUSEPORT) and one ring -------------------

# what this process holds until it exits: its claim on its ring (blink.ring.lifecycle), the
# sockets that keep its workers' metrics ports for them (_check_metrics_ports)
_HELD_UNTIL_EXIT = []


def _claim_port(args) -> None:
    """The ring's front end claimed for this process (a second front end on a ring would take
    the first one's slots and cancel its requests as orphans). Before several workers bind one
    port with SO_REUSEPORT: fail if another program listens there (reuse would silently share
    it), and pick a concrete port for --port 0; and clear the counts the workers share (a
    previous front end's on the same ring)."""
    from blink.ring.lifecycle import RingClaimed, claim_ring
    try:
        _HELD_UNTIL_EXIT.append(claim_ring(args.ring_name, "frontend"))
    except RingClaimed as e:
        sys.exit(f"blink: {e}")
    if args.workers < 1:
        sys.exit("blink: --workers must be >= 1")
    held = _check_metrics_ports(args)
    _HELD_UNTIL_EXIT.extend(held)
    # (each worker's metrics server binds beside its port's reservation, where there is one)
    args.metrics_ports_held = [sock.getsockname()[1] for sock in held]
    if args.workers == 1:
        return  # one process: gRPC's own bind (without port reuse) says if the port is taken
    import socket
    with socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET) as probe:
        # SO_REUSEADDR: a connection of the previous server's in TIME_WAIT is no listener
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((args.host, args.port))
            probe.listen()
        except OSError as e:
            sys.exit(f"blink: cannot listen on {args.host}:{args.port}: {e.strerror}")
        args.port = probe.getsockname()[1]
    from blink.nic_service.engine_link import WorkerCounts
    WorkerCounts.reset(args.ring_name)  # the port is ours: so is the ring


def _check_metrics_ports(args) -> list:
    """Worker i serves its metrics on --metrics-port + i: each port there and free, checked
    before any worker starts (a worker whose port was taken, or past 65535, failed at start and
    was restarted for ever, its share of the slots unused). With several workers, port 0 is
    resolved here, once, to the first of a run of free ports: each worker took any free port
    as it started, so one restarted after a crash moved to another, and a scrape configuration
    naming its old one lost it. An unset --metrics-host becomes --host (the endpoint has no
    authentication: it listened on every interface while the gRPC port was on loopback), with
    0.0.0.0's both families as gRPC takes them (server.metrics_address).

    Returns the sockets that reserve the ports while they stay open: bound with SO_REUSEPORT,
    not listening (they take no connections), so that each worker's metrics server binds its
    port beside them (metrics.MetricsServer) while any other program's bind is refused, a
    connection's ephemeral port too. Checked and closed, the ports were free until each worker
    bound its own, and another program took one now and then: that worker failed, "Address
    already in use". Held for the process's life, they keep a restarted worker's port too.
    Empty where no port is checked, or where the system has no SO_REUSEPORT (then a worker
    binds a port that was free at start, as before)."""
    if args.metrics_host is None:
        from blink.nic_service.server import metrics_address, unbracketed
        args.metrics_host = metrics_address(unbracketed(args.host))
    if args.metrics_port is None or (args.metrics_port == 0 and args.workers == 1):
        return []  # off, or one process: its metrics server takes a free port as it binds
    import socket

    from blink.nic_service.metrics import metrics_socket_address
    try:  # the address as the metrics server binds it
        family, address = metrics_socket_address(args.metrics_host, args.metrics_port)
    except OSError as e:
        sys.exit(f"blink: --metrics-host {args.metrics_host}: {e}")
    reserve = hasattr(socket, "SO_REUSEPORT")

    def bind(port: int, *options: int, after: tuple[int, ...] = ()) -> socket.socket:
        """A socket on the metrics address and `port` (0: a free one), with the SOL_SOCKET
        `options` set before the bind and `after` it; raises OSError."""
        sock = socket.socket(family)
        try:
            for option in options:
                sock.setsockopt(socket.SOL_SOCKET, option, 1)
            sock.bind((address[0], port, *address[2:]))
            for option in after:
                sock.setsockopt(socket.SOL_SOCKET, option, 1)
        except BaseException:
            sock.close()
            raise
        return sock

    def bind_alone(port: int) -> socket.socket:
        """bind(port) on a port that nothing else holds (no option: refused beside any other
        socket, a connection in TIME_WAIT too, which a run can do without), then open to the
        worker's SO_REUSEPORT (set after the bind: set before, the bind would have joined a
        listener of this user's with SO_REUSEPORT, another serve's worker say)."""
        return bind(port, after=(socket.SO_REUSEPORT,) if reserve else ())
    if args.metrics_port == 0:
        try:
            held = _free_port_run(bind_alone, args.workers)
        except OSError as e:
            sys.exit(f"blink: cannot serve metrics on {args.metrics_host}: {e}")
        args.metrics_port = held[0].getsockname()[1]
        return held if reserve else _closed(held)
    last = args.metrics_port + args.workers - 1
    if last > 65535:
        sys.exit(f"blink: --metrics-port {args.metrics_port} with --workers {args.workers} "
                 f"needs the ports up to {last}: past 65535")
    held = []
    for port in range(args.metrics_port, last + 1):
        try:
            # the check: with SO_REUSEADDR, the previous server's connections in TIME_WAIT let
            # it bind; a listener, or another serve's reservation (no SO_REUSEADDR), does not
            bind(port, socket.SO_REUSEADDR).close()
        except OSError as e:
            _closed(held)
            sys.exit(f"blink: cannot serve metrics on {args.metrics_host}:{port} (--metrics-"
                     f"port {args.metrics_port}, worker {port - args.metrics_port + 1}): "
                     f"{e.strerror}")
        if reserve:  # SO_REUSEPORT before the bind: beside those connections (a worker's
            # server sets it too). No SO_REUSEADDR: Linux lets sockets with it share a port
            # while none listens, so another program's bind with it would have been let in
            try:
                held.append(bind(port, socket.SO_REUSEPORT))
            except OSError:  # connections in TIME_WAIT of a server without SO_REUSEPORT (an
                pass  # older version's, another program's): free, as checked, but not held
    return held


def _closed(sockets: list) -> list:
    """[] once each of `sockets` is closed."""
    for sock in sockets:
        sock.close()
    return []


def _free_port_run(bind, n: int) -> list:
    """n sockets that bind(port) gave on consecutive ports, the first picked by the kernel,
    each kept while the next are tried: a run whose next ports are taken (or past 65535) makes
    way for another pick."""
    for _ in range(64):
        held = [bind(0)]
        first = held[0].getsockname()[1]
        try:
            for port in range(first + 1, first + n):
                held.append(bind(port))
            return held
        except (OSError, OverflowError):  # (OverflowError: a port past 65535)
            _closed(held)
    raise OSError(f"found no {n} consecutive free ports")


def _frontend_worker(args, model_dir: Path, index: int, parent_pid: int) -> None:
    """One extra front-end worker process (multiprocessing target). It stops with its parent,
    however that ends (a kill -9 of serve used to leave it serving NOT_SERVING on the port)."""
    import functools

    from blink.nic_service.engine_link import WorkerCounts  # (before a signal can come)
    clear_counts = functools.partial(WorkerCounts.reset, args.ring_name)
    signal.signal(PARENT_DIED_SIGNAL, lambda *_: _stop_as_parent_died(clear_counts))
    _exit_with_parent(parent_pid, f"blink front-end worker {index + 1}", PARENT_DIED_SIGNAL)
    from blink.nic_service.server import serve
    from blink.ring.lifecycle import HURRY_SIGNAL
    signal.signal(HURRY_SIGNAL, signal.SIG_IGN)  # (its default ends a worker still starting)
    logging.basicConfig(level="DEBUG" if args.verbose else args.log_level.upper(),
                        handlers=[_log_handler(args)])
    args.worker_index, args.ready_file = index, None
    if args.metrics_port:
        args.metrics_port += index  # worker i: metrics port + i
    asyncio.run(serve(_frontend_config(args, model_dir), None,
                      shutdown_timeout_s=args.shutdown_timeout, repeats_hurry=False))


# A front-end worker's parent-death signal, apart from the SIGTERM of a normal stop, so that
# the worker knows which it got. (Polling serve's state instead, as this once did, raced: the
# signal comes as the thread that started the worker exits, and getppid() names serve until
# its last thread has gone, which took longer than any fixed wait on a loaded 2-core VM.)
PARENT_DIED_SIGNAL = signal.SIGUSR2
_parent_died = False  # in a worker: its PARENT_DIED_SIGNAL has come


def _stop_as_parent_died(clear_counts) -> None:
    """The worker's PARENT_DIED_SIGNAL handler, for its first such signal: clear_counts()
    removes the counts the workers share at once (serve, which does it as it stops, is gone),
    then the worker stops as a SIGTERM asks. The signal comes again, once for each of serve's
    threads the worker was handed to as they died, which on a loaded VM can be after the worker
    has drained: a second SIGTERM then, its event loop closed, meets the default action and
    ends the worker at once (the clean-up that ran as the worker ended was skipped so, and the
    counts were left in /dev/shm: seen on CI, now and then). Serve's watcher thread ends in a
    normal stop too, and the workers it restarted get this signal then: they clear the counts
    early, which the others, holding them mapped, do not notice, and serve's own clearing
    tolerates."""
    global _parent_died
    if _parent_died:
        return
    _parent_died = True
    clear_counts()
    os.kill(os.getpid(), signal.SIGTERM)


class FrontendWorkers:
    """Front-end workers 1 .. N-1 as processes (this process is worker 0), each restarted if it
    dies until stop(): at once after a run of RESTART_RESET_S, else after a wait that doubles
    up to RESTART_MAX_WAIT_S (a worker that cannot start, its metrics port taken say, is not
    restarted twice a second for ever). The port must have been claimed (_claim_port)."""
    RESTART_RESET_S = 30.0
    RESTART_MAX_WAIT_S = 30.0

    def __init__(self, args, model_dir: Path):
        self.args, self.model_dir = args, model_dir
        self.procs: dict[int, object] = {}
        self.started: dict[int, float] = {}      # index -> when its process started
        self.restart_wait: dict[int, float] = {}  # index -> its next quick failure's wait
        self.restart_at: dict[int, float] = {}    # index -> when to start it again
        self.stopping = False
        self._stop_sent: set[int] = set()  # the processes told to stop (pids)
        self._watcher = None

    def _spawn(self, index: int) -> None:
        import multiprocessing
        proc = multiprocessing.get_context("spawn").Process(
            target=_frontend_worker, args=(self.args, self.model_dir, index, os.getpid()),
            name=f"blink-frontend-{index}")
        proc.start()
        self.procs[index], self.started[index] = proc, time.monotonic()

    def start(self) -> None:
        if self.args.workers == 1:
            return
        import threading
        for index in range(1, self.args.workers):
            self._spawn(index)
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        # the workers it restarts get their parent-death signal when this thread ends: it
        # must not end on an error
        while not self.stopping:
            time.sleep(0.5)
            for index in list(self.procs):
                if not self.stopping:
                    try:
                        self._restart_if_dead(index, time.monotonic())
                    except Exception:  # (a spawn refused: EAGAIN) the next tick tries again
                        logging.getLogger("blink.frontend").exception(
                            "restarting front-end worker %d", index + 1)

    def _restart_if_dead(self, index: int, now: float) -> None:
        proc = self.procs[index]
        if proc.is_alive():
            return
        if index not in self.restart_at:  # it just died: when to start it again
            ran = now - self.started[index]
            wait = 0.0 if ran > self.RESTART_RESET_S else self.restart_wait.get(index, 0.5)
            self.restart_wait[index] = min(max(2 * wait, 0.5), self.RESTART_MAX_WAIT_S)
            self.restart_at[index] = now + wait
            logging.getLogger("blink.frontend").warning(
                "front-end worker %d exited with %s after %.1f s; restarting in %.1f s",
                index + 1, proc.exitcode, ran, wait)
        if now >= self.restart_at[index]:
            del self.restart_at[index]
            self._spawn(index)

    def stop(self) -> None:
        """SIGTERM to every worker, once: each drains its own streams."""
        self.stopping = True
        for proc in self.procs.values():
            if proc.is_alive() and proc.pid not in self._stop_sent:
                proc.terminate()
                self._stop_sent.add(proc.pid)

    def hurry(self) -> None:
        """HURRY_SIGNAL to every worker: each ends its drain at once (a second stop signal)."""
        from blink.ring.lifecycle import HURRY_SIGNAL
        for proc in self.procs.values():
            if proc.is_alive():
                os.kill(proc.pid, HURRY_SIGNAL)

    def join(self, timeout_s: float) -> None:
        for proc in self.procs.values():
            proc.join(timeout_s + 10)
            if proc.is_alive():
                proc.kill()
        if self.args.workers > 1:  # (also when serve failed before a worker process started:
            # worker 0, this process, may have made the files)
            from blink.nic_service.engine_link import WorkerCounts
            WorkerCounts.reset(self.args.ring_name)


def _engine_argv(args, model_dir: Path) -> list[str]:
    argv = [sys.executable, "-m", "blink.client.cli", "engine", "--model", str(model_dir),
            "--ring-name", args.ring_name, "--slots", str(args.slots), "--engine", args.engine,
            "--gpu-memory-utilization", str(args.gpu_memory_utilization),
            "--block-size", str(args.block_size), "--kv-cache-mb", str(args.kv_cache_mb),
            "--max-num-seqs", str(args.max_num_seqs),
            "--max-batched-tokens", str(args.max_batched_tokens),
            "--load-format", args.load_format,
            "--log-level", "debug" if args.verbose else args.log_level,
            "--log-format", args.log_format, "--synthetic-step-ms", str(args.synthetic_step_ms),
            "--exit-with-parent", str(os.getpid())]
    if args.num_kv_blocks:
        argv += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.max_model_len:
        argv += ["--max-model-len", str(args.max_model_len)]
    if args.hf_static_cache:
        argv.append("--hf-static-cache")
    if not args.gemm_tuning:
        argv.append("--no-gemm-tuning")
    if args.gemm_split_k:
        argv.append("--gemm-split-k")
    argv += ["--fine-buckets-from", str(args.fine_buckets_from)]
    if not args.prefix_caching:
        argv.append("--no-prefix-caching")
    if args.sm_count_target is not None:
        argv += ["--sm-count-target", str(args.sm_count_target)]
    if not args.decode_weight_copy:
        argv.append("--no-decode-weight-copy")
    if args.quantization:
        argv += ["--quantization", args.quantization]
    if args.fp8_lm_head is not None:
        argv.append("--fp8-lm-head" if args.fp8_lm_head else "--no-fp8-lm-head")
    if not args.fp8_fast_accum:
        argv.append("--no-fp8-fast-accum")
    if args.kv_cache_dtype != "auto":
        argv += ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.step_log is not None:
        argv += ["--step-log", str(args.step_log.resolve())]
    if args.ring_memory != "host":
        argv += ["--ring-memory", args.ring_memory]
    if args.transport == "rdma":
        host, port = args.rdma_addr
        host = f"[{host}]" if ":" in host else host  # an IPv6 address
        argv += ["--transport", "rdma", "--rdma-addr", f"{host}:{port}"]
    return argv


def _exit_with_parent(parent_pid: int, who: str, sig: int = signal.SIGTERM) -> None:
    """`sig` to this process when its parent exits (Linux prctl PR_SET_PDEATHSIG), set by the
    child itself (the engine after exec, a front-end worker as it starts): a preexec_fn would
    run Python in a child forked from serve's threads (gRPC's), which can crash before the exec
    (a restarted engine exited with SIGSEGV so). A parent already gone by then has left this
    process to another: exit."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, sig)
    if os.getppid() != parent_pid:
        sys.exit(f"{who}: its parent {parent_pid} has exited")


async def _supervise_engine(argv: list[str], stop: asyncio.Event, link,
                            restart_timeout_s: float) -> int:
    """Runs the engine process and restarts it when it dies, or when its heartbeat (as the
    front end's link sees it) has not moved for restart_timeout_s (0: never); the front end
    keeps serving and re-attaches on its own. An engine that exits before its first heartbeat
    ends the supervision: returns its exit status (0 once `stop` is set). An engine killed
    leaves its ring in /dev/shm: removed here (serve's ring is its own)."""
    log = logging.getLogger("blink.serve")
    backoff = 0.5
    while not stop.is_set():
        # its own session: a terminal's Ctrl-C reaches serve, which drains before stopping the
        # engine; and the engine gets SIGTERM should serve itself die (--exit-with-parent).
        # Not a systemd unit's notify socket: serve is the unit's process, and restarts its
        # engine itself.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NOTIFY_", "WATCHDOG_"))}
        proc = await asyncio.create_subprocess_exec(*argv, start_new_session=True, env=env)
        started, attachments = time.monotonic(), link.attachments
        waiter = asyncio.ensure_future(proc.wait())
        stopper = asyncio.ensure_future(stop.wait())
        ready = False
        while not (waiter.done() or stopper.done()):
            await asyncio.wait({waiter, stopper}, timeout=1.0)
            # ready once the link has attached since this engine started: until then its
            # liveness and heartbeat are the previous engine's (a restart would take those of
            # a crashed engine for this one's, and kill it as stuck while it still loads)
            ready = ready or link.attachments > attachments
            age = link.heartbeat_age()
            if (proc.returncode is None and ready and restart_timeout_s
                    and age is not None and age > restart_timeout_s):
                log.warning("engine stuck (no heartbeat for %.0f s); killing it to restart",
                            age)
                proc.kill()
        if stop.is_set():
            if proc.returncode is None:
                # an engine that answers gets time to stop its kernel; a silent one (stalled,
                # stopped) may never act on SIGTERM
                proc.send_signal(signal.SIGTERM)
                if not (await asyncio.wait({waiter}, timeout=10 if link.alive else 2))[0]:
                    proc.kill()
                    await waiter
            _remove_ring_of(link.ring_name, proc.pid)
            return 0
        stopper.cancel()
        # its ring at once: a stop during the backoff below returned with the file left behind
        _remove_ring_of(link.ring_name, proc.pid)
        if not ready:
            return proc.returncode or 1
        log.warning("engine exited with %s; restarting", proc.returncode)
        backoff = 0.5 if time.monotonic() - started > 30 else min(backoff * 2, 10)
        try:  # (a stop meanwhile ends the wait: serve stopped up to 10 s late)
            await asyncio.wait_for(stop.wait(), backoff)
        except asyncio.TimeoutError:
            pass
    return 0


def _remove_ring_of(ring_name: str, engine_pid: int) -> None:
    """Removes /dev/shm/ring_name if the engine `engine_pid` (exited) left it behind."""
    import numpy as np

    from blink.ring.layout import HEADER_DTYPE
    from blink.ring.shm import ShmSegment
    try:
        seg = ShmSegment.attach(ring_name)
    except (FileNotFoundError, PermissionError, ValueError):
        return
    try:
        if seg.size >= HEADER_DTYPE.itemsize:
            header = np.frombuffer(seg.mmap[:HEADER_DTYPE.itemsize], HEADER_DTYPE)[0]
            if int(header["engine_pid"]) == engine_pid:
                seg.unlink()
    finally:
        seg.close()


def default_ring_name() -> str:
    from blink.ring.shm import default_ring_name as name
    return name()


def cmd_serve(args) -> None:
    _check_transport(args)
    _name_frontend(args)
    _check_engine_args(args)
    if args.workers > args.slots:  # (a worker with no share of the slots never attaches)
        sys.exit(f"blink: --workers {args.workers} needs --slots >= {args.workers}: each "
                 f"front-end worker serves its own share of the ring's slots")
    model_dir = _model_dir(
        args.model, need_weights=args.load_format != "dummy" and args.engine != "synthetic")
    if args.ring_name is None:  # engine and front end are ours alone: a ring per server
        args.ring_name = f"{default_ring_name()}-{args.port or f'p{os.getpid()}'}"
    _claim_port(args)

    async def main() -> int:
        from blink.nic_service.server import Frontend, announce, when_set
        from blink.ring.lifecycle import watch_stop_signals
        stop, hurry = asyncio.Event(), asyncio.Event()
        watch_stop_signals(asyncio.get_running_loop(), stop, hurry)
        # the front end first: a taken port or an unreadable tokenizer fails before any engine
        frontend = Frontend(_frontend_config(args, model_dir))
        port = await frontend.start()
        if args.ready_file:  # before the engine: a failed write leaves no engine to cancel
            args.ready_file.write_text(str(port))
        workers.start()
        engine_stop = asyncio.Event()  # set after the drain: streams in flight need the engine
        engine = asyncio.ensure_future(_supervise_engine(
            _engine_argv(args, model_dir), engine_stop, frontend.link,
            args.engine_restart_timeout))
        async def announce_serving() -> None:
            """The "serving" line once the engine answers (printed as the front end listened,
            it was there too when the engine then failed to start)."""
            while not frontend.link.alive:
                await asyncio.sleep(0.05)
            announce(f"blink: serving {model_dir.name} on {args.host}:{port} (ring "
                     f"{frontend.link.ring_where}); try: blink generate --target "
                     f"{args.host}:{port} \"Hello\"")
        announcing = asyncio.ensure_future(announce_serving())
        await asyncio.wait({engine, asyncio.ensure_future(stop.wait())},
                           return_when=asyncio.FIRST_COMPLETED)
        announcing.cancel()
        workers.stop()  # each worker drains its own streams
        if engine.done():  # the engine never came up: nothing to serve
            await frontend.stop(grace=0)
            return engine.result()
        passing_on = asyncio.ensure_future(when_set(hurry, workers.hurry))  # Ctrl-C twice
        try:
            await frontend.drain(args.shutdown_timeout, hurry=hurry)
            await asyncio.to_thread(workers.join, args.shutdown_timeout)
        finally:
            passing_on.cancel()
        engine_stop.set()
        status = await engine
        await frontend.stop()
        return status

    workers = FrontendWorkers(args, model_dir)
    try:
        status = asyncio.run(main())
    except OSError as e:
        sys.exit(f"blink serve: {e}")
    finally:
        workers.stop()
        workers.join(5)
    if status:
        sys.exit(f"blink serve: the engine exited with status {status} before it was ready "
                 f"(its messages are above)")


def _sampling(args):
    from blink.client.sdk import Sampling
    return Sampling(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
                    ignore_eos=args.ignore_eos)


def _add_tls_args(p: argparse.ArgumentParser) -> None:
    """The TLS flags of a channel to a Blink server (the client commands', the gateway's)."""
    p.add_argument("--tls-ca", type=Path, default=None,
                   help="TLS: the PEM CA that signed the server's certificate (with --tls only: "
                        "the system's roots)")
    p.add_argument("--tls", action="store_true", help="TLS with the system's root CAs")
    p.add_argument("--tls-cert", type=Path, default=None,
                   help="mutual TLS: this client's PEM certificate chain (with --tls-key)")
    p.add_argument("--tls-key", type=Path, default=None, help="mutual TLS: its PEM key")


def tls_from_args(args):
    """The channel's TLS as _add_tls_args' flags say (None: plain), the files read now; raises
    OSError (a file) or ValueError (a certificate without its key, or the reverse)."""
    from blink.client.sdk import Tls
    if not (args.tls or args.tls_ca or args.tls_cert or args.tls_key):
        return None

    def read(path: Path | None) -> bytes | None:
        return path.read_bytes() if path is not None else None
    return Tls(ca=read(args.tls_ca), cert=read(args.tls_cert), key=read(args.tls_key))


def _add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="127.0.0.1:50051", help="the Blink server (HOST:PORT)")
    _add_tls_args(p)
    p.add_argument("--token-file", type=Path, default=None,
                   help="file holding the bearer token the server asks for")


def _client(args):
    """The client commands' BlinkClient: TLS and a token as their flags say, or one line."""
    from blink.client.sdk import BlinkClient
    try:
        token = args.token_file.read_text().strip() if args.token_file else None
        return BlinkClient(args.target, tls=tls_from_args(args), token=token)
    except (OSError, ValueError) as e:  # (a token gRPC cannot carry: ValueError)
        sys.exit(f"blink: {e}")


def cmd_generate(args) -> None:
    from blink.client.sdk import BlinkError
    with _client(args) as client:
        try:
            try:
                serving = client.health(timeout=2) == "SERVING"
            except BlinkError:
                serving = False
            if not serving:
                print(f"blink: waiting up to {args.wait:g} s for {args.target} to serve",
                      file=sys.stderr)
                client.wait_ready(args.wait)
            if args.chat and args.skip_special_tokens_in_prompt:
                sys.exit("blink: --skip-special-tokens-in-prompt applies to a text prompt; "
                         "--chat's template decides its special tokens")
            prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
            stream = client.stream(prompt, _sampling(args), timeout=args.timeout,
                                   cache_salt=args.cache_salt,
                                   skip_special_tokens_in_prompt=args.skip_special_tokens_in_prompt)
            for delta in stream:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
            done = stream.result
        except BlinkError as e:
            sys.exit(f"\nblink: {e}")
        except (TypeError, ValueError) as e:  # what the request builder refuses (-1 tokens)
            sys.exit(f"blink: {e}")
    sys.stdout.write("\n")
    cached = (f" ({done.cached_prompt_tokens} from the prefix cache)"
              if done.cached_prompt_tokens else "")
    print(f"[{done.finish_reason}; {done.prompt_tokens} prompt{cached} + "
          f"{done.completion_tokens} generated tokens; first token "
          f"{done.time_to_first_token_s * 1e3:.1f} ms, total {done.total_s * 1e3:.1f} ms]",
          file=sys.stderr)


def cmd_openai(args) -> None:
    from blink.client.openai_gateway import cmd_openai as run
    run(args)


def cmd_info(args) -> None:
    import dataclasses

    from blink.client.sdk import BlinkError
    with _client(args) as client:
        try:
            info = client.model_info(timeout=10)
        except BlinkError as e:
            sys.exit(f"blink info: {e}")
    print(json.dumps(dataclasses.asdict(info), indent=2))


def cmd_stats(args) -> None:
    from blink.client.sdk import BlinkError
    with _client(args) as client:
        try:
            stats = client.stats(timeout=10)
        except BlinkError as e:
            sys.exit(f"blink stats: {e}")
    # derived, beside the counters it comes from: null until a prompt was looked up
    queried = stats["prefix_query_tokens"]
    stats["prefix_cache_hit_rate"] = stats["prefix_hit_tokens"] / queried if queried else None
    print(json.dumps(stats, indent=2, default=str))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("blink-serve")
    except PackageNotFoundError:
        return "unknown (not installed)"


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: ...)" after a flag's help, but for a switch (--no-prefix-caching's
    "(default: True)" read as off by default) or a help that gives its default in words (it was
    said twice: "(default: the built-in demo model) (default: None)")."""

    def _get_help_string(self, action):
        if action.nargs == 0 or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev off: a flag cut short (--metrics-p 9400) or mistyped into another's prefix
    # (`blink frontend --engine cpu`: "--engine-timeout: 'cpu' is not a number of seconds")
    # is an unrecognized argument, as deploy/README.md's check of every command line assumes
    parser = argparse.ArgumentParser(prog="blink", description="Blink: CPU-free LLM serving",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"blink {_version()}")
    logs = argparse.ArgumentParser(add_help=False)  # every command takes these
    logs.add_argument("-v", "--verbose", action="store_true", help="same as --log-level debug")
    logs.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                      default="info")
    logs.add_argument("--log-format", choices=["text", "json"], default="text",
                      help="json: one JSON object per line (a finished request's fields under "
                           "'request')")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, **kw) -> argparse.ArgumentParser:
        kw.setdefault("formatter_class", _DefaultsFormatter)
        return sub.add_parser(name, parents=[logs], allow_abbrev=False, **kw)

    def model_args(p, ring_default):
        p.add_argument("--model", default=None,
                       help="Hugging Face checkpoint folder (default: the built-in demo model)")
        p.add_argument("--ring-name", type=_ring_name, default=ring_default,
                       help="name of the shared-memory ring under /dev/shm "
                            f"(default: {ring_default or default_ring_name() + '-PORT'})")

    p = command("serve", help="engine and front end on this host")
    model_args(p, None)
    _add_transport_args(p, "with --transport rdma: the engine listens for RDMA connections here "
                           "and the front end connects to it (an IP address of an RDMA "
                           "device's network interface)")
    _add_engine_args(p)
    _add_frontend_args(p)
    p.add_argument("--engine-restart-timeout", type=_seconds, default=60.0,
                   help="restart an engine whose heartbeat has not moved for this many seconds "
                        "(0: never)")
    p.set_defaults(func=cmd_serve)

    p = command("engine", help="the engine alone (creates the ring)")
    model_args(p, default_ring_name())
    _add_transport_args(p, "with --transport rdma: where the engine listens for front ends' RDMA "
                           "connections (RDMA CM; an IP address of an RDMA device's network "
                           "interface)")
    _add_engine_args(p)
    p.add_argument("--exit-with-parent", type=int, default=None, metavar="PID",
                   help="stop (as on SIGTERM) when the process that started this one, PID, "
                        "exits (blink serve passes its own)")
    p.set_defaults(func=cmd_engine)

    p = command("frontend", help="the gRPC front end alone (attaches to the ring)")
    model_args(p, default_ring_name())
    _add_transport_args(p, "with --transport rdma: the engine's RDMA CM address (its "
                           "--rdma-addr)")
    _add_frontend_args(p)
    p.set_defaults(func=cmd_frontend)

    p = command("generate", help="stream a completion to the terminal")
    p.add_argument("prompt")
    _add_client_args(p)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--wait", type=float, default=10.0,
                   help="seconds to wait for the server to become ready")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the model's chat template")
    p.add_argument("--cache-salt", default="",
                   help="the prefix cache's namespace: cached prompt prefixes are reused only "
                        "between requests with the same salt")
    p.add_argument("--skip-special-tokens-in-prompt", action="store_true",
                   help="tokenize the prompt without the tokenizer's special tokens (e.g. BOS)")
    p.set_defaults(func=cmd_generate)

    from blink.client import bench
    p = command("bench", help="serving benchmark: ShareGPT or random prompts, open or "
                                     "closed loop, peers side by side, CPU interference",
                       description=bench.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(p)
    p.set_defaults(func=bench.cmd_bench)

    from blink.client import soak
    p = command("soak", help="saturation soak with random cancels and deadlines, then a leak "
                             "check", description=soak.__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    soak.add_arguments(p)
    p.set_defaults(func=soak.cmd_soak)

    p = command("openai", help="OpenAI-compatible HTTP gateway to a Blink server (aiohttp)")
    p.add_argument("--target", default="127.0.0.1:50051", help="the Blink server (gRPC)")
    # the client commands' TLS flags, not their --token-file: each HTTP request's own bearer
    # token goes on to the server
    _add_tls_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--shutdown-timeout", type=_seconds, default=30.0,
                   help="on a stop signal (SIGTERM, SIGINT, SIGHUP, SIGQUIT): seconds "
                        "in-flight streams may take to finish before they are cancelled (in "
                        "the Blink server too); a second signal cancels them at once")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model names requests may ask for (OpenAI's `model`; the first is "
                        "what /v1/models lists): any other is a 404, model_not_found. By "
                        "default `model` is not checked, since clients send Hub ids or paths "
                        "where the server knows its folder's name")
    p.set_defaults(func=cmd_openai)

    for name, func, text in (("info", cmd_info, "describe the served model"),
                             ("stats", cmd_stats, "engine and ring counters")):
        p = command(name, help=text)
        _add_client_args(p)
        p.set_defaults(func=func)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level="DEBUG" if args.verbose else args.log_level.upper(),
                        handlers=[_log_handler(args)])
    try:
        args.func(args)
        sys.stdout.flush()  # (buffered output to a closed pipe fails here, not at exit)
    except KeyboardInterrupt:  # Ctrl-C: what the command holds is released on the way out
        # (a stream's call cancelled in the server, a benchmark's servers stopped); no traceback
        print(file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    except BrokenPipeError:  # stdout's reader went away (`blink generate ... | head`): its
        # stream was cancelled on the way out, as for Ctrl-C; stdout pointed at /dev/null so that
        # the interpreter's last flush does not fail again; SIGPIPE's status, as `cat` ends
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(128 + signal.SIGPIPE)


def _log_handler(args) -> logging.Handler:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLogFormatter() if args.log_format == "json" else logging.Formatter(
        "%(asctime)s %(name)s %(levelname)s %(message)s"))
    return handler


class JsonLogFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, and a structured `request`
    (log_request's fields) when the record has one."""

    json_lines = True  # (server.announce: the operator's lines as records, not plain text)

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record), "level": record.levelname,
               "logger": record.name, "message": record.getMessage()}
        if hasattr(record, "request"):
            out["request"] = record.request
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


if __name__ == "__main__":
    main()
