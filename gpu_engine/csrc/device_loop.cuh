// Device-side graph launch for a persistent scheduler kernel.
//
// The scheduler kernel runs inside a graph instantiated for device launch. Each step it launches
// a forward graph fire-and-forget and spins on a counter the graph's last kernel bumps. A graph
// execution may issue at most 120 fire-and-forget launches, so after kMaxLaunchesPerRun steps the
// scheduler tail-launches its own graph and returns; all its state lives in device memory.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include "utils.cuh"

namespace blink {

// Under the 120 fire-and-forget launches a graph execution may make, with room to spare.
static constexpr int kMaxLaunchesPerRun = 100;

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// Launches `graph` fire-and-forget. Relaunching a graph exec whose previous launch has signalled
// completion but not yet retired fails with cudaErrorInvalidValue (measured: ~3 retries a step),
// so that error is retried; any other error is returned.
__device__ inline cudaError_t LaunchGraphRetrying(cudaGraphExec_t graph, uint32_t* retries) {
  for (;;) {
    cudaError_t err = cudaGraphLaunch(graph, cudaStreamGraphFireAndForget);
    if (err != cudaErrorInvalidValue) return err;
    ++*retries;
    __nanosleep(64);
  }
}

// Ends this run of the scheduler: its own graph runs again once this kernel returns.
__device__ inline cudaError_t RelaunchSelf() {
  return cudaGraphLaunch(cudaGetCurrentGraphExec(), cudaStreamGraphTailLaunch);
}

// Spins until *counter reaches `target` (the forward graph's last kernel increments it).
__device__ inline void WaitCounter(const uint32_t* counter, uint32_t target) {
  while (static_cast<int32_t>(LoadAcquireGpu(counter) - target) < 0) {
  }
}

}  // namespace blink
