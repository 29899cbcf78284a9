// Entry points of the forward pass, one extern "C" __global__ shell per op, loaded by name from
// the cubin by gpu_engine/cuda_forward.py (which computes each grid and validates the sizes).
//
// Every entry first waits for the previous kernel (utils.cuh AwaitPriorKernel): the forward
// graph is captured with programmatic dependent launch, so an entry may start early. The skinny
// projections wait inside SkinnyAccumulate, once their first weight loads are in flight; the
// attention entries inside AttentionCta, once the batch arrays (and a decode token's first keys
// from earlier steps) are loaded.
//
// One dispatch point: the model's head_dim arrives as -DBLINK_HEAD_DIM=<d> (the module is built
// per model); an unsupported value stops the build here. So does the KV cache's element
// (-DBLINK_KV_FP8=1: E4M3, kv_cache.cuh), which every kernel that reads or writes the cache
// takes as Kv.
#include "activation.cuh"
#include "attention.cuh"
#include "batch.cuh"
#include "embedding.cuh"
#include "engine_layout.h"
#include "gemv.cuh"
#include "gemv_chain.cuh"
#include "kv_cache.cuh"
#include "norm.cuh"
#include "quantize.cuh"
#include "rope.cuh"
#include "sampling.cuh"

#include <utility>

#ifndef BLINK_HEAD_DIM
#error "build with -DBLINK_HEAD_DIM=<head_dim>"
#endif
static_assert(BLINK_HEAD_DIM % 16 == 0 && BLINK_HEAD_DIM >= 16 && BLINK_HEAD_DIM <= 256,
              "head_dim must be a multiple of 16 in [16, 256]");

using blink::BatchDesc;
using blink::bf16;
using blink::fp8;
using Kv = blink::KvCache;
using KvElement = Kv::Element;
static constexpr int kHeadDim = BLINK_HEAD_DIM;
static constexpr int kAttnWideWarps = blink::kAttnWideWarps<kHeadDim>;
static constexpr int kAttnWgmmaWarps = blink::kAttnWgmmaWarps<kHeadDim>;
static constexpr int kAttnWgmmaRows = blink::kAttnWgmmaRows<kHeadDim>;

// Launch constants the host reads back (cuModuleGetGlobal), so they are written once, here.
extern "C" __device__ const uint32_t blink_head_dim = kHeadDim;
extern "C" __device__ const uint32_t blink_kv_fp8 = Kv::kFp8;
extern "C" __device__ const uint32_t blink_rope_threads = blink::kRopeThreads;
extern "C" __device__ const uint32_t blink_attention_threads = blink::kAttnThreads;
extern "C" __device__ const uint32_t blink_attention_rows = blink::kAttnRows;
extern "C" __device__ const uint32_t blink_attention_smem_bytes =
    blink::AttentionKernelSmem<kHeadDim, blink::kAttnRows, blink::kAttnWarps, Kv::kFp8>();
// the wgmma kernel (prefill-sized buckets)
extern "C" __device__ const uint32_t blink_attention_wgmma_threads =
    kAttnWgmmaWarps * blink::kWarpSize;
extern "C" __device__ const uint32_t blink_attention_wgmma_rows = kAttnWgmmaRows;
extern "C" __device__ const uint32_t blink_attention_wgmma_smem_bytes =
    blink::AttentionKernelSmem<kHeadDim, kAttnWgmmaRows, kAttnWgmmaWarps, Kv::kFp8>();
// 0 where the wgmma entries do not run their tiles on wgmma: a module built for a GPU without
// it (anything but sm_90a: they trap), or a head dim on the WMMA tiles; the host never takes them
extern "C" __device__ const uint32_t blink_attention_wgmma_available =
    blink::kWgmmaAvailable && blink::TileUsesWgmma<kAttnWgmmaRows, kAttnWgmmaWarps>();
extern "C" __device__ const uint32_t blink_attention_small_rows = blink::kAttnRowsSmall;
extern "C" __device__ const uint32_t blink_attention_small_smem_bytes =
    blink::AttentionKernelSmem<kHeadDim, blink::kAttnRowsSmall, blink::kAttnWarps, Kv::kFp8>();
// the wide kernel (small query tiles; as many threads as the others where the head dim takes
// the WMMA tiles, and then never chosen)
extern "C" __device__ const uint32_t blink_attention_wide_threads =
    kAttnWideWarps * blink::kWarpSize;
extern "C" __device__ const uint32_t blink_attention_wide_smem_bytes =
    blink::AttentionKernelSmem<kHeadDim, blink::kAttnRowsSmall, kAttnWideWarps, Kv::kFp8>();
extern "C" __device__ const uint32_t blink_sample_threads = blink::kSampleThreads;
extern "C" __device__ const uint32_t blink_attention_max_splits = blink::kDecodeMaxSplits;
// block sizes that are multiples of it take the attention kernels without _any_block
extern "C" __device__ const uint32_t blink_attention_step_keys = blink::kMmaKeys;
extern "C" __device__ const uint32_t blink_gemv_threads = blink::kGemvThreads;
extern "C" __device__ const uint32_t blink_chain_smem_bytes = blink::kChainSmemBytes;
extern "C" __device__ const uint32_t blink_chain_max_k = blink::kChainMaxK;
extern "C" __device__ const uint32_t blink_chain_ring_bytes = blink::kChainRingBytes;
extern "C" __device__ const uint32_t blink_chain_counters_bytes = sizeof(blink::ChainCounters);
extern "C" __device__ const uint32_t blink_chain_threads = blink::kChainThreads;
extern "C" __device__ const uint32_t blink_chain_projection_bytes =
    sizeof(blink::ChainProjection);
