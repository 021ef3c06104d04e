#include "meshtrain/cli/launch.h"

#include <dirent.h>
#include <fcntl.h>
#include <mpi.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>

#include "meshtrain/base/error.h"
#include "meshtrain/comm/backends/mpi/mpi_runtime.h"

namespace mt {

namespace {

using Clock = std::chrono::steady_clock;

std::string self_exe() {
  char exe[4096];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n <= 0) throw Error(fmt::format("cannot find this executable: {}", std::strerror(errno)));
  exe[n] = '\0';
  return exe;
}

const char* signal_name(int sig) {
  switch (sig) {
    case SIGINT:
      return "SIGINT";
    case SIGTERM:
      return "SIGTERM";
    case SIGHUP:
      return "SIGHUP";
    default:
      return "signal";
  }
}

// The processes whose parent is `parent`: mpirun's ranks on this machine
// (Open MPI 4.1 forks them directly, each in its own process group).
std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  DIR* dir = opendir("/proc");
  if (dir == nullptr) return out;
  while (const dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long pid = std::strtol(e->d_name, &end, 10);
    if (*end != '\0' || pid <= 0) continue;
    std::ifstream f(fmt::format("/proc/{}/stat", pid));
    std::string line;
    if (!std::getline(f, line)) continue;
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    const auto rp = line.rfind(')');
    if (rp == std::string::npos || rp + 2 > line.size()) continue;
    std::istringstream rest(line.substr(rp + 2));
    char state = 0;
    long ppid = 0;
    if (rest >> state >> ppid && ppid == parent) out.push_back(static_cast<pid_t>(pid));
  }
  closedir(dir);
  return out;
}

// Restores the signal mask on every way out of run_under_mpirun.
struct MaskGuard {
  sigset_t old;
  ~MaskGuard() { pthread_sigmask(SIG_SETMASK, &old, nullptr); }
};

}  // namespace

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_STEP_ID"}) {
    if (std::getenv(v) != nullptr) return true;
  }
  return false;
}

void abort_distributed_job(int exit_code) {
  int initialized = 0, finalized = 0, size = 1;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size <= 1) return;
  if (MpiRuntime::instance().peer_lost()) {
    // A peer process is gone (it was killed, or crashed). The launcher ends
    // the job with the status of the first rank it sees end abnormally; give
    // it a moment to see the dead one first, so the job's exit status is that
    // rank's own (137 for SIGKILL, docs/errors.md), not this rank's 1. The
    // launcher usually kills this process within that moment; the error is
    // already printed.
    std::this_thread::sleep_for(std::chrono::seconds(2));
  }
  MPI_Abort(MPI_COMM_WORLD, exit_code);
}

bool launcher_stderr_is_tty() {
  const char* v = std::getenv(kStderrTtyEnv);
  return v != nullptr && std::strcmp(v, "1") == 0;
}

