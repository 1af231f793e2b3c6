// Work items shared out between the calling thread and helpers on XLA's intra-op thread pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

// Runs work(i) for every i in [0, count), each exactly once, and returns when all are done.
// Items go out through an atomic counter, so a slow or late thread takes fewer. Helpers that
// start after the items are gone find none and return; the caller never waits for a helper to
// start, so a busy pool cannot stall it.
template <typename Work>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t count, const Work& work) {
  struct Progress {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto progress = std::make_shared<Progress>();
  auto run = [progress, count, work]() {
    for (int64_t i; (i = progress->next.fetch_add(1)) < count;) {
      work(i);
      progress->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), count) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([run] { run(); });
  run();
  while (progress->done.load(std::memory_order_acquire) < count) {
  }
}

}  // namespace jaxserve