extern "C" __device__ const uint32_t blink_rowblock_chunk = blink::kRowBlockChunk;
extern "C" __device__ const uint32_t blink_rowblock_smem_bytes = blink::kRowBlockSmemBytes;
extern "C" __device__ const uint32_t blink_splitk_threads = blink::kSplitKThreads;
extern "C" __device__ const uint32_t blink_splitk_rows = blink::kSplitKRows;
extern "C" __device__ const uint32_t blink_splitk_cols = blink::kSplitKCols;
extern "C" __device__ const uint32_t blink_splitk_chunk_align = blink::kSplitKChunkAlign;
extern "C" __device__ const uint32_t blink_splitk_max_chunk = blink::kSplitKMaxChunk;
// SplitKSmemBytes of each chunk, c * kSplitKChunkAlign columns at index c - 1
template <int... kIndex>
struct SplitKSmemTable {
  uint32_t bytes[sizeof...(kIndex)] = {blink::SplitKSmemBytes((kIndex + 1) *
                                                              blink::kSplitKChunkAlign)...};
};
template <int... kIndex>
constexpr SplitKSmemTable<kIndex...> MakeSplitKSmemTable(std::integer_sequence<int, kIndex...>) {
  return {};
}
extern "C" __device__ const auto blink_splitk_smem_bytes = MakeSplitKSmemTable(
    std::make_integer_sequence<int, blink::kSplitKMaxChunk / blink::kSplitKChunkAlign>());

