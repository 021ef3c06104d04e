// Internal to the mpi backend: a pending MPI operation (one or more MPI
// requests, e.g. a large message in pieces) polled with MPI_Testall, plus the
// count arrays a v-collective needs to stay alive until it completes.
#pragma once

#include <mpi.h>

#include <string>
#include <vector>

#include "meshtrain/comm/transport.h"

namespace mt {

class MpiRequest : public TransportRequest {
 public:
  // collective: MPI forbids cancelling or freeing an unfinished collective,
  // so one destroyed early is left to MPI (its transport is broken anyway).
  MpiRequest(bool collective, std::string what) : collective_(collective), what_(std::move(what)) {}
  ~MpiRequest() override;
  bool test() override;

  std::vector<MPI_Request> reqs;
  std::vector<long long> expect_bytes;  // receives: bytes each piece must bring (-1: unchecked)
  std::vector<int> keep[4];             // counts / displacements of v-collectives

 private:
  bool collective_;
  bool done_ = false;
  std::string what_;
};

// "MPI_ERR_TRUNCATE: message truncated" for an MPI error code.
std::string mpi_error_string(int code);

}  // namespace mt
