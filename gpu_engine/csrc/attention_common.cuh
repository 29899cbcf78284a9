// What the attention kernel's paths share (attention.cuh has the kernel and its overview): the
// CTA shapes and the registers they may use, where a KV head's rows sit in the paged cache, and
// how the CTAs that split a tile's or a decode token's keys meet (the last to arrive merges).
#pragma once
#include "batch.cuh"
#include "kv_cache.cuh"
#include "utils.cuh"

namespace blink {

// The 16-bit operands the attention MMAs run on: bf16 beside a bf16 cache; f16 beside an E4M3
// one (its codes convert to f16 exactly: fp8.cuh), the queries and probabilities then rounded to
// f16 (probabilities in [0, 1] keep 3 more bits than in bf16; queries stay far inside f16's
// range). Scores and outputs accumulate in fp32 either way.
template <class Kv>
struct AttnOperands {
  // 8 of q's bf16 values (four pairs) as the MMAs take them
  static __device__ __forceinline__ uint4 Query(const uint4& v) {
    if constexpr (Kv::kFp8) {
      return make_uint4(Bf16x2ToF16x2(v.x, 1.f), Bf16x2ToF16x2(v.y, 1.f),
                        Bf16x2ToF16x2(v.z, 1.f), Bf16x2ToF16x2(v.w, 1.f));
    }
    return v;
  }
  // a pair of q's bf16 values as the MMAs take it
  static __device__ __forceinline__ uint32_t QueryPair(uint32_t v) {
    if constexpr (Kv::kFp8) return Bf16x2ToF16x2(v, 1.f);
    return v;
  }
  static __device__ __forceinline__ void Mma(float (&c)[4], uint32_t a0, uint32_t a1,
                                             uint32_t a2, uint32_t a3, uint32_t b0,
                                             uint32_t b1) {
    if constexpr (Kv::kFp8) {
      MmaF16(c, a0, a1, a2, a3, b0, b1);
    } else {
      MmaBf16(c, a0, a1, a2, a3, b0, b1);
    }
  }
  // MmaBf16Step32's two MMAs, in these operands
  static __device__ __forceinline__ void MmaStep32(float (&c)[4], const uint4& lo,
                                                   const uint4& hi, const uint4& b) {
    Mma(c, lo.x, hi.x, lo.y, hi.y, b.x, b.y);
    Mma(c, lo.z, hi.z, lo.w, hi.w, b.z, b.w);
  }
  // two probabilities as an operand pair (a in the low half), and back as the MMA sees them
  static __device__ __forceinline__ uint32_t Pack(float a, float b) {
    if constexpr (Kv::kFp8) return F32x2ToF16x2(a, b);
    const __nv_bfloat162 pair = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&pair);
  }
  static __device__ __forceinline__ float2 Unpack(uint32_t v) {
    if constexpr (Kv::kFp8) return F16x2ToF32x2(v);
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  }
};

// Query rows (tokens x group heads) per CTA: 64 for the large buckets; 16 for decode-sized
// ones, where a tile rarely has more rows (both variants hold kAttnMinCtas CTAs an SM:
// registers decide); 128 in the wgmma kernel of the prefill-sized ones (kAttnWgmmaRows).
static constexpr int kAttnRows = 64;
static constexpr int kAttnRowsSmall = 16;
// Keys per tile of PagedAttentionCta; both tile paths' splits hold whole ones.
static constexpr int kAttnKeys = 64;
// The most CTAs that share one query tile's or decode token's keys (the split merges' bound;
// the host's attention_splits and split strides stay within it).
static constexpr int kAttnMaxSplits = 64;
// A query tile spread over its run's CTAs (attention_tiles.cuh FindQueryTile: a chunk of a few
// hundred tokens deep into its context, as a prefix-cache hit leaves it) takes a split for
// every this many of its keys (16-row tiles, the decode-sized buckets' kernels: every half as
// many), or more where that leaves the GPU's attention slots idle: as many as fill them once,
// the batch's other tokens counted a CTA a KV head each, down to kTileSplitFewestKeys keys a
// split. A chunk's short last tile takes as many as the others, unless the run's splits would
// outnumber its CTAs (then each tile at most its own tokens' CTAs). Fewer, longer splits where
// the merge and each CTA's fixed costs would outweigh the keys they save. Measured on the H200
// (bench_decode --prefill, attention us a layer, one call): a chunk of 100 tokens to 2,100
// keys on 64-row tiles, a split every 512 keys / filling the slots (7 of 320 keys a full
// tile), 8B 46.6 / 41.1, 1B 32.5 / 29.7 (docs/performance.md, round 27); before the items
// went to the CTAs in dispatch order, 512 / 256 keys a split 53.2 / 56.6 (112 unsplit); a
// chunk of 52 on 16-row tiles 50.6 / 43.5 (54.8). The short tile's splits as the others' (its
// 4 tokens had capped it at 4): 100 tokens at 4,000 keys 110-113 -> 87-89 us (8B), 53.3-53.6
// -> 50.5-50.8 (1B); at 2,000 the same within the runs' spread (8B 49.3-49.6 / 49.6-51.0), 1B
// 30.8-35.2 / 37.0-37.3 (round 28). BLINK_TILE_SPLIT_MIN_KEYS (-D) overrides the 64-row
// figure.
#ifndef BLINK_TILE_SPLIT_MIN_KEYS
#define BLINK_TILE_SPLIT_MIN_KEYS 512
#endif
template <int kRows>
static constexpr int kTileSplitMinKeys =
    kRows >= 64 ? BLINK_TILE_SPLIT_MIN_KEYS : BLINK_TILE_SPLIT_MIN_KEYS / 2;
