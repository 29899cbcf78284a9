// Paged causal attention for a flat batch mixing prefill chunks and decode tokens, with GQA.
//
// Work split (fixed grid, live batch): the grid is (bucket, num_kv_heads, splits). Each
// sequence's run of tokens is cut into tiles at positions that are multiples of rows-per-CTA /
// group; the CTA whose token starts a tile (the first token of its sequence's run, or one at a
// tile boundary) computes the tile for one kv head, or, in buckets of short chunks, the run's
// CTAs take its tiles' splits in dispatch order (attention_tiles.cuh FindQueryTile); the other
// CTAs exit at once, without waiting for the previous kernel. A tile's query rows are (token,
// head of the group) pairs, row = token_offset * group + g, so every key and value the CTA
// reads serves all of them. The keys 0 .. last position of the tile are streamed
// once per CTA; S = Q K^T and O += P V run on tensor cores (bf16 in, fp32 accumulate); the
// softmax is online in fp32 with the running max and sum per row (exp2 with log2(e) folded into
// the scale). Each query attends to cache positions 0..its own position, all of which the
// RoPE/KV-write kernel wrote earlier in the same graph. Head dims 64 and 128 run the tiles on
// mma.sync, a warp per 16 rows, keys and values copied into shared memory a tile ahead
// (TileAttentionMmaCta); in the wgmma kernel (prefill-sized buckets) the same function runs
// 128-row tiles on Hopper's warpgroup MMAs, two warpgroups sharing each key tile; other head
// dims on WMMA through shared memory (PagedAttentionCta).
//
// Decode tokens (a sequence with a single token in the batch) take a separate path in the same
// kernel, DecodeAttentionCta: one pass of each key and value row, straight from the cache into
// registers, for all query heads of the KV head's group at once; each warp its own keys and
// online softmax on tensor cores (mma.sync with the group's heads as 8 of the MMA's columns);
// and many CTAs per sequence (flash-decoding): grid.z splits the keys into ranges of whole
// chunks, 16 keys for each warp of the CTA.
//
// Split keys, both paths: the CTAs of a tile write their unnormalized output and (max, sum) per
// row to a workspace, and the last of them to finish (a counter per tile and KV head, reset by
// that CTA) merges them into `out` (CombineTileCta). A tile whose keys fit one split writes `out`
// directly. No separate combine kernel: one kernel boundary fewer per layer.
//
// The paths live in attention_tiles.cuh (query tiles) and attention_decode.cuh (decode tokens),
// what they share in attention_common.cuh; this header has the kernel's body, which picks a
// path for each CTA.
#pragma once
#include "attention_decode.cuh"
#include "attention_tiles.cuh"