extern "C" {

__global__ void __launch_bounds__(256)
    blink_embedding(const BatchDesc* desc, const int32_t* token_ids, const bf16* embed, float* x,
                    bf16* x_shadow, int hidden, int vocab) {
  blink::AwaitPriorKernel();
  blink::EmbeddingCta(desc, token_ids, embed, x, x_shadow, hidden, vocab);
}

// The same, writing x_f16 too: the first layer's FP8 qkv kernel's input, times norm_w
// (EmbeddingCta; CudaForward's fp8_x_f16), and x_sumsq where not null (its fp8_x_sumsq).
__global__ void __launch_bounds__(256)
    blink_embedding_xf16(const BatchDesc* desc, const int32_t* token_ids, const bf16* embed,
                         float* x, bf16* x_shadow, int hidden, int vocab, __half* x_f16,
                         const bf16* norm_w, float* x_sumsq) {
  blink::AwaitPriorKernel();
  blink::EmbeddingCta(desc, token_ids, embed, x, x_shadow, hidden, vocab, x_f16, norm_w,
                      x_sumsq);
}

// release_next: the next kernel may launch as soon as this one has waited for its predecessor.
// The norm's grid is one CTA a row (32 where it runs between two projections of a 17..32-row
// step), so the next projection's CTAs take the idle SMs and issue their first weight loads
// while it runs; they read its output only after their own wait. Measured on the H200
// (bench_decode, against release at the end in the same call): 1B 24 x 512 1.138 -> 1.123 ms,
// 32 x 512 1.187 -> 1.174; 8B 24 x 512 5.186 -> 5.156, 32 x 4096 8.684 -> 8.647, 32 x 512 the
// same (5.128, 5.134; power-capped).
__global__ void __launch_bounds__(256)
    blink_rms_norm(const BatchDesc* desc, const int32_t* gather, int max_rows, float* x,
                   const bf16* bias, const bf16* weight, bf16* out, int hidden, float eps,
                   int release_next) {
  blink::AwaitPriorKernel();
  if (release_next) blink::ReleaseNextKernel();
  blink::RmsNormCta(desc, gather, max_rows, x, bias, weight, out, hidden, eps);
}

// The same, writing out's f16 form to x_f16 too, for the FP8 LM head (CudaForward's fp8_x_f16).
__global__ void __launch_bounds__(256)
    blink_rms_norm_xf16(const BatchDesc* desc, const int32_t* gather, int max_rows, float* x,
                        const bf16* bias, const bf16* weight, bf16* out, int hidden, float eps,
                        int release_next, __half* x_f16) {
  blink::AwaitPriorKernel();
  if (release_next) blink::ReleaseNextKernel();
  blink::RmsNormCta(desc, gather, max_rows, x, bias, weight, out, hidden, eps, x_f16);
}

// kv_scales: the layer's (an E4M3 cache), kv_amax: its calibration's maxima, or null.
// release_next: attention, the kernel after this one, may launch once every CTA of this grid has
// started (so once the whole grid is placed: attention's CTAs take only the SMs' room left),
// and run its prologue (the batch arrays, its query tile's search) before its own wait.
__global__ void __launch_bounds__(blink::kRopeThreads)
    blink_rope_kv_write(const BatchDesc* desc, const int32_t* positions, const int32_t* token_seq,
                        const int32_t* block_tables, int max_blocks_per_seq, const bf16* qkv,
                        const bf16* qkv_bias, const bf16* q_norm, const bf16* k_norm, float eps,
                        const float* inv_freq, int num_heads, int num_kv_heads, bf16* q_out,
                        KvElement* k_cache, KvElement* v_cache, int block_size, int num_blocks,
                        const float* kv_scales, float* kv_amax, int release_next) {
  blink::AwaitPriorKernel();
  if (release_next) blink::ReleaseNextKernel();
  blink::RopeKvWriteCta<kHeadDim, Kv>(desc, positions, token_seq, block_tables,
                                      max_blocks_per_seq, qkv, qkv_bias, q_norm, k_norm, eps,
                                      inv_freq, num_heads, num_kv_heads, q_out, k_cache,
                                      v_cache, block_size, num_blocks, kv_scales, kv_amax);
}

// The attention entries, with query tiles of kAttnRows or kAttnRowsSmall rows (and kAttnWideWarps
// warps: _wide), for block sizes that are multiples of 16 and (_any_block) for the others
// (attention.cuh AttentionCta).
// _roomy: the large tiles' kernel compiled for fewer CTAs an SM (kAttnRoomyMinCtas: more
// registers a thread), for the short chunks' buckets where CudaForward's
// attention_roomy_max_bucket asks for it.
// release_next: the next kernel may launch at once (the host sets it where that is a skinny or
// split-K projection, which loads its first weights and then waits; utils.cuh).
#define BLINK_PAGED_ATTENTION(NAME, ROWS, STEP_IN_ONE_BLOCK, WARPS, MIN_CTAS)                \
  __global__ void __launch_bounds__(WARPS * blink::kWarpSize, MIN_CTAS)                      \
      NAME(const BatchDesc* desc, const int32_t* positions, const int32_t* token_seq,        \
           const int32_t* block_tables, int max_blocks_per_seq, const bf16* q,               \
           const KvElement* k_cache, const KvElement* v_cache, int block_size,               \
           int num_heads, int num_kv_heads, float scale, bf16* out, int num_splits,          \
           int split_stride, float* partial_out, float* partial_stats, uint32_t* tile_sems,  \
           int decode_min_keys, int slots, int release_next, const float* kv_scales) {       \
    if (release_next) blink::ReleaseNextKernel();                                            \
    blink::AttentionCta<kHeadDim, ROWS, STEP_IN_ONE_BLOCK, WARPS, Kv>(/* it waits for the  \
        previous kernel */ desc, positions, token_seq, block_tables, max_blocks_per_seq, q,  \
        k_cache, v_cache, block_size, num_heads, num_kv_heads, scale, out, num_splits,       \
        split_stride, partial_out, partial_stats, tile_sems, decode_min_keys, slots,         \
        kv_scales);                                                                          \
  }
static constexpr int kAttnCtas = blink::kAttnMinCtas<kHeadDim, blink::kAttnWarps>;
static constexpr int kAttnWideCtas = blink::kAttnMinCtas<kHeadDim, kAttnWideWarps>;
static constexpr int kAttnWgmmaCtas = blink::kAttnMinCtas<kHeadDim, kAttnWgmmaWarps>;
static constexpr int kAttnRoomyCtas = blink::kAttnRoomyMinCtas<kHeadDim, blink::kAttnWarps>;
// (the block layouts: a warp step's keys in one block, or any block size)
#define BLINK_PAGED_ATTENTION_LAYOUTS(NAME, ROWS, WARPS, MIN_CTAS)                           \
  BLINK_PAGED_ATTENTION(NAME, ROWS, true, WARPS, MIN_CTAS)                                   \
  BLINK_PAGED_ATTENTION(NAME##_any_block, ROWS, false, WARPS, MIN_CTAS)
BLINK_PAGED_ATTENTION_LAYOUTS(blink_paged_attention, blink::kAttnRows, blink::kAttnWarps,
                              kAttnCtas)
BLINK_PAGED_ATTENTION_LAYOUTS(blink_paged_attention_small, blink::kAttnRowsSmall,
                              blink::kAttnWarps, kAttnCtas)
BLINK_PAGED_ATTENTION_LAYOUTS(blink_paged_attention_small_wide, blink::kAttnRowsSmall,
                              kAttnWideWarps, kAttnWideCtas)
BLINK_PAGED_ATTENTION_LAYOUTS(blink_paged_attention_wgmma, kAttnWgmmaRows, kAttnWgmmaWarps,
                              kAttnWgmmaCtas)
BLINK_PAGED_ATTENTION_LAYOUTS(blink_paged_attention_roomy, blink::kAttnRows, blink::kAttnWarps,
                              kAttnRoomyCtas)
#undef BLINK_PAGED_ATTENTION_LAYOUTS
#undef BLINK_PAGED_ATTENTION

// Skinny linear layers (gemv.cuh), one entry per (row tiles, column tiles) shape; the _norm
// entries take the residual stream's bf16 shadow and fold its RMSNorm in (decode-sized buckets:
// one or two column tiles). The qkv_rope entries also apply RoPE and write q and the KV cache
// (rope.cuh SkinnyQkvRopeCta): qkv_rope_norm with the RMSNorm folded in (up to 16 rows),
// qkv_rope after the RMSNorm kernel (17 to 32 rows: four column tiles; one signature for
// both, eps unused there). _k2: K split across clusters of two CTAs (SkinnyAccumulate's
// kSplits), for projections of fewer row blocks than SMs. argmax (the plain entries): the LM
// head's per-row greedy argmax words (SkinnyStore), or null.
// _fp8: FP8 weights (--quantization fp8; gemv.cuh Fp8Weights): E4M3 codes, w_scale their
// rows' scales; norm_w the RMSNorm's weight (_norm, qkv_rope_norm: FP8 weights do not fold it
// in). Decode-sized buckets only (up to 16 rows): larger steps run the FP8 GEMMs. _fp8_xf16: x's
// f16 form given (x_f16: one column tile, gemv.cuh kXF16), written by the kernel before; the
// FP8 linear entries write the next projection's (x_f16_out: the shadow's times x_f16_norm_w
// with the residual add, SiLU * up's as it is), where not null. CudaForward's fp8_x_f16.
// _xf16sq: the same, with x's sums of squares handed over in parts too (gemv.cuh
// GemvSquareParts): the normalizing entries take them (x_sumsq) and do not read x, the
// residual-adding ones write them (x_sumsq_out). CudaForward's fp8_x_sumsq.
#define BLINK_CLUSTER_OF_1
#define BLINK_CLUSTER_OF_2 __cluster_dims__(2, 1, 1)
#define BLINK_CLUSTER_OF_4 __cluster_dims__(4, 1, 1)
#define BLINK_SKINNY_LINEAR(NAME, A, C, SPLITS)                                              \
  __global__ void BLINK_CLUSTER_OF_##SPLITS                                                  \
  __launch_bounds__(blink::kGemvThreads, blink::kGemvMinCtas)                                \
      NAME(const bf16* x, int ldx, int M, const bf16* w, uint32_t w_tile_stride, int N,      \
           int K, void* out, int ldo, int mode, bf16* shadow, unsigned long long* argmax) {  \
    blink::SkinnyLinearCta<A, C, false, SPLITS>(x, ldx, M, w, w_tile_stride, N, K, out, ldo, \
                                                mode, shadow, 0.f, argmax);                  \
  }
BLINK_SKINNY_LINEAR(blink_skinny_linear_1x1, 1, 1, 1)
BLINK_SKINNY_LINEAR(blink_skinny_linear_1x2, 1, 2, 1)
BLINK_SKINNY_LINEAR(blink_skinny_linear_1x4, 1, 4, 1)
BLINK_SKINNY_LINEAR(blink_skinny_linear_2x1, 2, 1, 1)
BLINK_SKINNY_LINEAR(blink_skinny_linear_2x2, 2, 2, 1)
BLINK_SKINNY_LINEAR(blink_skinny_linear_2x4, 2, 4, 1)
BLINK_SKINNY_LINEAR(blink_skinny_linear_1x1_k2, 1, 1, 2)
BLINK_SKINNY_LINEAR(blink_skinny_linear_1x2_k2, 1, 2, 2)
#undef BLINK_SKINNY_LINEAR

#define BLINK_SKINNY_LINEAR_FP8(NAME, A, C, SPLITS)                                          \
  __global__ void BLINK_CLUSTER_OF_##SPLITS                                                  \
  __launch_bounds__(blink::kGemvThreads, blink::kGemvMinCtas)                                \
      NAME(const bf16* x, int ldx, int M, const fp8* w, uint32_t w_tile_stride, int N, int K, \
           void* out, int ldo, int mode, bf16* shadow, unsigned long long* argmax,           \
           const float* w_scale) {                                                           \
    blink::SkinnyLinearCta<A, C, false, SPLITS, blink::Fp8Weights>(                          \
        x, ldx, M, w, w_tile_stride, N, K, out, ldo, mode, shadow, 0.f, argmax, w_scale);    \
  }
BLINK_SKINNY_LINEAR_FP8(blink_skinny_linear_fp8_1x1, 1, 1, 1)
BLINK_SKINNY_LINEAR_FP8(blink_skinny_linear_fp8_1x2, 1, 2, 1)
BLINK_SKINNY_LINEAR_FP8(blink_skinny_linear_fp8_2x1, 2, 1, 1)
BLINK_SKINNY_LINEAR_FP8(blink_skinny_linear_fp8_2x2, 2, 2, 1)
BLINK_SKINNY_LINEAR_FP8(blink_skinny_linear_fp8_1x1_k2, 1, 1, 2)
BLINK_SKINNY_LINEAR_FP8(blink_skinny_linear_fp8_1x2_k2, 1, 2, 2)
#undef BLINK_SKINNY_LINEAR_FP8

// _xf16: x's f16 form in (x_f16) and the next projection's out (down); _xf16out: only out (o,
// whose x, attention's output, comes as stored); _xf16sq, _xf16sqout: the same, writing the
// shadow's sums of squares too (x_sumsq_out; unused by the others).
#define BLINK_SKINNY_LINEAR_FP8_XF16(NAME, A, C, SPLITS, IN, SQ)                             \
  __global__ void BLINK_CLUSTER_OF_##SPLITS                                                  \
  __launch_bounds__(blink::kGemvThreads, blink::kGemvMinCtas)                                \
      NAME(const bf16* x, int ldx, int M, const fp8* w, uint32_t w_tile_stride, int N, int K, \
           void* out, int ldo, int mode, bf16* shadow, unsigned long long* argmax,           \
           const float* w_scale, const __half* x_f16, __half* x_f16_out,                     \
           const bf16* x_f16_norm_w, float* x_sumsq_out) {                                   \
    blink::SkinnyLinearCta<A, C, false, SPLITS, blink::Fp8Weights, IN, true, SQ>(            \
        x, ldx, M, w, w_tile_stride, N, K, out, ldo, mode, shadow, 0.f, argmax, w_scale,     \
        nullptr, x_f16, x_f16_out, x_f16_norm_w, nullptr, x_sumsq_out);                      \
  }
BLINK_SKINNY_LINEAR_FP8_XF16(blink_skinny_linear_fp8_xf16_1x1, 1, 1, 1, true, false)
BLINK_SKINNY_LINEAR_FP8_XF16(blink_skinny_linear_fp8_xf16_2x1, 2, 1, 1, true, false)
BLINK_SKINNY_LINEAR_FP8_XF16(blink_skinny_linear_fp8_xf16_1x1_k2, 1, 1, 2, true, false)
BLINK_SKINNY_LINEAR_FP8_XF16(blink_skinny_linear_fp8_xf16out_1x1, 1, 1, 1, false, false)
BLINK_SKINNY_LINEAR_FP8_XF16(blink_skinny_linear_fp8_xf16out_2x1, 2, 1, 1, false, false)
BLINK_SKINNY_LINEAR_FP8_XF16(blink_skinny_linear_fp8_xf16out_1x1_k2, 1, 1, 2, false, false)
BLINK_SKINNY_LINEAR_FP8_XF16(blink_skinny_linear_fp8_xf16sq_1x1, 1, 1, 1, true, true)
BLINK_SKINNY_LINEAR_FP8_XF16(blink_skinny_linear_fp8_xf16sq_2x1, 2, 1, 1, true, true)
BLINK_SKINNY_LINEAR_FP8_XF16(blink_skinny_linear_fp8_xf16sq_1x1_k2, 1, 1, 2, true, true)
BLINK_SKINNY_LINEAR_FP8_XF16(blink_skinny_linear_fp8_xf16sqout_1x1, 1, 1, 1, false, true)
BLINK_SKINNY_LINEAR_FP8_XF16(blink_skinny_linear_fp8_xf16sqout_2x1, 2, 1, 1, false, true)
BLINK_SKINNY_LINEAR_FP8_XF16(blink_skinny_linear_fp8_xf16sqout_1x1_k2, 1, 1, 2, false, true)
#undef BLINK_SKINNY_LINEAR_FP8_XF16

// bf16 weights (a projection an FP8 checkpoint keeps in bf16, beside FP8 ones) writing the next
// FP8 projection's f16 form of x (x_f16_out: the shadow's times x_f16_norm_w with the residual
// add, and its sums of squares with _xf16sqout) as the FP8 entries do; x_f16 is unused (null).
#define BLINK_SKINNY_LINEAR_XF16OUT(NAME, A, C, SPLITS, SQ)                                  \
  __global__ void BLINK_CLUSTER_OF_##SPLITS                                                  \
  __launch_bounds__(blink::kGemvThreads, blink::kGemvMinCtas)                                \
      NAME(const bf16* x, int ldx, int M, const bf16* w, uint32_t w_tile_stride, int N,      \
           int K, void* out, int ldo, int mode, bf16* shadow, unsigned long long* argmax,    \
           const __half* x_f16, __half* x_f16_out, const bf16* x_f16_norm_w,                 \
           float* x_sumsq_out) {                                                             \
    blink::SkinnyLinearCta<A, C, false, SPLITS, blink::Bf16Weights, false, true, SQ>(        \
        x, ldx, M, w, w_tile_stride, N, K, out, ldo, mode, shadow, 0.f, argmax, nullptr,     \
        nullptr, nullptr, x_f16_out, x_f16_norm_w, nullptr, x_sumsq_out);                    \
  }
BLINK_SKINNY_LINEAR_XF16OUT(blink_skinny_linear_xf16out_1x1, 1, 1, 1, false)
BLINK_SKINNY_LINEAR_XF16OUT(blink_skinny_linear_xf16out_2x1, 2, 1, 1, false)
BLINK_SKINNY_LINEAR_XF16OUT(blink_skinny_linear_xf16out_1x1_k2, 1, 1, 2, false)
BLINK_SKINNY_LINEAR_XF16OUT(blink_skinny_linear_xf16sqout_1x1, 1, 1, 1, true)
BLINK_SKINNY_LINEAR_XF16OUT(blink_skinny_linear_xf16sqout_2x1, 2, 1, 1, true)
BLINK_SKINNY_LINEAR_XF16OUT(blink_skinny_linear_xf16sqout_1x1_k2, 1, 1, 2, true)
#undef BLINK_SKINNY_LINEAR_XF16OUT

#define BLINK_SKINNY_NORM_LINEAR(A, C)                                                       \
  __global__ void __launch_bounds__(blink::kGemvThreads, blink::kGemvMinCtas)                \
      blink_skinny_linear_norm_##A##x##C(const bf16* x, int ldx, int M, const bf16* w,       \
                                         uint32_t w_tile_stride, int N, int K, void* out,    \
                                         int ldo, int mode, float eps) {                     \
    blink::SkinnyLinearCta<A, C, true>(x, ldx, M, w, w_tile_stride, N, K, out, ldo, mode,    \
                                       nullptr, eps);                                        \
  }                                                                                          \
  __global__ void __launch_bounds__(blink::kGemvThreads, blink::kGemvMinCtas)                \
      blink_skinny_linear_norm_fp8_##A##x##C(                                                \
          const bf16* x, int ldx, int M, const fp8* w, uint32_t w_tile_stride, int N, int K, \
          void* out, int ldo, int mode, float eps, const float* w_scale,                     \
          const bf16* norm_w) {                                                              \
    blink::SkinnyLinearCta<A, C, true, 1, blink::Fp8Weights>(                                \
        x, ldx, M, w, w_tile_stride, N, K, out, ldo, mode, nullptr, eps, nullptr, w_scale,   \
        norm_w);                                                                             \
  }
