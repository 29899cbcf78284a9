"""Decode step time of the CUDA forward pass on real model shapes, beside its floor, and where
every microsecond of a step goes.

    python -m blink.gpu_engine.bench_decode [--shapes llama-3.2-1b llama-3.1-8b]
        [--points 1x512 32x512 1x8192 32x4096] [--breakdown 1x512 32x512] [--cublas]
        [--prefill 2048x4096 2048x8192] [--mixed 256x400+256x256]

Weights are random bf16 generated on the GPU (no hub is reachable here); the cost of a decode
step does not depend on their values. A point BxC decodes B sequences whose new token sits at
position C - 1 (C keys each) by replaying the bucket-B forward graph, the graph the scheduler
kernel launches, timed with CUDA events: the median of REPEATS runs of STEPS replays, after
~0.3 s of replays so the SM clock has left idle. The replays run beside a CTA that holds one SM,
as the scheduler kernel's does while the graphs it launched run (CudaForward.holding_sms;
`--options free:held_sms=0` times them on the whole GPU). Floor: roofline.decode_step_bytes
over the device-to-device copy rate measured in the same run; the summary also gives each step
against the same bytes at the rate a kernel reads alone (read_bandwidth: 7% higher on the H200,
as a copy also writes), what a weight stream can reach. Every timed line ends with the SM
clock and power over its timing (gpu_monitor.py): the replays come in bursts, and run at a
higher clock than a sustained live run under the board's power limit.

--breakdown BxC: the step's ops grouped by label (CudaForward.ops: the same label in every
layer), each group captured alone in a graph of its launches across all layers and timed the
same way; per step, per launch, and as achieved bandwidth for the ops whose bytes are known.
The sum of the groups can exceed the whole step: alone, each group pays its own launch
latencies, which inside the step overlap the previous kernel's tail.

--marginal BxC: what each op label costs inside the whole step, where the breakdown's ops alone
cannot say: the step is timed with the label's launches left out, and with them replaced by
empty kernels on the same grids (blink_pdl_noop: it lets the next kernel launch, waits for the
one before, and exits). The whole step minus the emptied one is the label's work (its weights'
stream with its ramp-up and tail, or attention's chain of latencies), the emptied minus the left
out its kernel boundaries (an empty grid's launch and wait in the PDL chain), each beside its
bytes at the copy rate. The outputs of those steps are wrong; their timing is not, as no decode
kernel's work depends on the values it reads. A launch through cuBLAS is not emptied (decode
steps of up to 16 rows make none).

--prefill CHUNKxCONTEXT: one sequence computing a CHUNK-token prefill chunk whose last token
sits at position CONTEXT - 1 (the last chunk of a CONTEXT-token prompt), timed the same way and
broken down by op, with the FLOPs each op does (roofline.step_flops) per second: a chunk of
thousands of tokens is bound by compute, not by reading its weights. Every variant.

--mixed BxC+NxQ[+...]: one step of B sequences decoding at context C and, per later term, one
sequence's N-token prefill chunk to context Q (as the scheduler mixes them under load), timed
and broken down the same way, rates in FLOP/s and bytes/s. Every variant.

--fp8: every point also with FP8 weights (CudaForward(quantization="fp8")), and with FP8 weights
and an E4M3 KV cache (kv_cache_dtype="fp8"); their floors count the bytes those read.
--cublas: every point also with the projections on cuBLAS (CudaForward(skinny=False)), the
engine's state before the skinny linear kernel. --tile-attention / --decode-attention: also with
every decode token in the tensor-core query tiles / on the flash-decoding path (the default
switches between them at CudaForward.DECODE_MIN_KEYS keys). --no-pdl: also with plain kernel
launches (no programmatic dependent launch: each kernel starts after the previous one ends).
--no-fuse: also with RMSNorm and RoPE + KV write as kernels of their own in the decode buckets
(CudaForward(fuse_norm_rope=False)), not inside the projections. --options NAME:KEY=VALUE,...:
also with CudaForward(KEY=VALUE, ...), e.g. s1:max_attention_splits=1 (at most one CTA a decode
token's keys), bf16head:quantization=fp8,fp8_lm_head=0 (FP8 weights, the LM head in bf16), or
meta:quantization=fp8,random_bf16=wqkv+wo (FP8 weights but q|k|v and o in bf16, as Meta's
Llama-3.1 FP8 releases are served; the floor counts their bf16 bytes).
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import statistics
import sys
from dataclasses import dataclass

import numpy as np

from blink.gpu_engine.checkpoint import ModelConfig
from blink.gpu_engine.gpu_monitor import GpuMonitor
from blink.gpu_engine.roofline import BF16_BYTES, decode_step_bytes, kv_bytes_per_token, \
    projection_weights, step_flops

SHAPES = {
    "llama-3.2-1b": ModelConfig(
        name="llama-3.2-1b", architecture="llama", vocab_size=128256, hidden_size=2048,
        intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, tie_word_embeddings=True, attention_bias=False,
        o_proj_bias=False, qk_norm=False, bos_token_id=128000, eos_token_ids=(128001,)),
    "llama-3.1-8b": ModelConfig(
        name="llama-3.1-8b", architecture="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, tie_word_embeddings=False, attention_bias=False,
        o_proj_bias=False, qk_norm=False, bos_token_id=128000, eos_token_ids=(128001,)),
    # two shapes between those, about 170 MB of o, gate|up and down a layer in bf16: where the
    # projection chain's rule by size (ForwardKernels.CHAIN_MIN_LAYER_BYTES) is drawn
    "llama-3.2-3b": ModelConfig(
        name="llama-3.2-3b", architecture="llama", vocab_size=128256, hidden_size=3072,
        intermediate_size=8192, num_layers=28, num_heads=24, num_kv_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, tie_word_embeddings=True, attention_bias=False,
        o_proj_bias=False, qk_norm=False, bos_token_id=128000, eos_token_ids=(128001,)),
    "qwen3-4b": ModelConfig(
        name="qwen3-4b", architecture="qwen3", vocab_size=151936, hidden_size=2560,
        intermediate_size=9728, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
        max_position_embeddings=40960, tie_word_embeddings=True, attention_bias=False,
        o_proj_bias=False, qk_norm=True, bos_token_id=None, eos_token_ids=(151645, 151643)),
}
DEFAULT_SHAPES = ["llama-3.2-1b", "llama-3.1-8b"]
STEPS = 50
REPEATS = 5
BLOCK = 16


@dataclass(frozen=True)
class Point:
    """`batch` sequences, each computing `chunk` tokens whose last sits at position context - 1
    (chunk 1: a decode step; a larger chunk: a prefill chunk after context - chunk cached
    tokens)."""
    batch: int
    context: int
    chunk: int = 1

    @property
    def tokens(self) -> int:
        return self.batch * self.chunk

    @property
    def positions(self) -> np.ndarray:
        return np.tile(np.arange(self.context - self.chunk, self.context, dtype=np.int32),
                       self.batch)

    @property
    def context_lens(self) -> np.ndarray:  # [batch]: keys each sequence attends to at the end
        return np.full(self.batch, self.context, np.int32)

    @property
    def seq_starts(self) -> np.ndarray:  # [batch + 1]
        return np.arange(self.batch + 1, dtype=np.int32) * self.chunk

    @property
    def groups(self) -> tuple["Point", ...]:  # as MixedPoint's: one group
        return (self,)

    @classmethod
    def parse(cls, text: str) -> "Point":
        b, c = _two_ints(text, "BATCHxCONTEXT, e.g. 32x512")
        return cls(b, c)

    @classmethod
    def parse_prefill(cls, text: str) -> "Point":
        n, c = _two_ints(text, "CHUNKxCONTEXT, e.g. 2048x8192")
        if n > c:
            raise argparse.ArgumentTypeError(f"{text!r}: a chunk cannot exceed its context")
        return cls(1, c, n)

    def __str__(self) -> str:
        if self.chunk > 1:
            return f"chunk {self.chunk} to context {self.context}"
        return f"batch {self.batch} context {self.context}"


@dataclass(frozen=True)
class MixedPoint:
    """One step of several groups, as the scheduler mixes them under load: e.g. 256 sequences
    decoding at context 400 and a 256-token prompt's chunk, in one forward pass."""
    groups: tuple[Point, ...]

    @property
    def tokens(self) -> int:
        return sum(g.tokens for g in self.groups)

    @property
    def batch(self) -> int:  # sequences
        return sum(g.batch for g in self.groups)

    @property
    def context(self) -> int:
        return max(g.context for g in self.groups)

    @property
    def chunk(self) -> int:
        return max(g.chunk for g in self.groups)

    @property
    def positions(self) -> np.ndarray:
        return np.concatenate([g.positions for g in self.groups])

    @property
    def context_lens(self) -> np.ndarray:
        return np.concatenate([g.context_lens for g in self.groups])

    @property
    def seq_starts(self) -> np.ndarray:
        lengths = np.concatenate([np.full(g.batch, g.chunk) for g in self.groups])
        return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)

    @classmethod
    def parse(cls, text: str) -> "MixedPoint":
        """BATCHxCONTEXT+CHUNKxCONTEXT[+...]: decodes, then one prefill chunk a term."""
        decode, *chunks = text.split("+")
        if not chunks:
            raise argparse.ArgumentTypeError(f"{text!r}: expected decodes and at least one "
                                             f"prefill chunk, e.g. 256x400+256x256")
        return cls((Point.parse(decode), *(Point.parse_prefill(c) for c in chunks)))

    def __str__(self) -> str:
        return " + ".join(str(g) for g in self.groups)


