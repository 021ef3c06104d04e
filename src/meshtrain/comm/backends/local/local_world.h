// Runs N ranks as threads of this process, each with its own Communicator
// over the `local` backend: the way every strategy runs and is tested
// without MPI. run() blocks until every rank's function has returned.
#pragma once

#include <cstddef>
#include <exception>
#include <functional>
#include <vector>

#include "meshtrain/comm/communicator.h"

namespace mt {

struct LocalWorldOptions {
  int size = 2;
  CommOptions comm;  // every rank's communicator options
  // Bytes of in-process "shared memory" per rank and group for the
  // shared_memory algorithms; 0 gives communicators without it (the
  // configuration of ranks on several nodes).
  size_t shm_bytes_per_rank = size_t{1} << 20;
};

class LocalWorld {
 public:
  using RankFn = std::function<void(Communicator&)>;
  // Runs fn on every rank; returns each rank's exception (null if it returned).
  static std::vector<std::exception_ptr> run_collect(const LocalWorldOptions& options,
                                                     const RankFn& fn);
  // Runs fn on every rank and rethrows the exception of the lowest failing rank.
  static void run(const LocalWorldOptions& options, const RankFn& fn);
  static void run(int size, const RankFn& fn);
};

}  // namespace mt