int run_under_mpirun(const LaunchOptions& o, const std::vector<std::string>& args) {
  // MESHTRAIN_MPIRUN names another mpirun (e.g. mpirun.openmpi, or a wrapper).
  const char* mpirun_env = std::getenv("MESHTRAIN_MPIRUN");
  const std::string mpirun = mpirun_env != nullptr && *mpirun_env ? mpirun_env : "mpirun";
  std::vector<std::string> cmd = {mpirun, "-np", std::to_string(o.nproc)};
  if (geteuid() == 0) cmd.emplace_back("--allow-run-as-root");
  // mpirun runs in a process group of its own (so that the terminal's Ctrl-C
  // reaches only this process); reading the terminal from there would stop it.
  for (const char* a : {"--stdin", "none", "--bind-to", "none"}) cmd.emplace_back(a);
  if (o.hostfile.empty()) {
    // One machine: ranks may outnumber cores, and must not be pinned to one
    // core each when they run several threads.
    for (const char* a : {"--oversubscribe", "--mca", "btl", "self,vader"}) cmd.emplace_back(a);
  } else {
    for (const char* a : {"--hostfile", o.hostfile.c_str(), "--mca", "btl", "self,vader,tcp"}) {
      cmd.emplace_back(a);
    }
  }
  // Rank 0's stderr is mpirun's pipe: tell it whether the user's is a terminal.
  if (isatty(STDERR_FILENO) != 0) {
    setenv(kStderrTtyEnv, "1", 1);
    cmd.emplace_back("-x");
    cmd.emplace_back(kStderrTtyEnv);
  } else {
    unsetenv(kStderrTtyEnv);
  }
  cmd.emplace_back(self_exe());
  cmd.insert(cmd.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : cmd) argv.push_back(s.data());
  argv.push_back(nullptr);

  // The signals to pass on are blocked here and taken with sigtimedwait; the
  // child gets the old mask back before exec.
  sigset_t watched;
  sigemptyset(&watched);
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) sigaddset(&watched, s);
  MaskGuard guard{};
  pthread_sigmask(SIG_BLOCK, &watched, &guard.old);

  int report[2];  // the child writes errno here if exec fails
  if (pipe2(report, O_CLOEXEC) != 0) {
    throw Error(fmt::format("cannot start mpirun: pipe: {}", std::strerror(errno)));
  }
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    pthread_sigmask(SIG_SETMASK, &guard.old, nullptr);
    execvp(argv[0], argv.data());
    const int err = errno;
    [[maybe_unused]] const ssize_t w = write(report[1], &err, sizeof(err));
    _exit(127);
  }
  const int fork_errno = errno;
  close(report[1]);
  if (pid < 0) {
    close(report[0]);
    throw Error(fmt::format("cannot start mpirun: fork: {}", std::strerror(fork_errno)));
  }
  setpgid(pid, pid);  // also here: no signal may find it still in ours
  int exec_errno = 0;
  ssize_t got = 0;
  do {
    got = read(report[0], &exec_errno, sizeof(exec_errno));
  } while (got < 0 && errno == EINTR);
  close(report[0]);
  if (got == static_cast<ssize_t>(sizeof(exec_errno))) {
    waitpid(pid, nullptr, 0);
    throw Error(fmt::format(
        "cannot start {} to launch {} ranks: {} (mpirun is provided by the Debian package "
        "openmpi-bin; MESHTRAIN_MPIRUN names another)",
        mpirun, o.nproc, std::strerror(exec_errno)));
  }

  int first_signal = 0;
  bool killed = false;
  std::optional<Clock::time_point> kill_at;
  auto kill_all = [&] {
    for (pid_t r : children_of(pid)) kill(r, SIGKILL);
    kill(-pid, SIGKILL);
    killed = true;
  };
  for (;;) {
    int status = 0;
    const pid_t w = waitpid(pid, &status, WNOHANG);
    if (w == pid) {
      if (killed) return 128 + first_signal;
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
      return 1;
    }
    if (w < 0 && errno != EINTR) {
      throw Error(fmt::format("waiting for mpirun (pid {}): {}", pid, std::strerror(errno)));
    }
    const timespec tick{0, 100'000'000};
    const int sig = sigtimedwait(&watched, nullptr, &tick);
    if (sig == SIGINT || sig == SIGTERM || sig == SIGHUP) {
      if (first_signal == 0) {
        first_signal = sig;
        kill_at = Clock::now() + o.stop_grace;
        const std::vector<pid_t> ranks = children_of(pid);
        // Ranks on other machines (or not started yet) get it through mpirun.
        const bool via_mpirun = !o.hostfile.empty() || ranks.empty();
        fmt::print(stderr,
                   "meshtrain: {}: passing it on to the {} local rank{}{}; still running in {:.0f} "
                   "s (or at a second signal) they are killed\n",
                   signal_name(sig), ranks.size(), ranks.size() == 1 ? "" : "s",
                   via_mpirun ? " and to mpirun" : "",
                   std::chrono::duration<double>(o.stop_grace).count());
        std::fflush(stderr);
        for (pid_t r : ranks) kill(r, sig);
        if (via_mpirun) kill(pid, sig);
      } else if (!killed) {
        fmt::print(stderr, "meshtrain: {} again: killing the ranks\n", signal_name(sig));
        kill_all();
      }
    }
    if (kill_at && !killed && Clock::now() >= *kill_at) {
      fmt::print(stderr, "meshtrain: ranks still running {:.0f} s after {}: killing them\n",
                 std::chrono::duration<double>(o.stop_grace).count(), signal_name(first_signal));
      kill_all();
    }
  }
}

int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  const long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

}  // namespace mt