def _two_ints(text: str, expected: str) -> tuple[int, int]:
    try:
        a, b = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}")
    if a < 1 or b < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: both must be >= 1")
    return a, b


def copy_bandwidth() -> float:
    """Device-to-device copy rate in bytes/s, read plus written bytes counted."""
    from blink.gpu_engine import cuda_runtime as cr
    n = 4 << 30
    a, b = cr.DeviceBuffer(n), cr.DeviceBuffer(n)
    stream = cr.new_stream()
    times = []
    for _ in range(5):
        with cr.EventTimer(stream) as t:
            cr.check(cr.cu.cuMemcpyDtoDAsync(b.ptr, a.ptr, n, stream))
        times.append(t.seconds)
    a.free(), b.free()
    return 2 * n / statistics.median(times)


@functools.cache
def _read_stream_kernel():
    """csrc/bandwidth.cu's read_stream and its grid: two CTAs an SM."""
    from blink.gpu_engine import cuda_runtime as cr
    from blink.gpu_engine.cuda_forward import CSRC
    sms = cr.device_attribute("MULTIPROCESSOR_COUNT")
    return cr.Module(cr.nvcc_cubin(CSRC / "bandwidth.cu")).function("read_stream"), 2 * sms


def read_stream(stream, data, words: int, total) -> None:
    """csrc/bandwidth.cu's read_stream over `words` 16-byte words at data (device pointers):
    each read once and added (uint32, wrapping) into the uint32 at total; two CTAs an SM."""
    from blink.gpu_engine import cuda_runtime as cr
    kernel, grid = _read_stream_kernel()
    cr.launch(kernel, grid, 256, (int(data), words, int(total)),
              (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p), stream)


