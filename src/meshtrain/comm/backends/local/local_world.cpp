#include "meshtrain/comm/backends/local/local_world.h"

#include <memory>
#include <thread>

#include "meshtrain/base/error.h"
#include "meshtrain/comm/backends/local/local_transport.h"

namespace mt {

std::vector<std::exception_ptr> LocalWorld::run_collect(const LocalWorldOptions& options,
                                                        const RankFn& fn) {
  if (options.size < 1) {
    throw ConfigError(fmt::format("local world size must be at least 1, got {}", options.size));
  }
  auto fabric = std::make_shared<LocalFabric>(options.size, options.shm_bytes_per_rank);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(options.size));
  std::vector<std::thread> threads;
  for (int r = 0; r < options.size; ++r) {
    threads.emplace_back([&, r] {
      std::string why;
      try {
        Communicator comm(std::make_shared<LocalTransport>(fabric, fabric->world_group(), r),
                          options.comm);
        fn(comm);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = std::current_exception();
        why = e.what();
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
        why = "unknown exception";
      }
      fabric->rank_ended(r, why);
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

void LocalWorld::run(const LocalWorldOptions& options, const RankFn& fn) {
  for (const auto& e : run_collect(options, fn)) {
    if (e) std::rethrow_exception(e);
  }
}

void LocalWorld::run(int size, const RankFn& fn) {
  LocalWorldOptions o;
  o.size = size;
  run(o, fn);
}

}  // namespace mt
