// Hopper's warpgroup MMAs (wgmma, sm_90a) as the attention query tiles use them: D (+)= A B with
// A, 64 rows x 16 k, from registers and B, 16 k x N, from shared memory through a matrix
// descriptor; fp32 accumulators. The four warps of a warpgroup issue each one together; warp w
// holds rows 16 w .. 16 w + 15 of A and D, in mma.sync m16n8k16's fragment layouts: lane
// (g = lane / 4, t = lane % 4) holds A's rows g and g + 8 (a[0], a[1]: k 2 t, 2 t + 1; a[2],
// a[3]: k 2 t + 8, + 9) and D's 8-column tile j as d[j][0..3] (rows g, g + 8; columns 8 j + 2 t,
// + 1), so that a score tile's C fragments are already the next MMA's A (FlashAttention-3).
// The MMAs run asynchronously: WgmmaFence before the first of a batch (its registers were
// written by ordinary instructions), WgmmaCommit after the last, WgmmaWait<0> before the
// results are read, and WgmmaFenceOperands around them so that the compiler moves no read or
// write of the accumulators across. Only sm_90a has wgmma: elsewhere (a module built for
// another GPU) kWgmmaAvailable is false, the host never picks a kernel that uses them, and
// these helpers trap.
#pragma once
#include <cstdint>

#include "utils.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define BLINK_WGMMA_ASM(...) asm volatile(__VA_ARGS__)
#else
#define BLINK_WGMMA_ASM(...) __trap()
#endif

namespace blink {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
inline constexpr bool kWgmmaAvailable = true;
#else
inline constexpr bool kWgmmaAvailable = false;
#endif

// A shared-memory descriptor for B in 128-byte swizzled rows (PTX ISA, "matrix descriptor"):
// 16-byte piece c of a 128-byte row r sits at c XOR (r mod 8), the pattern repeating every 1,024
// bytes (the tile's base 1,024-byte aligned). `stride_bytes`: from one 8-row group to the next;
// `leading_bytes`: unused for K-major B (N rows of 128 bytes of K, an MMA's 16 k inside a row),
// for MN-major B (K rows of 64 N values, kTransposeB) from one 64-column block of N to the next.
__device__ __forceinline__ uint64_t WgmmaDescriptor(const void* smem, uint32_t leading_bytes,
                                                    uint32_t stride_bytes) {
  return static_cast<uint64_t>((SharedAddress(smem) & 0x3FFFF) >> 4) |
         static_cast<uint64_t>(leading_bytes >> 4) << 16 |
         static_cast<uint64_t>(stride_bytes >> 4) << 32 | 1ull << 62;  // 1: 128-byte swizzle
}

__device__ __forceinline__ void WgmmaFence() {
  BLINK_WGMMA_ASM("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  BLINK_WGMMA_ASM("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kInFlight>
__device__ __forceinline__ void WgmmaWait() {
  BLINK_WGMMA_ASM("wgmma.wait_group.sync.aligned %0;" ::"n"(kInFlight) : "memory");
}
// (accumulators: float; A fragments: 32-bit registers)
template <int kRows, int kCols>
__device__ __forceinline__ void WgmmaFenceOperands(float (&d)[kRows][kCols]) {
#pragma unroll
  for (int j = 0; j < kRows; ++j)
#pragma unroll
    for (int e = 0; e < kCols; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}
template <int kRows, int kCols>
__device__ __forceinline__ void WgmmaFenceOperands(uint32_t (&a)[kRows][kCols]) {
#pragma unroll
  for (int j = 0; j < kRows; ++j)
#pragma unroll
    for (int e = 0; e < kCols; ++e) asm volatile("" : "+r"(a[j][e])::"memory");
}

// Shared memory written by ordinary stores or cp.async, made visible to the wgmmas that will
// read it (the async proxy); a barrier then covers the other threads' writes.
__device__ __forceinline__ void FenceSharedForWgmma() {
  BLINK_WGMMA_ASM("fence.proxy.async.shared::cta;" ::: "memory");
}

// The accumulators' operand lists: 32 registers (N = 64), 64 (N = 128).
#define BLINK_WGMMA_D32 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"

#define BLINK_WGMMA_D32_OPERANDS \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), \
  "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), \
  "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), \
  "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), \
  "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), \
  "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), \
  "+f"(d[7][2]), "+f"(d[7][3])

#define BLINK_WGMMA_D64 \
  BLINK_WGMMA_D32 ", " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

#define BLINK_WGMMA_D64_OPERANDS \
  BLINK_WGMMA_D32_OPERANDS, \
  "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), \
  "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), \
  "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), \
  "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), \
  "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), \
  "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), \
  "+f"(d[15][2]), "+f"(d[15][3])

// One wgmma: SHAPE and TYPE strings, the accumulators' register list and operands, the
// operand numbers of A's four registers, B's descriptor, the accumulate flag and tnsp-b.
#define BLINK_WGMMA_RS(SHAPE, TYPE, REGS, OPERANDS, A, DESC, ACC, TNSP)                      \
  BLINK_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, " ACC ", 0;\n"                            \
                  "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " {" REGS     \
                  "}, {" A "}, " DESC ", p, 1, 1, " TNSP ";\n}\n"                          \
                  : OPERANDS                                                                \
                  : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc),               \
                    "r"(accumulate), "n"(kTransposeB))
#define BLINK_WGMMA_N64(TYPE)                                                                \
  BLINK_WGMMA_RS("m64n64k16", TYPE, BLINK_WGMMA_D32, BLINK_WGMMA_D32_OPERANDS,               \
                 "%32, %33, %34, %35", "%36", "%37", "%38")
#define BLINK_WGMMA_N128(TYPE)                                                               \
  BLINK_WGMMA_RS("m64n128k16", TYPE, BLINK_WGMMA_D64, BLINK_WGMMA_D64_OPERANDS,              \
                 "%64, %65, %66, %67", "%68", "%69", "%70")

// D (+)= A B, one wgmma m64nNk16 (N = 8 kTiles: 64 or 128) with A from registers and B by
// descriptor (kTransposeB 1: MN-major); f16 (kF16) or bf16 inputs; accumulate 0 overwrites D.
template <int kTiles, bool kF16, int kTransposeB>
__device__ __forceinline__ void WgmmaRs(float (&d)[kTiles][4], const uint32_t (&a)[4],
                                        uint64_t b_desc, int accumulate) {
  static_assert(kTiles == 8 || kTiles == 16, "N = 64 or 128");
  if constexpr (kTiles == 8 && kF16) {
    BLINK_WGMMA_N64("f16");
  } else if constexpr (kTiles == 8) {
    BLINK_WGMMA_N64("bf16");
  } else if constexpr (kF16) {
    BLINK_WGMMA_N128("f16");
  } else {
    BLINK_WGMMA_N128("bf16");
  }
}

#undef BLINK_WGMMA_N64
#undef BLINK_WGMMA_N128
#undef BLINK_WGMMA_ASM
#undef BLINK_WGMMA_RS
#undef BLINK_WGMMA_D32
#undef BLINK_WGMMA_D32_OPERANDS
#undef BLINK_WGMMA_D64
#undef BLINK_WGMMA_D64_OPERANDS

}  // namespace blink