def read_bandwidth() -> float:
    """A kernel's read rate in bytes/s (read_stream over 4 GiB, median_seconds' timing): what a
    kernel that streams weights can reach, beside copy_bandwidth, which the floors count."""
    from blink.gpu_engine import cuda_runtime as cr
    n = 4 << 30
    data, total = cr.DeviceBuffer(n), cr.DeviceBuffer(4)
    stream = cr.new_stream()
    try:
        return n / median_seconds(stream, lambda: read_stream(stream, data.ptr, n // 16,
                                                              total.ptr), steps=1)
    finally:
        data.free()
        total.free()


def median_seconds(stream, launch, steps: int = STEPS, repeats: int = REPEATS) -> float:
    """Median over `repeats` of the event-timed seconds per launch() of `steps` back to back,
    after enough launches to take ~0.3 s (the SM clock idles low until the GPU is busy)."""
    from blink.gpu_engine import cuda_runtime as cr
    with cr.EventTimer(stream) as probe:
        launch()
    for _ in range(max(1, min(2000, int(0.3 / max(probe.seconds, 1e-6))))):
        launch()
    runs = []
    for _ in range(repeats):
        with cr.EventTimer(stream) as t:
            for _ in range(steps):
                launch()
        runs.append(t.seconds / steps)
    return statistics.median(runs)


