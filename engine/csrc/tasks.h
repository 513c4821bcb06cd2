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

// Runs worker(next) once on each of up to at::get_num_threads() threads, in parallel. next() hands out the tasks
// [0, num_tasks) in increasing order, each once over all threads, then -1. A worker sets up its scratch, loops
//     for (int64_t task; (task = next()) >= 0;) ...
// and tears down whatever is per thread afterwards.
template <typename Worker>
void share_tasks(int64_t num_tasks, const Worker& worker) {
  if (num_tasks <= 0) return;
  std::atomic<int64_t> counter{0};
  const auto next = [&]() -> int64_t {
    const int64_t task = counter++;
    return task < num_tasks ? task : -1;
  };
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tasks), 1,
                   [&](int64_t, int64_t) { worker(next); });
}

// Units (tiles or column blocks) per task, about `per_thread` tasks a thread: of the two lengths nearest that, the
// one whose busiest thread gets fewer units. SmolLM2's o and down (18 tiles) as 9 tasks of 2 left one thread 10
// tiles to the other's 8; as 6 of 3, 9 each (2 threads, 512 rows: 573-593 -> 638-647 and 591-611 -> 643-657 G
// multiply-adds a second).
inline int64_t run_length(int64_t units, int64_t per_thread) {
  const int64_t threads = at::get_num_threads(), want = per_thread * threads;
  const auto busiest = [&](int64_t run) { return ((units + run - 1) / run + threads - 1) / threads * run; };
  const int64_t shorter = std::max<int64_t>(1, units / want), longer = (units + want - 1) / want;
  return busiest(shorter) < busiest(longer) ? shorter : longer;
}

}  // namespace cpuserve_tasks
