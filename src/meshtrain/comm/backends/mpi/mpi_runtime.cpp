#include "meshtrain/comm/backends/mpi/mpi_runtime.h"

#include <mpi.h>

#include <cctype>
#include <cstdlib>

#include "meshtrain/base/error.h"

namespace mt {
namespace {
void finalize_at_exit() {
  MpiRuntime::instance().finalize();
}

// "Open MPI v4.1.4, package: Debian OpenMPI, ..." -> "openmpi-4.1.4"
std::string short_library_name(const char* text) {
  std::string s(text);
  const auto v = s.find(" v");
  if (s.rfind("Open MPI", 0) == 0 && v != std::string::npos) {
    std::string version;
    for (size_t i = v + 2;
         i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.'); ++i) {
      version += s[i];
    }
    return "openmpi-" + version;
  }
  return s.substr(0, s.find(','));
}
}  // namespace

MpiRuntime& MpiRuntime::instance() {
  static MpiRuntime* runtime = new MpiRuntime();  // lives until exit; finalised by atexit
  return *runtime;
}

MpiRuntime::MpiRuntime() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) {
    MPI_Query_thread(&provided_);
  } else {
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided_);
    if (rc != MPI_SUCCESS) throw CommError(fmt::format("MPI_Init_thread failed with code {}", rc));
    owns_init_ = true;
    std::atexit(finalize_at_exit);
    // Errors become return codes the backend turns into CommError, instead of
    // aborting the job (the default MPI_ERRORS_ARE_FATAL).
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size_);
  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(version, &len);
  library_ = short_library_name(version);
}

bool MpiRuntime::thread_multiple() const {
  return provided_ >= MPI_THREAD_MULTIPLE;
}

std::unique_lock<std::mutex> MpiRuntime::lock() {
  if (thread_multiple()) return std::unique_lock<std::mutex>();
  return std::unique_lock<std::mutex>(mu_);
}

void MpiRuntime::mark_peer_lost(const std::string& /*why*/) {
  std::lock_guard<std::mutex> l(state_mu_);
  peer_lost_ = true;
}

bool MpiRuntime::peer_lost() const {
  std::lock_guard<std::mutex> l(state_mu_);
  return peer_lost_;
}

void MpiRuntime::finalize() {
  if (!owns_init_ || peer_lost()) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

}  // namespace mt
