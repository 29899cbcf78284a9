// Memory bandwidth probes for the benchmarks (not part of the forward pass).
//
// read_stream: every 16-byte word of `data` read once, as the skinny linear kernels stream their
// weights (gemv.cuh's LoadStreaming16: no L1 allocation; a warp's batch of 32 * kReadLoads words
// contiguous, unrolled), and summed as uint32 into *sum, so that nothing is optimized away and a
// test can check that each word was read exactly once. It measures what a kernel that streams
// weights can reach, beside the device-to-device copy rate that bench_decode's floors count
// (a copy also writes). Measured on the H200: reads alone 4.50-4.54 TB/s at one or two CTAs an SM,
// the same as bulk copies into shared memory (cp.async.bulk, 64-128 KB in flight a CTA), where
// the copy rate is 4.22-4.29 in this project's runs.
#include <stdint.h>

#include "gemv.cuh"

static constexpr int kReadLoads = 16;

extern "C" __global__ void __launch_bounds__(256)
    read_stream(const uint4* data, uint64_t words, uint32_t* sum) {
  const int lane = threadIdx.x % blink::kWarpSize;
  const uint64_t thread = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
  const uint64_t threads = gridDim.x * static_cast<uint64_t>(blockDim.x);
  const uint64_t warps = threads / blink::kWarpSize, batch = blink::kWarpSize * kReadLoads;
  uint32_t acc = 0;
  auto add = [&](const uint4& v) { acc += v.x + v.y + v.z + v.w; };
  for (uint64_t b = thread / blink::kWarpSize; (b + 1) * batch <= words; b += warps) {
    uint4 v[kReadLoads];
#pragma unroll
    for (int i = 0; i < kReadLoads; ++i)
      v[i] = blink::LoadStreaming16(data + b * batch + i * blink::kWarpSize + lane);
#pragma unroll
    for (int i = 0; i < kReadLoads; ++i) add(v[i]);
  }
  for (uint64_t i = words / batch * batch + thread; i < words; i += threads)  // past the batches
    add(blink::LoadStreaming16(data + i));
  acc = blink::WarpSum(acc);
  if (lane == 0) atomicAdd(sum, acc);
}