BLINK_SKINNY_NORM_LINEAR(1, 1)
BLINK_SKINNY_NORM_LINEAR(2, 1)
BLINK_SKINNY_NORM_LINEAR(1, 2)
BLINK_SKINNY_NORM_LINEAR(2, 2)
#undef BLINK_SKINNY_NORM_LINEAR

// x's f16 form in (x_f16) and SiLU * up's out (gate|up); _xf16sq: x's sums of squares in
// (x_sumsq; unused by the others), x not read.
#define BLINK_SKINNY_NORM_LINEAR_FP8_XF16(IO, A, C, SQ)                                      \
  __global__ void __launch_bounds__(blink::kGemvThreads, blink::kGemvMinCtas)                \
      blink_skinny_linear_norm_fp8_##IO##_##A##x##C(                                         \
          const bf16* x, int ldx, int M, const fp8* w, uint32_t w_tile_stride, int N, int K, \
          void* out, int ldo, int mode, float eps, const float* w_scale,                     \
          const bf16* norm_w, const __half* x_f16, __half* x_f16_out, const float* x_sumsq) { \
    blink::SkinnyLinearCta<A, C, true, 1, blink::Fp8Weights, true, true, SQ>(                \
        x, ldx, M, w, w_tile_stride, N, K, out, ldo, mode, nullptr, eps, nullptr, w_scale,   \
        norm_w, x_f16, x_f16_out, nullptr, x_sumsq);                                         \
  }
