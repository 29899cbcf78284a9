// The relaunch mechanism alone: a persistent single-thread loop launching a one-kernel child
// graph per step from the device, across many self tail launches (tests/test_cuda_device_loop.py).
#include "device_loop.cuh"

struct LoopState {
  uint64_t child_graph;     // cudaGraphExec_t of the child
  uint64_t steps;           // completed steps
  uint64_t target_steps;
  uint64_t t_start_ns, t_end_ns;
  uint32_t done_counter;    // bumped by the child
  uint32_t runs;            // executions of the loop graph (1 + tail launches)
  uint32_t retries;
  int32_t error;
  uint32_t finished;
};

extern "C" __global__ void child_step(LoopState* s) {
  if (threadIdx.x != 0) return;
  __threadfence();
  atomicAdd(&s->done_counter, 1u);
}

extern "C" __global__ void loop_run(LoopState* s) {
  if (threadIdx.x != 0) return;
  if (s->runs++ == 0) s->t_start_ns = blink::global_timer_ns();
  auto child = reinterpret_cast<cudaGraphExec_t>(s->child_graph);
  for (int i = 0; i < blink::kMaxLaunchesPerRun; ++i) {
    if (s->steps >= s->target_steps) {
      s->t_end_ns = blink::global_timer_ns();
      s->finished = 1;
      return;
    }
    uint32_t target = blink::LoadAcquireGpu(&s->done_counter) + 1;
    cudaError_t err = blink::LaunchGraphRetrying(child, &s->retries);
    if (err != cudaSuccess) { s->error = err; return; }
    blink::WaitCounter(&s->done_counter, target);
    ++s->steps;
  }
  cudaError_t err = blink::RelaunchSelf();
  if (err != cudaSuccess) s->error = 1000 + err;
}
