#include "meshtrain/comm/backends/mpi/mpi_request.h"

#include "meshtrain/base/error.h"
#include "meshtrain/comm/backends/mpi/mpi_runtime.h"

namespace mt {

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", code);
  return std::string(text, static_cast<size_t>(len));
}

MpiRequest::~MpiRequest() {
  if (done_ || collective_) return;
  auto lock = MpiRuntime::instance().lock();
  for (MPI_Request& r : reqs) {
    if (r == MPI_REQUEST_NULL) continue;
    MPI_Cancel(&r);
    MPI_Request_free(&r);
  }
}

bool MpiRequest::test() {
  if (done_) return true;
  std::vector<MPI_Status> status(reqs.size());
  int flag = 0;
  int rc;
  {
    auto lock = MpiRuntime::instance().lock();
    rc = MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &flag, status.data());
  }
  if (rc == MPI_ERR_IN_STATUS) {
    for (const MPI_Status& s : status) {
      if (s.MPI_ERROR != MPI_SUCCESS && s.MPI_ERROR != MPI_ERR_PENDING) {
        throw CommError(fmt::format("{} failed: {}", what_, mpi_error_string(s.MPI_ERROR)));
      }
    }
  } else if (rc != MPI_SUCCESS) {
    throw CommError(fmt::format("{} failed: {}", what_, mpi_error_string(rc)));
  }
  if (!flag) return false;
  done_ = true;
  for (size_t i = 0; i < expect_bytes.size(); ++i) {
    if (expect_bytes[i] < 0) continue;
    int got = 0;
    MPI_Get_count(&status[i], MPI_BYTE, &got);
    if (got != expect_bytes[i]) {
      throw CommError(fmt::format("{}: the message has {} bytes but the receive expects {}", what_,
                                  got, expect_bytes[i]));
    }
  }
  return true;
}

}  // namespace mt