static_assert(kTileSplitMinKeys<16> % kAttnKeys == 0, "whole key tiles a split");
static constexpr int kTileSplitFewestKeys = 2 * kAttnKeys;
// Warps of a CTA: kAttnWarps, or kAttnWideWarps in the decode-sized buckets' wide kernel (below).
static constexpr int kAttnWarps = 4;
static constexpr int kAttnThreads = kAttnWarps * kWarpSize;

// The mma.sync paths (DecodeAttentionCta from global memory, TileAttentionMmaCta from shared
// memory) read a lane's share of a head vector in whole 8- or 16-byte pieces and keep their
// accumulators in registers: head dims 64 and 128. Other head dims take the WMMA query tiles
// (PagedAttentionCta) for every token.
template <int kHeadDim>
__host__ __device__ constexpr bool MmaPathsFit() {
  return kHeadDim == 64 || kHeadDim == 128;
}

// The wide kernel's warps. A decode token's keys are spread over its CTA's warps (16 keys a warp
// step), then over CTAs (splits, which meet through global memory at the end): where a batch's
// (token, KV head) pairs fit the GPU in one wave of 8-warp CTAs, twice the warps a CTA means
// half the splits for the same keys a warp. The host takes the wide kernel only there
// (CudaForward.attention_wide): at 8B's 32 x 512, 256 pairs in two waves of one CTA an SM,
// every decode-sized bucket on 8 warps ran 5.329 -> 5.420 ms. Measured on the H200
// (bench_decode, ms a step, 4 warps -> the wide kernel where it fits): Llama-3.1-8B batch 1 at
// 512 and 8,192 keys 3.918 -> 3.862 and 4.218 -> 4.134 (32 x 512 and 32 x 4096, not wide,
// alike); Llama-3.2-1B 0.816 -> 0.805, 0.887 -> 0.883, 32 x 512 1.270 -> 1.253, 32 x 4096
// 2.199 -> 2.154. 12 warps (head dim 128 or 64) or 16 (64) were no faster anywhere, and slower
// at 8,192 keys (8B 4.134 -> 4.203, 1B 0.884 -> 0.915 with 12).
template <int kHeadDim>
static constexpr int kAttnWideWarps = MmaPathsFit<kHeadDim>() ? 8 : kAttnWarps;

// The wgmma kernel, for the prefill-sized buckets (CudaForward.attention_wgmma): query tiles of
// 128 rows on two warpgroups (8 warps, a warp per 16 rows) running their MMAs on wgmma
// (attention_tiles.cuh), which share each key tile the CTA copies into shared memory; one
// 8-warp CTA an SM at head dim 128 leaves the registers that overlap a key tile's softmax with
// the previous tile's O += P V. The WMMA head dims have the entry (64 rows on 4 warps, as the
// large kernel) but never take it.
template <int kHeadDim>
static constexpr int kAttnWgmmaWarps = MmaPathsFit<kHeadDim>() ? 8 : kAttnWarps;
template <int kHeadDim>
static constexpr int kAttnWgmmaRows = 16 * kAttnWgmmaWarps<kHeadDim>;

