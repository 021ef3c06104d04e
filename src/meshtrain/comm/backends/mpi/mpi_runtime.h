// The process's MPI library: initialised once (MPI_Init_thread asking for
// MPI_THREAD_MULTIPLE) on first use, finalised at process exit. Every MPI call
// of the mpi backend holds lock(), which serialises them when MPI provides
// less than MPI_THREAD_MULTIPLE and costs nothing otherwise.
//
// Communicators over MPI must be destroyed before exit. After a peer was
// found dead, MPI_Finalize would wait for it, so exit skips it (Open MPI then
// reports that the process ended without finalising; the error that caused
// it was already thrown). Thread-safe.
#pragma once

#include <mutex>
#include <string>

namespace mt {

class MpiRuntime {
 public:
  static MpiRuntime& instance();

  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }
  int thread_level() const { return provided_; }
  bool thread_multiple() const;
  // "openmpi-4.1.4" (from MPI_Get_library_version)
  const std::string& library() const { return library_; }

  std::unique_lock<std::mutex> lock();
  // A peer died: skip MPI_Finalize at exit.
  void mark_peer_lost(const std::string& why);
  bool peer_lost() const;
  // Finalises now unless a peer was lost (idempotent). Communicators over MPI
  // must be gone.
  void finalize();

 private:
  MpiRuntime();
  int provided_ = 0;
  int world_rank_ = 0;
  int world_size_ = 1;
  bool owns_init_ = false;
  std::string library_;
  mutable std::mutex mu_;  // serialises MPI calls below THREAD_MULTIPLE
  mutable std::mutex state_mu_;
  bool peer_lost_ = false;
};

}  // namespace mt
