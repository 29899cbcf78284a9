"""gpu_engine/engine_layout.py is the one definition of what the CUDA engine's host and scheduler
kernel share: the generated header is current and its static_asserts hold under g++ (and nvcc),
the kernel builds against it and defines none of those structs itself, and the EngineInit
record the host builds reads back field for field through the C struct. CPU only."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from blink.gpu_engine import engine_layout as el
from blink.ring.layout import MAX_EOS_IDS, RingGeometry

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "gpu_engine" / "csrc"
HEADER = CSRC / "engine_layout.h"
STRUCT_NAMES = [d.metadata["c_name"] for d in el.STRUCTS]


def test_generated_header_is_current():
    assert HEADER.read_text() == el.c_header(), \
        "run `python -m blink.gpu_engine.engine_layout --write-header`"


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to compile the C view")
def test_header_compiles_with_gxx(tmp_path):
    # the header's static_asserts check every size and offset against engine_layout.py; with
    # scheduler.cuh, that its kMaxSlots is the generated one
    src = tmp_path / "check.cc"
    src.write_text('#include "engine_layout.h"\n#include "scheduler.cuh"\n'
                   "static_assert(blink::sched::kMaxSlots == blink::engine::kMaxSlots, \"\");\n"
                   "int main() { return 0; }\n")
    r = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
                        f"-I{CSRC}", str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_header_compiles_with_nvcc(tmp_path):
    src = tmp_path / "check.cu"
    src.write_text('#include "engine_layout.h"\n'
                   "__global__ void k(const blink::engine::EngineInit* init, int* out) {\n"
                   "  *out = init->fwd.num_buckets;\n}\n")
    r = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90a", f"-I{CSRC}", "-c", str(src),
                        "-o", str(tmp_path / "check.o")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def scheduler_max_registers() -> int:
    """cuda_engine.SCHEDULER_MAX_REGISTERS, read from its source (it imports CUDA)."""
    source = (ROOT / "gpu_engine" / "cuda_engine.py").read_text()
    return int(re.search(r"^SCHEDULER_MAX_REGISTERS = (\d+)$", source, re.M).group(1))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_scheduler_kernel_builds(tmp_path):
    """The flags cuda_runtime.nvcc_cubin(relocatable=True, max_registers=) uses for the
    engine."""
    r = subprocess.run(["nvcc", "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-O3",
                        "-std=c++17", f"-I{CSRC}", "-rdc=true",
                        f"-maxrregcount={scheduler_max_registers()}",
                        "-o", str(tmp_path / "k.cubin"),
                        str(CSRC / "scheduler_kernel.cu")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_the_held_sm_takes_the_scheduler_kernels_registers():
    """blink_hold_sm (forward_kernels.cu) takes as many registers, in the SM's units of 8, as
    the scheduler kernel's cap lets it take: bench_decode then times the forward graphs beside
    what the live engine has beside them (the GPU test compares the loaded kernels)."""
    source = (CSRC / "forward_kernels.cu").read_text()
    held = int(re.search(r"kSchedulerRegisters = (\d+);", source).group(1))
    assert -(-held // 8) == -(-scheduler_max_registers() // 8)


def test_kernel_defines_no_shared_struct_itself():
    for name in ("scheduler_kernel.cu", "scheduler.cuh"):
        text = (CSRC / name).read_text()
        for struct in STRUCT_NAMES:
            assert f"struct {struct} " not in text, f"{name} defines {struct}: generate it"
    assert "BLINK_SCHED_MAX_SLOTS" not in (CSRC / "scheduler.cuh").read_text()


# -- the EngineInit record ---------------------------------------------------------------------

def sample_init() -> tuple[np.ndarray, dict]:
    """An EngineInit record with a distinct value in every field, and the arguments it came from."""
    geom = RingGeometry(5, max_prompt_tokens=99, max_output_tokens=100)
    args = dict(
        sched=el.sched_config(num_slots=5, max_model_len=101, block_size=16, num_blocks=77,
                              max_num_seqs=4, max_num_batched_tokens=64, prefix_caching=1),
        ring_base=0x7F12_3456_7000, geom=geom, control=0x7F00_0000_1000,
        consumed_gen=0x7000_0000_0100, corrupt_since=0x7000_0000_0200,
        scratch_slot=0x7000_0000_0300, staged_prompts=0x7000_0000_0400, vocab_size=151936,
        context_length=100, kv_capacity_tokens=77 * 16, eos_ids=[151643, 151645, 7],
        corrupt_grace_ns=2_500_000_000, idle_sleep_ns=2000,
        forward_pointers={n: 0x7100_0000_0000 + 0x1000 * i
                          for i, n in enumerate(el.FORWARD_POINTERS)},
        max_blocks_per_seq=7, graph_execs={64: 0xA64, 1: 0xA01, 8: 0xA08, 2: 0xA02},
        step_log=0x7200_0000_0500, step_log_capacity=4096)
    return el.engine_init_record(**args), args


def test_init_record_holds_what_was_set():
    rec, a = sample_init()
    assert rec.dtype == el.ENGINE_INIT_DTYPE and rec.nbytes == el.ENGINE_INIT_DTYPE.itemsize
    assert rec["sched"] == a["sched"]
    assert int(rec["ring"]["base"]) == a["ring_base"]
    for name in ("num_slots", "slot_bytes", "record_bytes", "max_prompt_tokens",
                 "max_output_tokens", "slots_offset", "records_offset"):
        assert int(rec["ring"][name]) == getattr(a["geom"], name), name
    fwd = rec["fwd"]
    assert {n: int(fwd[n]) for n in el.FORWARD_POINTERS} == a["forward_pointers"]
    assert int(fwd["max_blocks_per_seq"]) == 7
    assert int(fwd["num_buckets"]) == 4
    assert fwd["bucket_tokens"].tolist() == [1, 2, 8, 64] + [0] * (el.MAX_BUCKETS - 4)
    assert fwd["graph_execs"].tolist() == [0xA01, 0xA02, 0xA08, 0xA64] + [0] * (el.MAX_BUCKETS - 4)
    for name in ("control", "consumed_gen", "corrupt_since", "scratch_slot", "staged_prompts",
                 "vocab_size", "context_length", "kv_capacity_tokens", "corrupt_grace_ns",
                 "idle_sleep_ns", "step_log", "step_log_capacity"):
        assert int(rec[name]) == a[name], name
    assert int(rec["num_eos"]) == 3
    assert rec["eos_ids"].tolist() == a["eos_ids"] + [0] * (MAX_EOS_IDS - 3)


def _leaves(dtype: np.dtype, prefix: str = ""):
    """(C expression path, numpy scalar dtype, array length or None) of every leaf field."""
    for name, (ftype, _) in dtype.fields.items():
        path = prefix + name
        if ftype.names is not None:
            yield from _leaves(ftype, path + ".")
        elif ftype.subdtype is not None:
            yield path, ftype.subdtype[0], ftype.subdtype[1][0]
        else:
            yield path, ftype, None


def _python_values(rec: np.ndarray) -> list[str]:
    out = []
    for path, _, count in _leaves(rec.dtype):
        value = rec
        for part in path.split("."):
            value = value[part]
        values = value.tolist() if count else [value.item()]
        out += [f"{path}{f'[{i}]' if count else ''}={int(v)}" for i, v in enumerate(values)]
    return out


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to read the record in C")
def test_init_record_reads_back_through_the_c_struct(tmp_path):
    """The host's record bytes, read as the generated C struct, give back every field (pointers
    included, as the kernel sees them)."""
    rec, _ = sample_init()
    prints = []
    for path, base, count in _leaves(el.ENGINE_INIT_DTYPE):
        assert base.kind in "iu", f"{path}: print floats some other way"
        fmt, cast = (("%lld", "(long long)") if base.kind == "i"
                     else ("%llu", "(unsigned long long)"))
        if count:
            prints.append(f'for (int i = 0; i < {count}; ++i) printf("{path}[%d]={fmt}\\n", i, '
                          f"{cast}(uintptr_t)init.{path}[i]);")
        else:
            prints.append(f'printf("{path}={fmt}\\n", {cast}(uintptr_t)init.{path});')
    src = tmp_path / "read_init.cc"
    src.write_text("#include <stdio.h>\n#include <string.h>\n#include \"engine_layout.h\"\n"
                   "int main() {\n  blink::engine::EngineInit init;\n"
                   "  if (fread(&init, 1, sizeof init, stdin) != sizeof init) return 1;\n  "
                   + "\n  ".join(prints) + "\n  return 0;\n}\n")
    exe = tmp_path / "read_init"
    subprocess.run(["g++", "-std=c++17", "-Wall", "-Werror", f"-I{CSRC}", str(src), "-o",
                    str(exe)], check=True, capture_output=True, text=True)
    r = subprocess.run([str(exe)], input=rec.tobytes(), capture_output=True, check=True)
    assert r.stdout.decode().splitlines() == _python_values(rec)


def test_init_record_refuses_what_the_kernel_cannot_hold():
    _, a = sample_init()
    with pytest.raises(ValueError, match="buckets"):
        el.engine_init_record(**dict(a, graph_execs={b + 1: b for b in range(el.MAX_BUCKETS + 1)}))
    with pytest.raises(ValueError, match="EOS"):
        el.engine_init_record(**dict(a, eos_ids=list(range(MAX_EOS_IDS + 1))))
    missing = dict(a["forward_pointers"])
    missing.pop("sampled")
    with pytest.raises(ValueError, match="forward pointers"):
        el.engine_init_record(**dict(a, forward_pointers=missing))
    with pytest.raises(ValueError, match="SchedConfig"):
        el.sched_config(num_slots=1)
    with pytest.raises(ValueError, match="buckets"):
        el.engine_init_record(**dict(a, graph_execs={}))
    for step_log, capacity in ((0, 4096), (0x7200_0000_0500, 0)):
        with pytest.raises(ValueError, match="step log"):
            el.engine_init_record(**dict(a, step_log=step_log, step_log_capacity=capacity))
    # the limits themselves are held
    most = el.engine_init_record(**dict(a, graph_execs={b + 1: b for b in range(el.MAX_BUCKETS)},
                                        eos_ids=list(range(MAX_EOS_IDS))))
    assert int(most["fwd"]["num_buckets"]) == el.MAX_BUCKETS
    assert most["fwd"]["bucket_tokens"].tolist() == list(range(1, el.MAX_BUCKETS + 1))
    assert int(most["num_eos"]) == MAX_EOS_IDS
    assert most["eos_ids"].tolist() == list(range(MAX_EOS_IDS))
    none = el.engine_init_record(**dict(a, step_log=0, step_log_capacity=0))
    assert int(none["step_log"]) == int(none["step_log_capacity"]) == 0


def test_default_buckets():
    """Powers of two, then four an octave (two where four would pass MAX_BUCKETS), the cap
    last; fine_from moves where the octaves split."""
    assert el.default_buckets(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert el.default_buckets(512) == [1, 2, 4, 8, 16, 32, 64, 128, 160, 192, 224, 256,
                                          320, 384, 448, 512]
    assert el.default_buckets(200, fine_from=64) == [1, 2, 4, 8, 16, 32, 64, 80, 96, 112,
                                                        128, 160, 192, 200]
    assert el.default_buckets(2048, fine_from=64)[6:11] == [64, 80, 96, 112, 128]
    assert len(el.default_buckets(2048, fine_from=64)) == 27
    assert el.default_buckets(1 << 16)[-3:] == [32768, 49152, 65536]  # two an octave
    with pytest.raises(ValueError):
        el.default_buckets(256, fine_from=2)
    # four an octave while they and the cap fit MAX_BUCKETS: 1 to 128 are 8, 160 to 7168 are 23,
    # and the cap 8192 the 32nd; a cap one token more needs a 33rd, so two an octave
    assert len(el.default_buckets(8192)) == el.MAX_BUCKETS
    assert el.default_buckets(8192)[-3:] == [6144, 7168, 8192]
    assert el.default_buckets(8193)[-3:] == [6144, 8192, 8193]


def test_kernel_limits_are_the_sources_own():
    """The limits cuda_engine_refusal checks before anything loads, as the kernels state them
    (a kernel that changes its limit without engine_layout fails here)."""
    text = {name: (CSRC / name).read_text() for name in
            ("forward_kernels.cu", "attention_common.cuh", "scheduler.cuh")}
    assert re.search(r"static_assert\(BLINK_HEAD_DIM % 16 == 0 && BLINK_HEAD_DIM >= 16 && "
                     r"BLINK_HEAD_DIM <= 256", text["forward_kernels.cu"])
    assert list(el.HEAD_DIMS) == list(range(16, 257, 16))
    assert re.search(rf"static constexpr int kAttnRows = {el.MAX_GQA_GROUP};",
                     text["attention_common.cuh"])
    assert re.search(rf"#define BLINK_SCHED_MAX_STEP_SEQS {el.MAX_STEP_SEQS}\b",
                     text["scheduler.cuh"])


def test_cuda_engine_refusal_says_what_the_kernels_cannot_serve():
    """Each shape and flag the CUDA engines cannot serve is one line before a weight is read
    (each used to fail after the weights were up, or at a compile: a GPU other than Hopper,
    head_dim 72, 128 query heads on one KV head, ...); Llama-3.1-8B on an H200 is served."""
    import dataclasses

    from blink.gpu_engine.bench_decode import SHAPES
    llama = SHAPES["llama-3.1-8b"]
    ok = dict(kind="cuda", quantization=None, kv_cache_dtype="auto", max_num_seqs=256,
              slots=512, sm_count_target=None, compute_capability=(9, 0), sm_count=132)
    assert el.cuda_engine_refusal(llama, **ok) is None
    assert el.cuda_engine_refusal(llama, **dict(ok, quantization="fp8",
                                                kv_cache_dtype="fp8")) is None
    shape = dataclasses.replace
    for cfg, flags, said in (
            (llama, dict(compute_capability=(8, 0)), "need compute capability 9.0"),
            (llama, dict(compute_capability=(10, 0)), "this GPU is 10.0"),
            (shape(llama, head_dim=72), {}, "head_dim 72"),
            (shape(llama, head_dim=96), dict(kv_cache_dtype="fp8"), "head_dim 64 or 128"),
            (shape(llama, num_heads=128, num_kv_heads=1), {}, "at most 64 query heads"),
            (shape(llama, hidden_size=4100), {}, "multiples of 8 and 16"),
            (shape(llama, intermediate_size=14352), dict(quantization="fp8"),
             "multiples of 64"),
            (llama, dict(max_num_seqs=512), "at most 256"),
            (llama, dict(slots=2048), "at most 1024"),
            (llama, dict(sm_count_target=133), "this GPU has 132 SMs"),
            (llama, dict(sm_count_target=-1), "this GPU has 132 SMs"),
            (shape(llama, hidden_size=4104, intermediate_size=14344), {}, "multiples of 8 and 16"),
            (shape(llama, num_heads=10, num_kv_heads=2, head_dim=80), dict(quantization="fp8"),
             "q (800)")):
        assert said in el.cuda_engine_refusal(cfg, **dict(ok, **flags)), (cfg, flags)
    # and what they can, at each limit: a flag's check only where that flag asks for it
    for cfg, flags in (
            (shape(llama, num_heads=64, num_kv_heads=1), {}),
            (shape(llama, hidden_size=4104), {}),
            (shape(llama, head_dim=96), {}),
            (shape(llama, intermediate_size=14352), {}),
            (llama, dict(slots=el.MAX_SLOTS)),
            (llama, dict(sm_count_target=132)),
            (llama, dict(sm_count_target=0))):  # 0: the device's own
        assert el.cuda_engine_refusal(cfg, **dict(ok, **flags)) is None, (cfg, flags)
    # the host-driven engine has no scheduler kernel: its step and slot limits are not these
    assert el.cuda_engine_refusal(llama, **dict(ok, kind="host-cuda", max_num_seqs=512,
                                                slots=2048)) is None


# The weights' layouts the GPU kernels read, from their definitions: pure NumPy, so on every
# CPU run (under test_cuda_forward.py's GPU mark they had no check without a GPU, and the CPU
# test of stored_fp8 builds its expectation with these same functions: a review's mutants of
# either survived)

def test_interleave_gate_up_layout():
    from blink.gpu_engine.weight_layout import interleave_gate_up
    gate = np.arange(32 * 3, dtype=np.float32).reshape(32, 3)
    up = -gate
    w = interleave_gate_up(gate, up)
    np.testing.assert_array_equal(w[:16], gate[:16])
    np.testing.assert_array_equal(w[16:32], up[:16])
    np.testing.assert_array_equal(w[32:48], gate[16:])
    np.testing.assert_array_equal(w[48:], up[16:])


def test_rope_pair_order():
    """q and k heads: pair j's rows 8 apart inside one 16-row tile; v heads unchanged."""
    from blink.gpu_engine.weight_layout import rope_pair_order
    order = rope_pair_order(2, 1, 32)
    assert sorted(order) == list(range(4 * 32))
    head = order[:32]
    assert list(head[:16]) == list(range(8)) + list(range(16, 24))
    assert list(head[16:]) == list(range(8, 16)) + list(range(24, 32))
    assert list(order[64:96]) == [64 + i for i in head]          # the k head likewise
    assert list(order[96:]) == list(range(96, 128))               # v as it was
