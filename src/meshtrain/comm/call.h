// Internal to the communicator: one issued call (its arguments, the tensors
// it keeps alive, its sequence number) and the shared state of an async
// call's handle.
#pragma once

#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "meshtrain/comm/collective_context.h"
#include "meshtrain/comm/options.h"
#include "meshtrain/tensor/tensor.h"

namespace mt::comm {

struct StartedOp;  // a send / recv started on the issuing thread (started_p2p.cpp)

struct OpState {
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  std::exception_ptr error;
  std::string description;
  // Set for send_now / recv_now: the handle's done() and wait() drive it.
  std::shared_ptr<StartedOp> started;
};

struct Call {
  Collective kind = Collective::barrier;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;
  std::vector<size_t> counts;   // v-variants: per-rank counts (all_to_allv: send counts)
  std::vector<size_t> counts2;  // all_to_allv: recv counts
  DType dtype = DType::u8;
  ReduceOp op = ReduceOp::sum;
  int root = -1;             // broadcast root, send/recv peer
  uint64_t counts_hash = 0;  // split: hash of a subgroup's rank list
  CollectiveOptions opts;
  std::vector<Tensor> keep;  // tensors an async call keeps alive
  uint64_t seq = 0;
  std::shared_ptr<OpState> state;  // async calls only
};

inline bool is_p2p(Collective c) {
  return c == Collective::send || c == Collective::recv;
}

}  // namespace mt::comm