BLINK_SKINNY_NORM_LINEAR_FP8_XF16(xf16, 1, 1, false)
BLINK_SKINNY_NORM_LINEAR_FP8_XF16(xf16, 2, 1, false)
BLINK_SKINNY_NORM_LINEAR_FP8_XF16(xf16sq, 1, 1, true)
BLINK_SKINNY_NORM_LINEAR_FP8_XF16(xf16sq, 2, 1, true)
#undef BLINK_SKINNY_NORM_LINEAR_FP8_XF16

// bf16 gate|up (its RMSNorm's weight folded in) writing SiLU * up's f16 form for an FP8 down
// projection (x_f16_out); x_f16 and x_sumsq are unused (null).
__global__ void __launch_bounds__(blink::kGemvThreads, blink::kGemvMinCtas)
    blink_skinny_linear_norm_xf16out_2x1(const bf16* x, int ldx, int M, const bf16* w,
                                         uint32_t w_tile_stride, int N, int K, void* out, int ldo,
                                         int mode, float eps, const __half* x_f16,
                                         __half* x_f16_out, const float* x_sumsq) {
  blink::SkinnyLinearCta<2, 1, true, 1, blink::Bf16Weights, false, true>(
      x, ldx, M, w, w_tile_stride, N, K, out, ldo, mode, nullptr, eps, nullptr, nullptr, nullptr,
      nullptr, x_f16_out);
}

