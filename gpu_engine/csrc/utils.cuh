// Shared device primitives: bf16 vector loads/stores and warp/block reductions.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

namespace blink {

using bf16 = __nv_bfloat16;

static constexpr int kWarpSize = 32;
static constexpr unsigned kFullMask = 0xffffffffu;

// 8 bf16 = 16 bytes <-> 8 floats. `p` must be 16-byte aligned (row widths are multiples of 8).
__device__ __forceinline__ void LoadBf16x8(const bf16* p, float (&v)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void StoreBf16x8(bf16* p, const float (&v)[8]) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}

// 8 floats (two float4) at a 16-byte aligned address.
__device__ __forceinline__ void LoadF32x8(const float* p, float (&v)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

__device__ __forceinline__ void StoreF32x8(float* p, const float (&v)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// Programmatic dependent launch (sm_90+; no-ops when a kernel was launched without it). The
// forward graph's kernels are captured with programmatic stream serialization, so kernel N + 1
// may be launched before kernel N ends: it is resident and past its launch latency when N's
// last CTA exits (or, where N calls ReleaseNextKernel, from then on). Each kernel waits for its
// predecessor's completion and memory in AwaitPriorKernel before it reads anything an earlier
// kernel wrote. The chain stays ordered: a kernel completes only after its wait returned, so
// waiting on the predecessor waits on everything before it. Measured on the H200 (Llama-3.1-8B
// shape, batch 1): 4.81 -> 4.68 ms a step. Releasing the next kernel at every kernel's start
// (5.30 ms), or prefetching a projection's first weights into L2 before its wait (4.93 ms),
// was slower: the waiting CTAs and the prefetches compete with the running kernel, so the
// skinny projections release early only once their weights are read (the qkv projection may
// release attention at its start instead: CudaForward's qkv_release_early, on by default where
// a layer's weights are small, ForwardKernels.QKV_RELEASE_EARLY_MAX_LAYER_BYTES).
// They also issue their first batch of weight loads (into registers, a few KB a CTA) before
// their wait (gemv.cuh): data nothing before them writes. Attention, a chain of latencies on a
// few SMs in decode-sized steps, releases the skinny o projection at its start, so that
// projection's first weights stream while attention runs (8B batch 1: 3.92 -> 3.90 ms, 1B
// 0.833 -> 0.827).
// The RMSNorm kernels of 17..32-row steps, 32 CTAs, release the projection after them once
// they have waited (blink_rms_norm in forward_kernels.cu: 1B 32 x 512 1.187 -> 1.174 ms).
// Activations must be read after the wait with coherent loads: ptxas moves ld.global.nc
// (__ldg) above griddepcontrol.wait.
__device__ __forceinline__ void AwaitPriorKernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel launch once every CTA of this one has called this or exited.
__device__ __forceinline__ void ReleaseNextKernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A load that orders every later memory access of this thread after the writes it observes
// (their writers released them: a fence and a count, or a release store).
__device__ __forceinline__ uint32_t LoadAcquireGpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// *p = v at system scope, a release: this thread's earlier writes (and those ordered before
// them, as by a barrier) are visible to whoever sees v, the host included (the output records'
// token counts, read by the front end over PCIe or RDMA).
__device__ __forceinline__ void StoreReleaseSys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// p += v at GPU scope, a release: this thread's earlier writes (and those ordered before them,
// as by a barrier) are visible to whoever acquires the sum (LoadAcquireGpu). One instruction,
// where a fence and a plain atomic wait for the fence (__threadfence is a sequentially
// consistent one).
__device__ __forceinline__ void RedAddReleaseGpu(uint32_t* p, uint32_t v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Called by each of `ctas` CTAs once its results are written (every thread): true in the last
// to arrive at the counter `sem`, whose reads of the others' results are then ordered after
// their writes. That CTA resets *sem for the next launch once it is done with it (the split
// attention partials' merge, the sampling kernel's completion signal).
// The CTA barrier orders every thread's writes before thread 0's count, an acquire-release add
// at GPU scope: its release publishes them with the count (cumulative through the barrier, as
// the chain's epilogue count after __syncwarp and CUTLASS's semaphore rely on), its acquire
// orders the last CTA after every other CTA's release (the adds continue one release sequence),
// and the second barrier hands that order to the CTA's threads. The CUDA sample's
// threadFenceReduction pattern it replaced (a sequentially consistent fence in every thread
// before a relaxed count, and again in the last CTA) is stronger than message passing needs and
// cost 9-23 us a step (docs/performance.md rounds 48 and 49).
__device__ __forceinline__ bool LastCtaToArrive(uint32_t* sem, int ctas) {
  __shared__ int s_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t before;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                 : "=r"(before) : "l"(sem) : "memory");
    s_last = before == static_cast<uint32_t>(ctas - 1);
  }
  __syncthreads();
  return s_last;
}

// D += A B on tensor cores, mma.sync m16n8k16 (bf16 in, fp32 accumulate); fragments as the PTX
// ISA lays them out: lane (g = lane / 4, t = lane % 4) holds A rows g and g + 8, B column g.
__device__ __forceinline__ void MmaBf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One 32-k step of D += A B as two m16n8k16 MMAs, each lane holding 16-byte pieces (8
// consecutive k) of A rows g (lo) and g + 8 (hi) and of B column g (b): within an MMA the order
// of the k terms is free, so k 8 t .. 8 t + 3 go to the first MMA and 8 t + 4 .. + 7 to the
// second, the same permutation in A and B.
__device__ __forceinline__ void MmaBf16Step32(float (&c)[4], const uint4& lo, const uint4& hi,
                                              const uint4& b) {
  MmaBf16(c, lo.x, hi.x, lo.y, hi.y, b.x, b.y);
  MmaBf16(c, lo.z, hi.z, lo.w, hi.w, b.z, b.w);
}

// 2^x by the SFU alone (ex2.approx.ftz: no denormal results, 2^-inf = 0), where exp2f adds
// range fix-ups around it: the softmax's probabilities, far from the denormal range that
// matters.
__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Asynchronous 16-byte copies global -> shared (cp.async, sm_80+), L2 only (the source may
// have been written by the previous kernel of the graph). `bytes` 0 fills the 16 bytes with
// zeros and reads nothing. Copies issued since the last commit form a group; CpAsyncWait<N>
// returns once at most N of this thread's groups are still in flight.
__device__ __forceinline__ void CpAsync16(void* smem_dst, const void* src, int bytes) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int kInFlight>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kInFlight) : "memory");
}

// --- thread-block clusters (sm_90): a cluster's CTAs share one L2 read of data they all need ---
//
// mbarriers track bulk copies by their bytes: a phase completes when its one arrival (the
// expect-tx below) and all the bytes it expects have come, in either order.
__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint32_t ClusterRank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// A rendezvous of every thread of every CTA of the cluster, in two halves (work may run between
// them), that orders no memory: a release at cluster scope is a GPU-wide memory barrier, which
// would wait for every weight load in flight. What it covers: mbarrier inits (their fence
// releases them), and shared-memory reads that have returned before the thread arrives (those
// whose values the thread's MMAs have taken: SplitKWarpTile::settle).
__device__ __forceinline__ void ClusterArrive() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}

