// The world of one rank: no peers, so every collective reduces to a local copy
// (the algorithms handle size 1 themselves) and split() yields another
// single-rank transport. Never blocks. Owned by its Communicator.
#pragma once

#include <memory>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/comm/transport.h"

namespace mt {

class SelfTransport : public Transport {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "self"; }
  std::unique_ptr<TransportRequest> isend(int peer, uint32_t tag, const void* buf,
                                          size_t bytes) override;
  std::unique_ptr<TransportRequest> irecv(int peer, uint32_t tag, void* buf, size_t bytes) override;
  std::shared_ptr<Transport> split(int group, const std::vector<int>& members, uint64_t split_id,
                                   Deadline deadline) override;
};

// A communicator of world size 1 (the default for single-process runs).
std::unique_ptr<Communicator> make_self_communicator(CommOptions options = {});

}  // namespace mt