def step_batch(point: Point | MixedPoint, blocks_per_seq: int, vocab_size: int = 1000):
    """point.batch sequences, each computing its tokens up to its context - 1 (every last
    token's logits wanted), each with blocks of its own. The tokens are random ids below
    vocab_size (seeded): one repeated token makes every row of the step's activations alike,
    which toggles fewer bits in the GEMMs and draws less power than a live step."""
    from blink.gpu_engine.forward_batch import ForwardBatch
    b = point.batch
    tables = np.arange(b * blocks_per_seq, dtype=np.int32).reshape(b, blocks_per_seq)
    tokens = np.random.default_rng(point.tokens).integers(0, vocab_size, point.tokens, np.int32)
    return ForwardBatch(tokens, point.positions, point.seq_starts, point.context_lens, tables,
                        np.arange(b, dtype=np.int32))


def make_forward(cfg: ModelConfig, points: list[Point], **options):
    from blink.gpu_engine.cuda_forward import CudaForward
    max_tokens = max(p.tokens for p in points)
    max_seqs = max(p.batch for p in points)
    blocks_per_seq = max(p.context for p in points) // BLOCK + 1
    fwd = CudaForward.random_weights(cfg, seed=0, block_size=BLOCK,
                                     max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs,
                                     max_model_len=blocks_per_seq * BLOCK,
                                     num_blocks=max_seqs * blocks_per_seq, **options)
    fwd.randomize_kv_cache(seed=1)
    return fwd, blocks_per_seq


def time_step(fwd, point: Point, blocks_per_seq: int) -> float:
    from blink.gpu_engine import cuda_runtime as cr
    # writes the batch arrays, and warms the graph
    fwd.run(step_batch(point, blocks_per_seq, fwd.cfg.vocab_size))
    graph = fwd.graph_execs[fwd.bucket_for(point.tokens)]
    with fwd.holding_sms():
        return median_seconds(fwd.stream,
                              lambda: cr.check(cr.cu.cuGraphLaunch(graph, fwd.stream)))


# The projections (roofline.projection_weights' keys) whose weights an op label reads
# (CudaForward.ops' labels, fused and unfused).
LABEL_PROJECTIONS = {"qkv proj": ("qkv",), "rmsnorm + qkv proj": ("qkv",),
                     "rmsnorm + qkv proj + rope + kv write": ("qkv",),
                     "qkv proj + rope + kv write": ("qkv",), "o proj + residual": ("o",),
                     "gate|up proj": ("gate_up",), "gate|up proj + silu*mul": ("gate_up",),
                     "rmsnorm + gate|up proj + silu*mul": ("gate_up",),
                     "down proj + residual": ("down",),
                     "o proj + residual, rmsnorm + gate|up proj + silu*mul, down proj + "
                     "residual": ("o", "gate_up", "down"), "lm head": ("lm_head",)}


# CudaForward's fused projection names -> roofline.projection_weights' keys
ROOFLINE_PROJECTIONS = {"wqkv": "qkv", "wo": "o", "wgu": "gate_up", "wdown": "down"}


def label_weights(cfg: ModelConfig, label: str) -> int | None:
    """Weights (elements) a labelled op's projections hold, None for an op without any."""
    projections = LABEL_PROJECTIONS.get(label)
    if projections is None:
        return None
    weights = projection_weights(cfg)
    return sum(weights[p] for p in projections)


def op_bytes(cfg: ModelConfig, label: str, point: Point, weights_fp8: bool = False,
             kv_fp8: bool = False, lm_head_fp8: bool = False,
             kept_bf16: frozenset[str] = frozenset()) -> int | None:
    """Bytes one launch of a labelled op must read (weights: bf16, or E4M3 codes with
    weights_fp8 but for the projections of kept_bf16, and for the LM head with lm_head_fp8; or
    keys and values), if known."""
    if label == "lm head":
        return label_weights(cfg, label) * (1 if lm_head_fp8 else BF16_BYTES)
    if label in LABEL_PROJECTIONS:
        weights = projection_weights(cfg)
        return sum(weights[p] * (1 if weights_fp8 and p not in kept_bf16 else BF16_BYTES)
                   for p in LABEL_PROJECTIONS[label])
    if label == "attention":
        return int(point.context_lens.sum()) * kv_bytes_per_token(cfg, kv_fp8) // cfg.num_layers
    return None


def projections_kept_bf16(fwd) -> frozenset[str]:
    """The projections (roofline.projection_weights' keys) the forward pass timed keeps in
    bf16 beside FP8 ones (CudaForward's random_bf16)."""
    return frozenset(ROOFLINE_PROJECTIONS[name] for name in fwd.random_bf16)