namespace blink {

// Dynamic shared memory of the attention kernel: the more of the decode path's and the mma.sync
// or wgmma query tiles' (a CTA takes one path), or the WMMA query tiles' for the other head
// dims. kFp8: beside an E4M3 cache.
// (The query tiles' split merge reuses the same memory: TileMergeSmem.)
template <int kHeadDim, int kRows, int kWarps, bool kFp8 = false>
__host__ __device__ constexpr size_t AttentionKernelSmem() {
  if constexpr (MmaPathsFit<kHeadDim>()) {
    using Stages = TileStages<kHeadDim, kRows, TileUsesWgmma<kRows, kWarps>(), kFp8>;
    constexpr size_t decode = DecodeLayout<kHeadDim, kWarps>::kBytes;
    constexpr size_t tiles = Stages::kBytes > TileMergeSmem<kRows>() + Stages::kAlign
                                 ? Stages::kBytes
                                 : TileMergeSmem<kRows>() + Stages::kAlign;
    return decode > tiles ? decode : tiles;
  } else {
    return AttentionSmem<kHeadDim, kRows>::kBytes > TileMergeSmem<kRows>()
               ? AttentionSmem<kHeadDim, kRows>::kBytes
               : TileMergeSmem<kRows>();
  }
}

// The attention kernel's body: grid (bucket, num_kv_heads, num_splits), kWarps * 32 threads
// (kAttnWarps, or kAttnWideWarps<kHeadDim> with kRows = kAttnRowsSmall: the wide kernel, or
// kAttnWgmmaWarps<kHeadDim> with kRows = kAttnWgmmaRows<kHeadDim>: the wgmma kernel),
// AttentionKernelSmem<kHeadDim, kRows, kWarps, Kv::kFp8>() bytes of dynamic shared memory. A
// token alone in its sequence this step that attends to at least decode_min_keys keys goes
// to DecodeAttentionCta when its GQA group fits; every other token belongs to a query tile
// (TileAttentionMmaCta for head dims 64 and 128, PagedAttentionCta for the others).
// (gpu_engine/cuda_forward.py sets the threshold: 0, the decode path is the faster one at every
// context measured.) slots: the CTAs of this kernel the GPU holds at once (CTAs an SM x SMs).
// kStepInOneBlock: block_size is a multiple of kMmaKeys (the host picks the kernel by block
// size), and the decode path reads a warp step's keys from one block (DecodeAttentionCta).
// Each block layout is its own kernel. With both decode variants in one kernel (chosen by
// block_size at run time) every step ran slower, though only one variant ever ran and its loop
// compiled the same. On the H200 (bench_decode, block size 16, ms a step): 8B batch 1 at 512
// and 8,192 keys 3.959 -> 3.920 and 4.313 -> 4.222, 32 x 512 5.446 -> 5.327; 1B 0.831 ->
// 0.816, 0.905 -> 0.887 and 1.325 -> 1.269 (docs/performance.md, round 6).
// Kv: the cache's element (kv_cache.cuh); an E4M3 cache (kv_scales: the layer's) takes the
// MMA paths only, mma.sync or wgmma (head dims 64 and 128: the host refuses the others).
template <int kHeadDim, int kRows, bool kStepInOneBlock, int kWarps, class Kv = KvBf16>
__device__ __forceinline__ void AttentionCta(
    const BatchDesc* desc, const int32_t* positions, const int32_t* token_seq,
    const int32_t* block_tables, int max_blocks_per_seq, const bf16* q,
    const typename Kv::Element* k_cache, const typename Kv::Element* v_cache, int block_size,
    int num_heads, int num_kv_heads, float scale, bf16* out, int num_splits, int split_stride,
    float* partial_out, float* partial_stats, uint32_t* tile_sems, int decode_min_keys,
    int slots, const float* kv_scales = nullptr) {
  static_assert(MmaPathsFit<kHeadDim>() || !Kv::kFp8,
                "an E4M3 KV cache needs head dim 64 or 128 (the mma.sync paths)");
  // Everything the path choice needs, loaded at once (one memory latency, not a chain): rows
  // up to the bucket exist, so t - 1 and t + 1 may be read before the bounds test. The batch
  // arrays are written before the graph launches, so these loads precede the wait for the
  // previous kernel (programmatic dependent launch); each path waits before it reads what the
  // step's earlier kernels wrote.
  const int t = blockIdx.x, bucket = gridDim.x;
  const int num_tokens = desc->num_tokens;
  const int seq = token_seq[t];
  const int prev_seq = t > 0 ? token_seq[t - 1] : -1;
  const int next_seq = t + 1 < bucket ? token_seq[t + 1] : -1;
  const int position = positions[t];
  if (t >= num_tokens) {
    AwaitPriorKernel();  // an empty batch's grid must not complete before its predecessor
    return;
  }
  if constexpr (MmaPathsFit<kHeadDim>()) {
    const bool alone = prev_seq != seq && (t + 1 == num_tokens || next_seq != seq);
    if (alone && num_heads / num_kv_heads <= kDecodeMaxGroup &&
        position + 1 >= decode_min_keys) {
      DecodeAttentionCta<kHeadDim, kStepInOneBlock, kWarps, Kv>(
          t, seq, position, block_tables, max_blocks_per_seq, q, k_cache, v_cache, block_size,
          num_heads, num_kv_heads, scale, out, num_splits, split_stride,
          num_tokens * num_kv_heads, slots, partial_out, partial_stats, tile_sems, kv_scales);
      return;
    }
  }
  // The CTA's query tile, from the batch arrays alone; a CTA without one exits without waiting
  // (the grid still ends after its predecessor: a token's tile or decode CTA waits).
  QueryTile tile;
  if (!FindQueryTile<kRows>(desc, positions, token_seq, num_heads / num_kv_heads, num_kv_heads,
                            num_splits, split_stride, slots, &tile)) {
    return;
  }
  AwaitPriorKernel();  // the query tiles read this step's keys, values and q throughout
  if constexpr (MmaPathsFit<kHeadDim>()) {
    TileAttentionMmaCta<kHeadDim, kRows, kWarps, Kv>(
        tile, positions, block_tables, max_blocks_per_seq, q, k_cache, v_cache, block_size,
        num_heads, num_kv_heads, scale, out, split_stride, partial_out, partial_stats,
        tile_sems, kv_scales);
  } else {
    static_assert(kWarps == kAttnWarps, "the WMMA query tiles run on kAttnWarps warps");
    PagedAttentionCta<kHeadDim, kRows>(tile, positions, block_tables, max_blocks_per_seq, q,
                                       k_cache, v_cache, block_size, num_heads, num_kv_heads,
                                       scale, out, split_stride, partial_out, partial_stats,
                                       tile_sems);
  }
}

}  // namespace blink