// CTAs per SM the kernel's registers must allow, from the warps an SM they allow: 12 at head
// dim 128 (a register cap of 168 a thread: 3 CTAs of 4 warps, 1 of 8), 16 at 64 (a cap of 128)
// and 8 above 128. Head dims above 128 need more than 168 without spilling; 128 spills at a
// cap of 128 (the 8B shape's steps 3-13% slower); 64 fits 128 without spilling, and its fourth
// 4-warp CTA an SM pays (H200, Llama-3.2-1B shape, against 3: 128 x 512 decodes 2.017 -> 1.944
// ms a step, 2,048-token prefill chunks to 8,192 keys 18.67 -> 17.63 ms; batch 1 and 32
// unchanged; at 5, with spills, every point slower).
template <int kHeadDim, int kWarps>
static constexpr int kAttnMinCtas = (kHeadDim > 128 ? 8 : kHeadDim > 64 ? 12 : 16) / kWarps;
// The roomy kernel's (the large tiles for short chunks, CudaForward.attention_roomy_max_bucket):
// at head dim 128, 8 warps an SM (2 CTAs of 4) rather than 12, so a cap of 255 registers rather
// than 168. At 168, ptxas issues 13 of the tile loop's 32 ldmatrix right before the MMA that
// reads them (nvdisasm: one instruction apart; round 27's ncu saw the warps wait on shared-memory
// results 27% of the time) and spills 60 bytes; at the roomy cap the kernel takes 231 (235 with
// an E4M3 cache), no spill, and every ldmatrix is 17 or more instructions ahead of its MMA
// (docs/performance.md, round 36). Head dim 64 already holds its
// loads 10 or more ahead at its cap of 128 (and above 128 the cap is 255): unchanged there.
template <int kHeadDim, int kWarps>
static constexpr int kAttnRoomyMinCtas =
    kHeadDim == 128 ? 8 / kWarps : kAttnMinCtas<kHeadDim, kWarps>;

// The merge weights of one query row's splits, a warp at once: lane z gets weight[i] =
// 2^(m_z - M) of splits z and z + 32 (0 past active_splits <= 64, or where m_z = -inf) with
// M = max_z m_z, and every lane the return value 1 / sum_z 2^(m_z - M) l_z. stats: the row's
// [splits][2] (running max in log2 units, sum), written by other CTAs: read through L2 (ld.cg).
__device__ __forceinline__ float SplitWeights(const float* stats, int active_splits,
                                              float (&weight)[2]) {
  const int lane = threadIdx.x % kWarpSize;
  float split_max[2], split_sum[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int z = lane + kWarpSize * i;
    split_max[i] = z < active_splits ? __ldcg(stats + 2 * z) : -INFINITY;
    split_sum[i] = z < active_splits ? __ldcg(stats + 2 * z + 1) : 0.f;
  }
  const float max_all = WarpMax(fmaxf(split_max[0], split_max[1]));
#pragma unroll
  for (int i = 0; i < 2; ++i) weight[i] = exp2f(split_max[i] - max_all);  // 0 at -inf
  return 1.f / WarpSum(weight[0] * split_sum[0] + weight[1] * split_sum[1]);
}

// Where one KV head's rows sit in a layer's paged cache ([blocks, block_size, kv_heads, D]):
// the element offset of a key's row, -1 where the table maps no block. Shifts for the usual
// power-of-two block sizes, a division otherwise.
template <int kHeadDim>
struct KeyRows {
  const int32_t* table;  // the sequence's block table
  int block_size, block_shift, num_kv_heads, kv_head;
  bool pow2;

  __device__ KeyRows(const int32_t* block_tables, int max_blocks_per_seq, int seq,
                     int block_size_, int num_kv_heads_, int kv_head_)
      : table(block_tables + static_cast<size_t>(seq) * max_blocks_per_seq),
        block_size(block_size_), block_shift(__ffs(block_size_) - 1),
        num_kv_heads(num_kv_heads_), kv_head(kv_head_),
        pow2((block_size_ & (block_size_ - 1)) == 0) {}

  __device__ __forceinline__ int64_t offset(int key) const {
    const int block = block_of(key);
    return block < 0 ? -1 : offset_in(block, key);
  }
  // The table's entry for key (-1: no block).
  __device__ __forceinline__ int block_of(int key) const {
    return table[pow2 ? key >> block_shift : key / block_size];
  }
  // The offset of key's row, given its block (block_of(key) >= 0).
  __device__ __forceinline__ int64_t offset_in(int block, int key) const {
    const int row = pow2 ? key & (block_size - 1) : key % block_size;
    return ((static_cast<int64_t>(block) * block_size + row) * num_kv_heads + kv_head) *
           kHeadDim;
  }
};

}  // namespace blink