def fwd_op_bytes(fwd):
    """op_bytes for the forward pass timed: its FP8 weights, cache and LM head count."""
    return functools.partial(op_bytes, weights_fp8=fwd.fp8, kv_fp8=fwd.kv_fp8,
                             lm_head_fp8=fwd.lm_head_fp8,
                             kept_bf16=projections_kept_bf16(fwd))


def op_flops(cfg: ModelConfig, label: str, point: Point) -> int | None:
    """FLOPs of one launch of a labelled op at a prefill point, if known (not the LM head's:
    one row a sequence, a GEMV)."""
    weights = label_weights(cfg, label)
    if weights is not None and label != "lm head":
        return 2 * weights * point.tokens
    if label == "attention":
        return step_flops(cfg, list(point.positions), point.batch).attention // cfg.num_layers
    return None


def breakdown(fwd, point: Point, blocks_per_seq: int,
              whole: float | None = None) -> list[tuple[str, int, float]]:
    """[(label, launches per step, seconds per step)] in first-launch order, plus the whole
    step last as ('whole step', kernels, seconds): `whole` when the caller timed it."""
    from blink.gpu_engine import cuda_runtime as cr
    if whole is None:
        whole = time_step(fwd, point, blocks_per_seq)
    bucket = fwd.bucket_for(point.tokens)
    groups: dict[str, list] = {}
    for label, enqueue in fwd.ops(bucket, in_order=False):  # each label's launches alone
        groups.setdefault(label, []).append(enqueue)
    out = [(label, len(enqueues), time_enqueues(fwd, enqueues, steps=10))
           for label, enqueues in groups.items()]
    kernels = sum(fwd.graph_node_types[bucket].values())
    out.append(("whole step", kernels, whole))
    return out


def time_enqueues(fwd, enqueues, steps: int = STEPS) -> float:
    """Seconds a replay of the graph of these enqueue()s (each launches on fwd.stream, the
    stream being captured) takes, timed as a step is."""
    from blink.gpu_engine import cuda_runtime as cr
    exe = cr.capture_device_graph(fwd.stream, lambda _: [enqueue() for enqueue in enqueues])
    try:
        with fwd.holding_sms():
            return median_seconds(fwd.stream,
                                  lambda: cr.check(cr.cu.cuGraphLaunch(exe, fwd.stream)),
                                  steps=steps)
    finally:
        cr.check(cr.cu.cuGraphExecDestroy(exe))


@contextlib.contextmanager
def empty_kernels(kernels):
    """Inside it, every launch of `kernels` (a ForwardKernels) runs blink_pdl_noop in its
    place, on the same grid, block and dynamic shared memory: the op keeps its kernel
    boundaries and does none of its work. Yields the list of the launches it emptied. (The
    empty kernel holds fewer registers and no static shared memory, and has no cluster shape:
    its CTAs fit an SM more densely than the kernels they stand for.)"""
    launch, patched = kernels.launch, vars(kernels).get("launch")
    emptied: list[str] = []

    def noop(name, grid, block, args, stream, smem=0):
        emptied.append(name)
        launch("blink_pdl_noop", grid, block, (), stream, smem)

    kernels.launch = noop
    try:
        yield emptied
    finally:
        if patched is None:
            del kernels.launch  # the class's method again
        else:
            kernels.launch = patched


@dataclass(frozen=True)
class Marginal:
    """What one op label costs inside the whole step: the step's seconds with the label's ops
    left out, and with their kernels emptied (blink_pdl_noop on their grids)."""
    label: str
    ops: int  # the label's ops in a step (an op: one or more kernels)
    seconds_left_out: float
    seconds_emptied: float