__device__ __forceinline__ void ClusterWait() {
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
}

__device__ __forceinline__ void ClusterRendezvous() {
  ClusterArrive();
  ClusterWait();
}

// The same rendezvous ordering memory: what a thread wrote before its release-arrival (shared
// memory included) is visible to every thread of the cluster after its acquire-wait. (The
// release waits for the thread's loads in flight: call it where there are none.)
__device__ __forceinline__ void ClusterArriveRelease() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}

__device__ __forceinline__ void ClusterWaitAcquire() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The float at `p`'s offset in the shared memory of the cluster's CTA `rank` (distributed
// shared memory, sm_90).
__device__ __forceinline__ float LoadSharedCluster(const float* p, int rank) {
  uint32_t remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote) : "r"(SharedAddress(p)), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

// One thread: an mbarrier of kArrivals arrivals a phase, visible to the cluster's copies after
// a rendezvous (or to the CTA after a barrier).
template <int kArrivals = 1>
__device__ __forceinline__ void MbarrierInit(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SharedAddress(bar)),
               "n"(kArrivals)
               : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One of the phase's arrivals (release: the thread's earlier shared-memory reads are done).
__device__ __forceinline__ void MbarrierArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(SharedAddress(bar)) : "memory");
}

// One thread: this phase's arrival, and `bytes` more for it to wait for.
__device__ __forceinline__ void MbarrierExpectBytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SharedAddress(bar)),
               "r"(bytes)
               : "memory");
}