// W: blink::Bf16Weights (w_scale and norm_w unused: null) or blink::Fp8Weights (_fp8 entries).
// release_next: attention, the kernel after this one, may launch once every CTA of this grid
// has started, not once their weights are read (its CTAs then take the slots this grid leaves
// free and load their first keys, earlier steps', while it runs; CudaForward's
// qkv_release_early, on by default for small layers). x_f16: x's f16 form (the _xf16 entries;
// null in others); x_sumsq: x's sums of squares in parts (the _xf16sq entries, which do not
// read x; null in others).
#define BLINK_SKINNY_QKV_ROPE(NAME, A, C, NORM, SPLITS, W, XF16, SQ)                         \
  __global__ void BLINK_CLUSTER_OF_##SPLITS                                                  \
  __launch_bounds__(blink::kGemvThreads, blink::kGemvMinCtas) NAME(                          \
      const bf16* x, int ldx, int M, const W::Element* w, uint32_t w_tile_stride, int N,     \
      int K, float eps, const BatchDesc* desc, const int32_t* positions,                     \
      const int32_t* token_seq, const int32_t* block_tables, int max_blocks_per_seq,         \
      const bf16* qkv_bias, const float* inv_freq, int num_heads, int num_kv_heads,          \
      bf16* q_out, KvElement* k_cache, KvElement* v_cache, int block_size, int num_blocks,   \
      const float* kv_scales, float* kv_amax, const float* w_scale, const bf16* norm_w,      \
      int release_next, const __half* x_f16, const float* x_sumsq) {                        \
    if (release_next) blink::ReleaseNextKernel();                                            \
    blink::SkinnyQkvRopeCta<kHeadDim, A, C, NORM, SPLITS, Kv, W, XF16, SQ>(                  \
        x, ldx, M, w, w_tile_stride, N, K, eps, desc, positions, token_seq, block_tables,    \
        max_blocks_per_seq, qkv_bias, inv_freq, num_heads, num_kv_heads, q_out, k_cache,     \
        v_cache, block_size, num_blocks, kv_scales, kv_amax, w_scale, norm_w, x_f16,         \
        x_sumsq);                                                                            \
  }
BLINK_SKINNY_QKV_ROPE(blink_skinny_qkv_rope_norm_1x1, 1, 1, true, 1, blink::Bf16Weights,
                      false, false)
BLINK_SKINNY_QKV_ROPE(blink_skinny_qkv_rope_norm_2x1, 2, 1, true, 1, blink::Bf16Weights,
                      false, false)
BLINK_SKINNY_QKV_ROPE(blink_skinny_qkv_rope_norm_1x2, 1, 2, true, 1, blink::Bf16Weights,
                      false, false)
BLINK_SKINNY_QKV_ROPE(blink_skinny_qkv_rope_norm_2x2, 2, 2, true, 1, blink::Bf16Weights,
                      false, false)
BLINK_SKINNY_QKV_ROPE(blink_skinny_qkv_rope_1x4, 1, 4, false, 1, blink::Bf16Weights, false, false)
BLINK_SKINNY_QKV_ROPE(blink_skinny_qkv_rope_2x4, 2, 4, false, 1, blink::Bf16Weights, false, false)
BLINK_SKINNY_QKV_ROPE(blink_skinny_qkv_rope_norm_1x1_k2, 1, 1, true, 2, blink::Bf16Weights,
                      false, false)
BLINK_SKINNY_QKV_ROPE(blink_skinny_qkv_rope_norm_1x2_k2, 1, 2, true, 2, blink::Bf16Weights,
                      false, false)
BLINK_SKINNY_QKV_ROPE(blink_skinny_qkv_rope_norm_fp8_1x1, 1, 1, true, 1, blink::Fp8Weights,
                      false, false)
BLINK_SKINNY_QKV_ROPE(blink_skinny_qkv_rope_norm_fp8_2x1, 2, 1, true, 1, blink::Fp8Weights,
                      false, false)
BLINK_SKINNY_QKV_ROPE(blink_skinny_qkv_rope_norm_fp8_1x2, 1, 2, true, 1, blink::Fp8Weights,
                      false, false)
BLINK_SKINNY_QKV_ROPE(blink_skinny_qkv_rope_norm_fp8_2x2, 2, 2, true, 1, blink::Fp8Weights,
                      false, false)
BLINK_SKINNY_QKV_ROPE(blink_skinny_qkv_rope_norm_fp8_1x1_k2, 1, 1, true, 2, blink::Fp8Weights,
                      false, false)
