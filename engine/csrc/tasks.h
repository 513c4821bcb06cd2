// Work shared through a counter, for the kernels of engine/csrc.
//
// at::parallel_for splits a range into one fixed share per thread, so a parallel region ends when its slowest
// thread does. On a serving node the engine's cores also run the proxy, the ingress and the runtime's own
// processes: when one of them preempts a thread for a millisecond, a fixed share makes the other threads wait for
// it. Here each thread takes the next task from a shared counter instead, so a preempted thread holds up only
// the task it is in, and tasks of unequal size (sequences of different lengths) balance themselves.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace cpuserve_tasks {

// Runs run(state, task) for every task in [0, num_tasks), in parallel; state = make_state() once per thread
// (scratch buffers). Tasks are handed out in increasing order.
template <typename MakeState, typename Run>
void for_each_task(int64_t num_tasks, const MakeState& make_state, const Run& run) {
  if (num_tasks <= 0) return;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tasks), 1, [&](int64_t, int64_t) {
    auto state = make_state();
    for (int64_t task = next++; task < num_tasks; task = next++) run(state, task);
  });
}

}  // namespace cpuserve_tasks
