#include "meshtrain/comm/backends/self/self_transport.h"

#include "meshtrain/base/error.h"

namespace mt {

// A rank has no peer to message; the communicator rejects such calls before
// they get here, so reaching this is a bug.
std::unique_ptr<TransportRequest> SelfTransport::isend(int peer, uint32_t /*tag*/,
                                                       const void* /*buf*/, size_t /*bytes*/) {
  MT_CHECK(false, "self transport asked to send to rank {}", peer);
  return nullptr;
}

std::unique_ptr<TransportRequest> SelfTransport::irecv(int peer, uint32_t /*tag*/, void* /*buf*/,
                                                       size_t /*bytes*/) {
  MT_CHECK(false, "self transport asked to receive from rank {}", peer);
  return nullptr;
}

std::shared_ptr<Transport> SelfTransport::split(int group, const std::vector<int>& /*members*/,
                                                uint64_t /*split_id*/, Deadline /*deadline*/) {
  if (group < 0) return nullptr;
  return std::make_shared<SelfTransport>();
}

std::unique_ptr<Communicator> make_self_communicator(CommOptions options) {
  return std::make_unique<Communicator>(std::make_shared<SelfTransport>(), std::move(options));
}

}  // namespace mt
