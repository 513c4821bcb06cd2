// Reading memory ahead of the arithmetic, for the kernels of engine/csrc.
//
// A kernel that visits a buffer in an order the hardware prefetchers do not follow (rows many lines apart, or short
// runs that each start somewhere new) waits for memory one cache line at a time. Where that buffer is small and
// about to be used in full, one pass that reads a word of each of its lines, front to back, lets the prefetchers
// stream it into the caches first; the arithmetic then finds every line there.
#pragma once

#include <cstdint>
#include <cstring>

namespace cpuserve_warm {

constexpr int64_t kLine = 64;

// Reads one word of each cache line of [start, start + bytes); returns them combined, for `keep`
inline uint64_t read_lines(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  uint64_t sink = 0;
  for (int64_t o = 0; o < bytes; o += kLine) {
    uint64_t word;
    std::memcpy(&word, p + o, sizeof(word));
    sink ^= word;
  }
  return sink;
}

// Keeps reads wanted for their side effect alone from being optimized away
inline void keep(uint64_t sink) {
  volatile uint64_t kept = sink;
  (void)kept;
}

}  // namespace cpuserve_warm