BLINK_SKINNY_QKV_ROPE(blink_skinny_qkv_rope_norm_fp8_1x2_k2, 1, 2, true, 2, blink::Fp8Weights,
                      false, false)
BLINK_SKINNY_QKV_ROPE(blink_skinny_qkv_rope_norm_fp8_xf16_1x1, 1, 1, true, 1, blink::Fp8Weights,
                      true, false)
BLINK_SKINNY_QKV_ROPE(blink_skinny_qkv_rope_norm_fp8_xf16_2x1, 2, 1, true, 1, blink::Fp8Weights,
                      true, false)
BLINK_SKINNY_QKV_ROPE(blink_skinny_qkv_rope_norm_fp8_xf16_1x1_k2, 1, 1, true, 2,
                      blink::Fp8Weights, true, false)
BLINK_SKINNY_QKV_ROPE(blink_skinny_qkv_rope_norm_fp8_xf16sq_1x1, 1, 1, true, 1,
                      blink::Fp8Weights, true, true)
BLINK_SKINNY_QKV_ROPE(blink_skinny_qkv_rope_norm_fp8_xf16sq_2x1, 2, 1, true, 1,
                      blink::Fp8Weights, true, true)
BLINK_SKINNY_QKV_ROPE(blink_skinny_qkv_rope_norm_fp8_xf16sq_1x1_k2, 1, 1, true, 2,
                      blink::Fp8Weights, true, true)
#undef BLINK_SKINNY_QKV_ROPE

// A batch-1 layer's projections after attention in one persistent kernel (gemv_chain.cuh): o +
// residual, RMSNorm + gate|up + SiLU, down + residual. One CTA an SM by default (the ring and
// two x_stride-element buffers of dynamic shared memory, x_stride the layer's largest K; the
// grid need not be resident at once); counters: the layer's, zero before the first launch
// (each launch leaves them zero). _fp8: E4M3 weights (gemv.cuh Fp8Weights; each projection's
// w_scale, and gate|up's norm_w).
#define BLINK_PROJECTION_CHAIN(NAME, W)                                                      \
  __global__ void __launch_bounds__(blink::kChainThreads, 1)                                 \
      NAME(const __grid_constant__ blink::ChainProjections chain, float eps, int x_stride,   \
           blink::ChainCounters* counters) {                                                 \
    blink::ProjectionChainCta<W>(chain.p, eps, x_stride, counters);                          \
  }
BLINK_PROJECTION_CHAIN(blink_projection_chain, blink::Bf16Weights)
BLINK_PROJECTION_CHAIN(blink_projection_chain_fp8, blink::Fp8Weights)
#undef BLINK_PROJECTION_CHAIN

// Split-K linear with shared activations, added into fp32 (gemv.cuh SplitKAddLinearCta): the
// residual-adding projections of 17..32-row steps; and gate|up + SiLU of those steps, a CTA's
// rows over all of K (gemv.cuh RowBlockSiluMulCta), its output bf16. _x2, _x4: in clusters of
// two or four CTAs (the same chunk of K) that share each chunk of x's read from L2.
#define BLINK_X_SLAB_KERNEL(NAME, CTA, OUT, CLUSTER)                                         \
  __global__ void BLINK_CLUSTER_OF_##CLUSTER                                                 \
  __launch_bounds__(blink::kSplitKThreads, blink::kSplitKMinCtas)                            \
      NAME(const BatchDesc* desc, const bf16* x, int ldx, int M, const bf16* w,              \
           uint32_t w_tile_stride, int N, int K, int k_chunk, OUT* out, int ldo) {           \
    blink::CTA<CLUSTER>(desc, x, ldx, M, w, w_tile_stride, N, K, k_chunk, out, ldo);         \
  }
BLINK_X_SLAB_KERNEL(blink_splitk_add_linear, SplitKAddLinearCta, float, 1)
BLINK_X_SLAB_KERNEL(blink_splitk_add_linear_x2, SplitKAddLinearCta, float, 2)
BLINK_X_SLAB_KERNEL(blink_splitk_add_linear_x4, SplitKAddLinearCta, float, 4)
BLINK_X_SLAB_KERNEL(blink_rowblock_silu_mul, RowBlockSiluMulCta, bf16, 1)
BLINK_X_SLAB_KERNEL(blink_rowblock_silu_mul_x2, RowBlockSiluMulCta, bf16, 2)
BLINK_X_SLAB_KERNEL(blink_rowblock_silu_mul_x4, RowBlockSiluMulCta, bf16, 4)
#undef BLINK_X_SLAB_KERNEL
#undef BLINK_CLUSTER_OF_1
#undef BLINK_CLUSTER_OF_2
#undef BLINK_CLUSTER_OF_4

// The skinny kernels' tiled weights from row-major ones (gemv.cuh TileWeightsThread); not
// part of the forward pass: run once, when the weights are in.
__global__ void __launch_bounds__(256)
    blink_tile_weights(const bf16* w, bf16* tiled, int N, int K, uint32_t tile_stride,
                       size_t pieces) {
  blink::AwaitPriorKernel();
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < pieces;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    blink::TileWeightsThread(w, tiled, N, K, tile_stride, i);
}

__global__ void __launch_bounds__(256)
    blink_silu_mul(const BatchDesc* desc, const bf16* gate_up, bf16* out, int inter) {
  blink::AwaitPriorKernel();
  blink::SiluMulCta(desc, gate_up, out, inter);
}

