// The device-side batch description: the contract between the scheduler kernel, which writes it
// before each forward launch, and the forward graphs, whose kernels read it (so one graph serves
// any batch up to its bucket size). gpu_engine/cuda_forward.py mirrors BatchDesc as a NumPy dtype;
// tests/test_cuda_forward.py checks the two agree.
//
// Device arrays beside it (fixed capacity, their pointers baked into the graphs):
//   token_ids    [max_tokens] i32   tokens of this step, sequence after sequence
//   positions    [max_tokens] i32   each token's position in its sequence; consecutive per sequence
//   token_seq    [max_tokens] i32   batch sequence index of each token (non-decreasing)
//   context_lens [max_seqs] i32     KV length of sequence s after this step (last position + 1)
//   block_tables [max_seqs * max_blocks_per_seq] i32   KV blocks of sequence s in order
//   logit_token  [max_seqs] i32     flat token index whose logits are row l (l < num_logits)
//   temperature [max_seqs] f32, top_p [max_seqs] f32, top_k [max_seqs] i32, seed [max_seqs] u64,
//   step [max_seqs] u32 (index of the token being generated): sampling parameters per logit row
//   logits [max_seqs * vocab] f32, sampled [max_seqs] i32: outputs per logit row
// Rows t >= num_tokens of the activations are padding: computed on garbage, never read back, and
// never written into the KV cache.
#pragma once
#include <stdint.h>

#include "utils.cuh"

namespace blink {

struct BatchDesc {
  int32_t num_tokens;    // T <= the graph's bucket size
  int32_t num_seqs;      // S
  int32_t num_logits;    // L: sequences that sample this step
  int32_t done_counter;  // incremented by the graph's last kernel; a spinning launcher waits on it
};
static_assert(sizeof(BatchDesc) == 16, "BatchDesc layout is shared with Python");

// The graph's end, one thread: publishes completion once everything the graph writes is written
// (the sampling kernel's last CTA: every other CTA of it has arrived, and each earlier kernel of
// the graph had finished before it began). A release add at GPU scope: it carries those writes,
// the other CTAs' through LastCtaToArrive's acquire, to the launcher that acquires the count (the
// scheduler kernel's WaitCounter on the same GPU; a host reads the results only after the
// stream's completion). It replaced an add between two system-scope fences
// (docs/performance.md round 49).
__device__ __forceinline__ void SignalDone(BatchDesc* desc) {
  RedAddReleaseGpu(reinterpret_cast<uint32_t*>(&desc->done_counter), 1u);
}

}  // namespace blink
