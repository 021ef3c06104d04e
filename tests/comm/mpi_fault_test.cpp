// A rank that dies in the middle of a collective under mpirun: the survivors
// must fail with an error naming the lost rank, well within their timeout,
// instead of hanging.
//
// How it is run: this binary is the CTest test (a driver, not under mpirun).
// Each case starts `mpirun -np 3 <this binary> --worker MODE DIR` in its own
// process group. Rank 1 starts a large all-reduce and dies 5 ms into it
// (MODE exit: _exit(1); MODE kill: raise(SIGKILL)); ranks 0 and 2 write what
// they caught to DIR/rank<r>.txt. mpirun runs with
// `--mca orte_abort_on_non_zero_status 0`, without which it kills the
// survivors about a second after the death (before or after they report,
// racing). With it, Open MPI 4.1.4's mpirun exits by itself after an _exit(1)
// but hangs after a SIGKILL once every process is gone, so the driver waits
// for the reports, gives mpirun a grace period and then terminates the
// process group it started.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "meshtrain/base/timer.h"
#include "meshtrain/comm/backends/mpi/mpi_communicator.h"

extern char** environ;

namespace mt {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr int kTimeoutMs = 20'000;

int worker(const std::string& mode, const fs::path& dir) {
  CommOptions o;
  o.timeout = std::chrono::milliseconds(kTimeoutMs);
  auto c = make_mpi_communicator(o);
  c->barrier();
  const size_t count = size_t{1} << 24;
  std::vector<float> buf(count, 1.0f);
  CollectiveOptions opts;
  opts.algorithm = mode == "exit" ? CommAlgorithm::ring : CommAlgorithm::automatic;
  if (c->rank() == 1) {
    CommHandle h =
        c->all_reduce_async(buf.data(), buf.data(), count, DType::f32, ReduceOp::sum, opts);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (mode == "kill") raise(SIGKILL);
    _exit(1);
  }
  Stopwatch sw;
  std::string kind = "none";
  std::string message;
  try {
    c->all_reduce(buf.data(), buf.data(), count, DType::f32, ReduceOp::sum, opts);
  } catch (const TimeoutError& e) {
    kind = "timeout";
    message = e.what();
  } catch (const CommError& e) {
    kind = "comm";
    message = e.what();
  }
  std::ofstream(dir / fmt::format("rank{}.txt", c->rank())) << kind << "\n"
                                                            << sw.seconds() << "\n"
                                                            << message << "\n";
  // Stay a while, so that the other survivor finds rank 1 gone, not this one.
  std::this_thread::sleep_for(std::chrono::seconds(2));
  return 0;
}

struct Report {
  std::string kind;
  double seconds = 0;
  std::string message;
};

std::optional<Report> read_report(const fs::path& file) {
  std::ifstream in(file);
  Report r;
  std::string seconds;
  if (!std::getline(in, r.kind) || !std::getline(in, seconds) || !std::getline(in, r.message)) {
    return std::nullopt;
  }
  r.seconds = std::stod(seconds);
  return r;
}

std::string slurp(const fs::path& file) {
  std::ifstream in(file);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void run_case(const std::string& mode, bool mpirun_must_exit_by_itself) {
  const fs::path dir =
      fs::temp_directory_path() / fmt::format("mt_mpi_fault_{}_{}", mode, getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string self = fs::read_symlink("/proc/self/exe").string();
  const std::string log = (dir / "mpirun.log").string();
  std::vector<std::string> args = {MT_MPIEXEC,
                                   "--allow-run-as-root",
                                   "--oversubscribe",
                                   "--bind-to",
                                   "none",
                                   "--mca",
                                   "btl",
                                   "self,vader",
                                   "--mca",
                                   "orte_abort_on_non_zero_status",
                                   "0",
                                   "-np",
                                   "3",
                                   self,
                                   "--worker",
                                   mode,
                                   dir.string()};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);
  pid_t pid = 0;
  ASSERT_EQ(posix_spawn(&pid, argv[0], &actions, &attr, argv.data(), environ), 0);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);

  // Both survivors report well before their 20 s timeout.
  Stopwatch sw;
  std::optional<Report> r0, r2;
  while (sw.seconds() < 60 && !(r0 && r2)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    r0 = read_report(dir / "rank0.txt");
    r2 = read_report(dir / "rank2.txt");
  }
  // Then mpirun should end; it may hang after a SIGKILL (see the top).
  bool exited = false;
  int status = 0;
  for (Stopwatch grace; grace.seconds() < 15;) {
    if (waitpid(pid, &status, WNOHANG) == pid) {
      exited = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (!exited) {
    kill(-pid, SIGTERM);
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    kill(-pid, SIGKILL);
    waitpid(pid, &status, 0);
  }
  const std::string output = slurp(log);
  ASSERT_TRUE(r0 && r2) << "survivors did not report within 60 s; mpirun output:\n" << output;
  for (const Report* r : {&*r0, &*r2}) {
    EXPECT_EQ(r->kind, "comm") << r->message;
    EXPECT_THAT(r->message, HasSubstr("rank 1 (pid "));
    EXPECT_THAT(r->message, HasSubstr("is no longer running"));
    EXPECT_THAT(r->message, HasSubstr("all_reduce #2"));
    EXPECT_LT(r->seconds, kTimeoutMs / 1000.0 / 2) << r->message;
  }
  if (mpirun_must_exit_by_itself) {
    EXPECT_TRUE(exited) << "mpirun did not exit after the survivors did; output:\n" << output;
  }
  fs::remove_all(dir);
}

TEST(MpiFault, RankThatExitsMidCollectiveIsNamedBySurvivors) {
  run_case("exit", true);
}

TEST(MpiFault, RankKilledMidCollectiveIsNamedBySurvivors) {
  run_case("kill", false);
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "--worker") {
    try {
      return mt::worker(argv[2], argv[3]);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "worker failed: %s\n", e.what());
      return 1;
    }
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