def marginal(fwd, point: Point, blocks_per_seq: int) -> tuple[float, list[Marginal]]:
    """The whole step (timed from the same kind of capture as the variants, before and after
    them: their mean) and, for each op label in launch order, the step with that label's ops
    left out and with them emptied. The outputs of such steps are wrong, their timing is not:
    no decode kernel's work depends on the values it reads. An op that launches a kernel
    other than through ForwardKernels.launch (cuBLAS: steps of more than 16 rows, skinny=0)
    cannot be emptied: ValueError."""
    fwd.run(step_batch(point, blocks_per_seq, fwd.cfg.vocab_size))  # the batch arrays
    ops = fwd.ops(fwd.bucket_for(point.tokens))
    whole_step = [enqueue for _, enqueue in ops]
    before = time_enqueues(fwd, whole_step)

    def emptied(label, enqueue):
        def run():
            with empty_kernels(fwd.kernels) as launches:
                enqueue()
            if not launches:
                raise ValueError(f"{label!r} launches no kernel of ForwardKernels: "
                                 f"--marginal cannot empty it")
        return run

    rows = []
    for label in dict.fromkeys(label for label, _ in ops):
        left_out = time_enqueues(fwd, [enqueue for other, enqueue in ops if other != label])
        empty = time_enqueues(fwd, [emptied(label, enqueue) if other == label else enqueue
                                    for other, enqueue in ops])
        rows.append(Marginal(label, sum(other == label for other, _ in ops), left_out, empty))
    return (before + time_enqueues(fwd, whole_step)) / 2, rows


def print_marginal(name: str, cfg: ModelConfig, point: Point, whole: float,
                   rows: list[Marginal], bw: float, impl: str, fwd) -> None:
    """Each label's share of the step: its work (what emptying its kernels saves), its
    boundaries (what leaving the empty kernels out saves on top) and its bytes at the copy
    rate (decode points), per step and per launch."""
    print(f"\nmarginal {name} {point} ({impl}): whole step {whole * 1e6:.1f} us")
    print("| op | launches | work, us per step | boundaries, us per step | work a launch | "
          "boundary a launch | its bytes at the copy rate, a launch |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    bytes_of = fwd_op_bytes(fwd)
    total_work = total_boundaries = 0.0
    for row in rows:
        work, boundaries = whole - row.seconds_emptied, row.seconds_emptied - row.seconds_left_out
        total_work, total_boundaries = total_work + work, total_boundaries + boundaries
        amount = bytes_of(cfg, row.label, point) if point.chunk == 1 else None
        print(f"| {row.label} | {row.ops} | {work * 1e6:.1f} | {boundaries * 1e6:.1f} | "
              f"{work / row.ops * 1e6:.2f} | {boundaries / row.ops * 1e6:.2f} | " +
              (f"{amount / bw * 1e6:.2f} |" if amount else "|"))
    print(f"| sum | | {total_work * 1e6:.1f} | {total_boundaries * 1e6:.1f} | | | |")


def print_breakdown(name: str, cfg: ModelConfig, point: Point | MixedPoint, rows, bw: float,
                    impl: str, fwd):
    """The rates a step's kind is bound by: FLOP/s with prefill chunks, bytes/s with decodes
    (a mixed step: both); fwd: the forward pass timed (its FP8 weights or cache count)."""
    whole = rows[-1][2]
    print(f"\nbreakdown {name} {point} ({impl}): whole step {whole * 1e6:.0f} us, "
          f"{rows[-1][1]} kernels")
    rates = []  # (column, amount of one launch of a labelled op, unit)
    if any(g.chunk > 1 for g in point.groups):
        rates.append(("achieved TFLOP/s", op_flops, 1e12))
    if any(g.chunk == 1 for g in point.groups):
        rates.append(("achieved GB/s (copy rate %.0f)" % (bw / 1e9),
                      fwd_op_bytes(fwd), 1e9))
    print("| op | launches | us per step | us per launch | share of step | " +
          " | ".join(column for column, _, _ in rates) + " |")
    print("| --- | --- | --- | --- | --- |" + " --- |" * len(rates))
    total = 0.0
    for label, count, seconds in rows[:-1]:
        total += seconds
        cells = []
        for _, amount_of, unit in rates:
            amount = amount_of(cfg, label, point)
            cells.append(f"{amount * count / seconds / unit:.0f}" if amount else "")
        print(f"| {label} | {count} | {seconds * 1e6:.1f} | {seconds / count * 1e6:.2f} | "
              f"{seconds / whole:.0%} | " + " | ".join(cells) + " |")
    print(f"| sum of ops alone | | {total * 1e6:.1f} | | {total / whole:.0%} |" +
          " |" * len(rates))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, choices=list(SHAPES))
    parser.add_argument("--points", nargs="*", type=Point.parse,
                        default=[Point(1, 512), Point(32, 512)],
                        help="BATCHxCONTEXT decode points (default 1x512 32x512; none: "
                             "--points alone)")
    parser.add_argument("--breakdown", nargs="*", type=Point.parse, default=[],
                        help="BATCHxCONTEXT points to break down by op")
    parser.add_argument("--marginal", nargs="*", type=Point.parse, default=[],
                        help="BATCHxCONTEXT points to break down inside the step: each op's "
                             "work and kernel boundaries")
    parser.add_argument("--prefill", nargs="*", type=Point.parse_prefill, default=[],
                        help="CHUNKxCONTEXT prefill chunks (one sequence), timed and broken "
                             "down by op")
    parser.add_argument("--mixed", nargs="*", type=MixedPoint.parse, default=[],
                        help="DECODESxCONTEXT+CHUNKxCONTEXT[+...] steps: decodes and prefill "
                             "chunks in one step (as under load), timed and broken down by op")
    parser.add_argument("--cublas", action="store_true",
                        help="also time every point with cuBLAS for every projection")
    parser.add_argument("--fp8", action="store_true",
                        help="also time every point with FP8 weights, and with FP8 weights and "
                             "an E4M3 KV cache")
    parser.add_argument("--no-bf16", action="store_true",
                        help="leave out the default (bf16) variant")
    parser.add_argument("--tile-attention", action="store_true",
                        help="also time every point with decode tokens in query tiles")
    parser.add_argument("--decode-attention", action="store_true",
                        help="also time every point with decode tokens on the decode path")
    parser.add_argument("--no-pdl", action="store_true",
                        help="also time every point with plain (not programmatic) launches")
    parser.add_argument("--no-fuse", action="store_true",
                        help="also time every point with RMSNorm and RoPE as separate kernels")
    parser.add_argument("--options", nargs="*", default=[], type=parse_options,
                        help="NAME:KEY=VALUE,...: also time every point with "
                             "CudaForward(KEY=VALUE, ...), e.g. few:max_attention_splits=2")
    args = parser.parse_args(argv)
    bw = copy_bandwidth()
    print(f"bench copy bandwidth: {bw / 1e12:.2f} TB/s (device-to-device, read + write)")
    read_bw = read_bandwidth()
    print(f"bench read bandwidth: {read_bw / 1e12:.2f} TB/s (a kernel's reads alone: what a "
          f"weight stream can reach; the floors count the copy rate)")
    with GpuMonitor.for_cuda_device(0).reporting("bench decode") as monitor:
        table, prefill_table = run_points(args, bw, monitor)
    print_table(["shape", "batch", "context", "variant", "ms per step", "floor (ms)", "x floor",
                 "x floor at the read rate"],
                [(name, point.batch, point.context, impl, f"{seconds * 1e3:.3f}",
                  f"{floor * 1e3:.3f}", f"{seconds / floor:.2f}",
                  f"{seconds / (floor * bw / read_bw):.2f}")
                 for name, point, impl, seconds, floor in table])
    print_table(["shape", "chunk", "context", "variant", "ms per step", "tok/s", "TFLOP/s"],
                [(name, point.chunk, point.context, impl, f"{seconds * 1e3:.3f}",
                  f"{point.tokens / seconds:,.0f}", f"{work.total / seconds / 1e12:.0f}")
                 for name, point, impl, seconds, work in prefill_table])
    sys.stdout.flush()