// --- FP8 (--quantization fp8) -----------------------------------------------------------------
// E4M3 codes with a scale a row (quantize.cuh): of x's rows below desc's num_tokens (every row
// with desc null: weights at load time); of the RMSNorm's and SiLU * up's output rows (the
// inputs of the FP8 GEMMs of prefill-sized steps, which take a scale per token row).
__global__ void __launch_bounds__(256)
    blink_quantize_rows(const BatchDesc* desc, const bf16* x, int ldx, fp8* q, int ldq,
                        float* scale, int K) {
  blink::AwaitPriorKernel();
  blink::QuantizeBf16RowCta(desc, x, ldx, q, ldq, scale, K);
}

__global__ void __launch_bounds__(256)
    blink_rms_norm_fp8(const BatchDesc* desc, float* x, const bf16* bias, const bf16* weight,
                       fp8* q, float* scale, int hidden, float eps) {
  blink::AwaitPriorKernel();
  blink::RmsNormE4m3Cta(desc, x, bias, weight, q, scale, hidden, eps);
}

__global__ void __launch_bounds__(256)
    blink_silu_mul_fp8(const BatchDesc* desc, const bf16* gate_up, fp8* q, float* scale,
                       int inter) {
  blink::AwaitPriorKernel();
  blink::SiluMulE4m3Cta(desc, gate_up, q, scale, inter);
}

// The FP8 skinny kernels' tiled weights from row-major codes (gemv.cuh TileWeightsThread).
__global__ void __launch_bounds__(256)
    blink_tile_weights_fp8(const fp8* w, fp8* tiled, int N, int K, uint32_t tile_stride,
                           size_t pieces) {
  blink::AwaitPriorKernel();
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < pieces;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    blink::TileWeightsThread(w, tiled, N, K, tile_stride, i);
}

// done_sem (null: none): the forward graph's end. The CTAs count themselves out on it, and the
// last one bumps desc->done_counter for the launcher (SignalDone), where a kernel of its own
// after this one used to: one kernel launch and one wait for a grid's completion fewer a step.
__global__ void __launch_bounds__(blink::kSampleThreads)
    blink_sample(BatchDesc* desc, const float* logits, int vocab, const float* temperature,
                 const float* top_p, const int32_t* top_k, const uint64_t* seed,
                 const uint32_t* step, int32_t* sampled, unsigned long long* lm_argmax,
                 uint32_t* done_sem) {
  blink::AwaitPriorKernel();
  blink::SampleCta(desc, logits, vocab, temperature, top_p, top_k, seed, step, sampled,
                   lm_argmax);
  if (done_sem != nullptr && blink::LastCtaToArrive(done_sem, gridDim.x) && threadIdx.x == 0) {
    *done_sem = 0;
    blink::SignalDone(desc);
  }
}

__global__ void blink_sampling_uniform(const uint64_t* seed, const uint32_t* step, double* out,
                                       int n) {
  blink::SamplingUniformThread(seed, step, out, n);
}

// Not part of the forward pass: a CTA that holds its SM until *release is nonzero, as the
// scheduler kernel's CTA holds one while the forward graphs it launched run. bench_decode and
// the GEMM tuner time graphs beside it (CudaForward.holding_sms) so that they see the GPU the
// live engine sees. Launched with the scheduler's thread count, it also takes the scheduler
// kernel's registers and static shared memory (scheduler_kernel.cu's scheduler_run: 88
// registers, the cap it is built with, cuda_engine.SCHEDULER_MAX_REGISTERS, which the serial
// walks it calls keep to as well, in the same allocation unit of 8 as the 86 here; and 12,300
// bytes of its own plus 7,628 in the functions it calls, which the link puts in its CTA;
// test_cuda_forward checks both against the loaded kernel, in the units the SM hands out):
// what fits beside a CTA depends on both (beside the 6 registers a thread this kernel used to
// take, a skinny projection's 114-register CTA fit twice on its SM; beside the scheduler's 82,
// or 86, once).
static constexpr int kSchedulerRegisters = 86;
static constexpr int kSchedulerSmemBytes = 12300 + 7628;
__global__ void __launch_bounds__(blink::engine::kSchedulerThreads, 1)
    blink_hold_sm(const volatile uint32_t* release) {
  volatile __shared__ uint32_t held_smem[kSchedulerSmemBytes / sizeof(uint32_t)];
  for (int i = threadIdx.x; i < kSchedulerSmemBytes / 4; i += blockDim.x) held_smem[i] = 0;
  // values live across the loop (each iteration mixes each with the next, so none can be
  // recomputed from fewer; a hash of them is stored at the end), so that ptxas allocates
  // kSchedulerRegisters a thread
  constexpr int kLive = kSchedulerRegisters - 8;  // 8: ptxas's own (the flag, the loop, ...)
  uint32_t live[kLive];
#pragma unroll
  for (int i = 0; i < kLive; ++i) live[i] = threadIdx.x * (i + 1);
  while (*release == 0) {
    __nanosleep(2000);
    const uint32_t first = live[0];
#pragma unroll
    for (int i = 0; i < kLive; ++i)
      live[i] = live[i] * 1664525u + (i + 1 < kLive ? live[i + 1] : first);
  }
  uint32_t sum = 0;
#pragma unroll
  for (int i = 0; i < kLive; ++i) sum ^= live[i] * (2 * i + 1);
  held_smem[threadIdx.x % (kSchedulerSmemBytes / 4)] = sum;
}

// Not part of the forward pass either: a kernel that does none of an op's work, for
// bench_decode --marginal, which launches it in place of one op's kernels (their grids, blocks
// and shared memory) inside the whole step's graph. What the step loses then is that op's work;
// what it loses with the op left out altogether is its work and its kernel boundary. It lets
// the next kernel launch at once, as the decode kernels release theirs once their weights are
// loaded.
__global__ void blink_pdl_noop() {
  blink::ReleaseNextKernel();
  blink::AwaitPriorKernel();
}

}  // extern "C"