// Until the phase of parity `parity` has completed (its bytes are in this CTA's memory).
__device__ __forceinline__ void MbarrierWait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}" ::"r"(SharedAddress(bar)),
      "r"(parity)
      : "memory");
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory into this CTA's
// shared memory, counted on its mbarrier `bar`.
__device__ __forceinline__ void BulkCopy(void* dst, const void* src, uint32_t bytes,
                                         uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(SharedAddress(dst)), "l"(src), "r"(bytes), "r"(SharedAddress(bar))
      : "memory");
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory into the shared
// memory of each CTA of the cluster in cta_mask, at dst's offset there, each counting them on
// its mbarrier at bar's offset: one read from L2 for all of them (sm_90a).
__device__ __forceinline__ void BulkCopyMulticast(void* dst, const void* src, uint32_t bytes,
                                                  uint64_t* bar, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster "
      "[%0], [%1], %2, [%3], %4;" ::"r"(SharedAddress(dst)),
      "l"(src), "r"(bytes), "r"(SharedAddress(bar)), "h"(cta_mask)
      : "memory");
}

// Four 8x8 bf16 matrices from shared memory, transposed: lanes 8 i .. 8 i + 7 give the row
// addresses (16 bytes each) of matrix i, and lane (g, t) receives in b[i] its elements
// (2 t, g) and (2 t + 1, g): as an mma.sync B fragment, k = rows 2 t, 2 t + 1, n = column g.
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&b)[4], const void* smem_row) {
  const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
               : "r"(at));
}

// The transpose of an 8 x 8 matrix of 16-bit elements in mma.sync's fragment layout: lane
// (g = lane / 4, t = lane % 4) gives elements (g, 2 t) (the low half) and (g, 2 t + 1) and
// receives (2 t, g) and (2 t + 1, g) (movmatrix, sm_75+; every lane of the warp calls it).
__device__ __forceinline__ uint32_t TransposeFragment16(uint32_t v) {
  uint32_t d;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(v));
  return d;
}

template <typename T>
__device__ __forceinline__ T WarpSum(T v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

template <typename T>
__device__ __forceinline__ T WarpMax(T v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// The sum over the 16 lanes of the calling lane's half of the warp, in every one of them (all 16
// call it together; the other half need not).
__device__ __forceinline__ float HalfWarpSum(float v) {
  const unsigned half = 0xffffu << (threadIdx.x % kWarpSize & 16);
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(half, v, o);
  return v;
}

// `warp_all` (WarpSum, WarpMax: a reduction whose result every lane gets) over the block,
// returned to every thread; `identity` fills the slots of absent warps. blockDim.x must be a
// multiple of 32; scratch: 32 elements of shared memory. Contains two __syncthreads (all
// threads must call).
template <typename T, typename WarpAll>
__device__ __forceinline__ T BlockAll(T v, T* scratch, WarpAll warp_all, T identity) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  v = warp_all(v);
  __syncthreads();  // earlier readers of scratch are done
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return warp_all(lane < num_warps ? scratch[lane] : identity);
}

// Sum over the block, returned to every thread (BlockAll's rules).
template <typename T>
__device__ __forceinline__ T BlockSum(T v, T* scratch) {
  return BlockAll(v, scratch, [](T x) { return WarpSum(x); }, T(0));
}

// Max over the block of non-negative values (amax), returned to every thread (BlockAll's rules).
__device__ __forceinline__ float BlockMax(float v, float* scratch) {
  return BlockAll(v, scratch, [](float x) { return WarpMax(x); }, 0.f);
}

}  // namespace blink