def run_points(args, bw: float, monitor: GpuMonitor) -> tuple[list, list]:
    """Every shape, variant and point of the command line, timed and printed as it goes (each
    line with the SM clock and power over its timing); the summary tables' rows."""
    table, prefill_table = [], []
    for name in args.shapes:
        cfg = SHAPES[name]
        points = sorted(set(args.points) | set(args.breakdown) | set(args.marginal) |
                        set(args.prefill) |
                        set(args.mixed), key=lambda p: (p.chunk, p.batch, p.context))
        impls = [] if args.no_bf16 else [("default", {})]
        if args.fp8:
            impls += [("fp8", {"quantization": "fp8"}),
                      ("fp8+kv", {"quantization": "fp8", "kv_cache_dtype": "fp8"})]
        if args.cublas:
            impls.append(("cublas", {"skinny": False}))
        if args.tile_attention:
            impls.append(("tile attention", {"decode_min_keys": 2 ** 31 - 1}))
        if args.decode_attention:
            impls.append(("decode attention", {"decode_min_keys": 0}))
        if args.no_pdl:
            impls.append(("no pdl", {"programmatic_launch": False}))
        if args.no_fuse:
            impls.append(("no fuse", {"fuse_norm_rope": False}))
        impls += args.options
        for impl, options in impls:
            fwd, blocks_per_seq = make_forward(cfg, points, **options)
            if fwd.gemm_tuner is not None:
                print(f"gemm tuning {name} ({impl}): {fwd.gemm_tuner.summary()}")
            for point in points:
                if point not in args.points:
                    continue
                seconds, clocks = timed_step(fwd, point, blocks_per_seq, monitor)
                need = decode_step_bytes(cfg, [point.context] * point.batch, fwd.fp8,
                                         fwd.kv_fp8, fwd.lm_head_fp8,
                                         projections_kept_bf16(fwd))
                floor = need.total / bw
                table.append((name, point, impl, seconds, floor))
                print(f"bench decode {name} {point} ({impl}): {seconds * 1e3:.3f} ms/step "
                      f"(floor {floor * 1e3:.3f} ms = {need.describe()}; "
                      f"{seconds / floor:.2f}x floor), median of {REPEATS} x {STEPS} graph "
                      f"replays{clocks}")
            for point in args.prefill:
                seconds, clocks = timed_step(fwd, point, blocks_per_seq, monitor)
                rows = breakdown(fwd, point, blocks_per_seq, whole=seconds)
                work = step_flops(cfg, list(point.positions), point.batch)
                prefill_table.append((name, point, impl, seconds, work))
                print(f"bench prefill {name} {point} ({impl}): {seconds * 1e3:.3f} ms/step, "
                      f"{point.tokens / seconds:,.0f} tok/s, {work.total / seconds / 1e12:.0f} "
                      f"TFLOP/s ({work.projections / 1e12:.2f} TFLOP projections + "
                      f"{work.attention / 1e12:.2f} TFLOP attention){clocks}")
                print_breakdown(name, cfg, point, rows, bw, impl, fwd)
            for point in args.mixed:
                seconds, clocks = timed_step(fwd, point, blocks_per_seq, monitor)
                rows = breakdown(fwd, point, blocks_per_seq, whole=seconds)
                work = step_flops(cfg, list(point.positions), point.batch)
                kv = int(point.context_lens.sum()) * kv_bytes_per_token(cfg, fwd.kv_fp8)
                print(f"bench mixed {name} {point} ({impl}): {seconds * 1e3:.3f} ms/step, "
                      f"{point.tokens} tokens ({point.tokens / seconds:,.0f} tok/s), "
                      f"{work.total / seconds / 1e12:.0f} TFLOP/s, {kv / 1e9:.2f} GB of keys "
                      f"and values{clocks}")
                print_breakdown(name, cfg, point, rows, bw, impl, fwd)
            for point in args.breakdown:
                print_breakdown(name, cfg, point, breakdown(fwd, point, blocks_per_seq), bw,
                                impl, fwd)
            for point in args.marginal:
                print_marginal(name, cfg, point, *marginal(fwd, point, blocks_per_seq), bw,
                               impl, fwd)
            fwd.close()
    return table, prefill_table


def timed_step(fwd, point: Point, blocks_per_seq: int, monitor: GpuMonitor) -> tuple[float, str]:
    """time_step, and '; <the SM clock and power over its replays>' (empty when not read)."""
    since = monitor.mark()
    seconds = time_step(fwd, point, blocks_per_seq)
    clocks = monitor.summary(since)
    return seconds, f"; {clocks.describe()}" if clocks is not None else ""


def parse_options(text: str) -> tuple[str, dict[str, int | str]]:
    """NAME:KEY=VALUE,... -> (NAME, {KEY: VALUE, ...}), a VALUE of digits as an int (e.g.
    fp8head:quantization=fp8,fp8_lm_head=0)."""
    label, _, items = text.partition(":")
    return label, {key: int(value) if value.lstrip("-").isdigit() else value
                   for key, value in (item.split("=", 1) for item in items.split(",") if item)}


def print_table(header: list[str], rows: list[tuple]) -> None:
    """A markdown table after a blank line; nothing when there are no rows."""
    if rows:
        print("\n| " + " | ".join(header) + " |")
        print("|" + " --- |" * len(header))
        for row in rows:
            print("| " + " | ".join(str(v) for v in row) + " |")


if __name__ == "__main__":
    main()
