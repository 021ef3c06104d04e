// Cross-mesh resharding benchmark (spmd/reshard.h): a tensor moved from a
// layout on ranks {0, 1} (a "source mesh") to one on ranks {2, 3} (a
// "destination mesh"), the resharding plan ("value", ms) against what a
// plain implementation does ("peer_ms"): one source rank assembles the
// whole tensor (an all-reduce or all-gather over the source group where it
// is partial or split) and sends it whole to every destination rank, which
// keeps its box.
//
//   mpirun -np 4 build/bench/comm/reshard_bench [--quick]
//   bench/run reshard [--quick]
//
// Cases (a 1024 x 1024 f32 tensor, 4 MiB; --quick: 512 x 512):
//   replicated_to_replicated: both meshes replicate it;
//   partial_to_replicated: the source holds addends (a row-parallel output);
//   split0_to_split1: rows split on the source, columns on the destination.
// Each line has both times (median and best of 15 samples, --quick 5, of the
// slowest rank's time, the two sides sampled alternately), the bytes all
// ranks sent per call and those that crossed from the source mesh to the
// destination mesh (the communicators' counters), for both sides.
//
// Every comparison is verified before it is timed: both sides run once and
// every destination rank's piece must equal the same box of the tensor
// bitwise (addends are small integers, so the sums are exact). A failure
// prints a line with an "error" and exits 1 on every rank.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "meshtrain/base/timer.h"
#include "meshtrain/comm/backends/mpi/mpi_communicator.h"
#include "meshtrain/spmd/reshard.h"

namespace {

using namespace mt;

class Failure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

double load_average() {
  double l = -1;
  if (FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf", &l) != 1) l = -1;
    std::fclose(f);
  }
  return l;
}

void emit(Communicator& c, const std::string& json) {
  if (c.rank() == 0) std::printf("%s\n", json.c_str());
}

float value_at(int64_t flat) {
  return static_cast<float>(flat % 251 + 1);
}

Tensor box_values(const Shape& shape, const Box& b) {
  Tensor whole = Tensor::empty(shape, DType::f32);
  for (int64_t i = 0; i < shape.numel(); ++i) whole.data<float>()[i] = value_at(i);
  Tensor piece = Tensor::empty(b.shape(), DType::f32);
  copy_box_out(whole, b, piece);
  return piece;
}

struct Case {
  std::string name;
  TensorLayout from, to;
};

struct Side {
  uint64_t bytes = 0;        // all ranks, per call (payload, handshakes left out)
  uint64_t cross_bytes = 0;  // from {0, 1} to {2, 3}, per call
};

struct Runner {
  Communicator& world;
  std::unique_ptr<Communicator> source_group;  // ranks {0, 1}
  Shape shape;
  int samples;

  double slowest(double t) const {
    world.all_reduce(&t, &t, 1, DType::f64, ReduceOp::max);
    return t;
  }

  // The plain way: source rank 0 assembles the whole tensor, sends it whole
  // to 2 and 3, which cut out their boxes.
  void plain(const Case& c, const Tensor& src, Tensor& dst) const {
    const int me = world.rank();
    Tensor whole = Tensor::empty(shape, DType::f32);
    const size_t n = static_cast<size_t>(shape.numel());
    if (me < 2) {
      if (c.from.partial) {
        std::memcpy(whole.raw(), src.raw(), n * 4);
        source_group->all_reduce(whole, ReduceOp::sum);
      } else if (src.numel() == shape.numel()) {
        std::memcpy(whole.raw(), src.raw(), n * 4);
      } else {
        // Pieces of rows (split0): gathered in rank order (even halves).
        source_group->all_gather(src.raw(), whole.raw(), static_cast<size_t>(src.numel()),
                                 DType::f32);
      }
      if (me == 0) {
        world.send(whole.raw(), n, DType::f32, 2);
        world.send(whole.raw(), n, DType::f32, 3);
      }
    } else {
      world.recv(whole.raw(), n, DType::f32, 0);
      copy_box_out(whole, *c.to.box_of(me), dst);
    }
  }

  Side counted(const std::function<void()>& fn) const {
    world.barrier();
    world.reset_counters();
    if (source_group) source_group->reset_counters();
    fn();
    // Payload only: the collectives' agreement handshakes are left out.
    auto payload = [](const CommCounters& cc) {
      uint64_t n = 0;
      for (const auto& [kind, k] : cc.by_collective) n += kind == "handshake" ? 0 : k.bytes_sent;
      return n;
    };
    const CommCounters wc = world.counters();
    uint64_t mine = payload(wc) + (source_group ? payload(source_group->counters()) : 0);
    uint64_t cross = 0;
    for (int q = 2; q < 4 && world.rank() < 2; ++q) {
      cross += wc.by_peer[static_cast<size_t>(q)].bytes_sent;
    }
    double v[2] = {static_cast<double>(mine), static_cast<double>(cross)};
    world.all_reduce(v, v, 2, DType::f64, ReduceOp::sum);
    return {static_cast<uint64_t>(v[0]), static_cast<uint64_t>(v[1])};
  }

  void verify(const Case& c, const Tensor& dst, const std::string& side) const {
    const Box* b = c.to.box_of(world.rank());
    double bad = 0;
    if (b != nullptr) {
      const Tensor want = box_values(shape, *b);
      bad = std::memcmp(want.raw(), dst.raw(), want.nbytes()) != 0 ? 1.0 : 0.0;
    }
    world.all_reduce(&bad, &bad, 1, DType::f64, ReduceOp::sum);
    if (bad > 0) {
      throw Failure(fmt::format("{} ({}): {} destination rank(s) hold wrong values", c.name, side,
                                static_cast<int>(bad)));
    }
  }

  void run_case(const Case& c) const {
    const int me = world.rank();
    const ReshardPlan plan = plan_reshard(shape, DType::f32, c.from, c.to);
    Tensor src;
    if (const Box* b = c.from.box_of(me)) {
      src = box_values(shape, *b);
      if (c.from.partial) {  // addends: 1 on rank 0, the rest on rank 1
        for (int64_t i = 0; i < src.numel(); ++i) {
          src.data<float>()[i] = me == 0 ? 1.0f : src.data<float>()[i] - 1.0f;
        }
      }
    }
    const Box* db = c.to.box_of(me);
    Tensor dst = db != nullptr ? Tensor::zeros(db->shape(), DType::f32) : Tensor();
    auto ours = [&] { execute_reshard(world, plan, src, dst); };
    auto theirs = [&] { plain(c, src, dst); };
    ours();
    verify(c, dst, "plan");
    if (db != nullptr) dst = Tensor::zeros(db->shape(), DType::f32);
    theirs();
    verify(c, dst, "plain");
    const Side so = counted(ours), st = counted(theirs);
    if (so.bytes != plan.total_bytes()) {
      throw Failure(fmt::format("{}: the ranks sent {} bytes, the plan says {}", c.name, so.bytes,
                                plan.total_bytes()));
    }
    std::vector<double> ta, tb;
    for (int s = 0; s < samples; ++s) {
      for (int k = 0; k < 2; ++k) {
        world.barrier();
        const int64_t t0 = now_ns();
        (k == 0 ? std::function<void()>(ours) : std::function<void()>(theirs))();
        (k == 0 ? ta : tb).push_back(slowest(static_cast<double>(now_ns() - t0) * 1e-6));
      }
    }
    std::sort(ta.begin(), ta.end());
    std::sort(tb.begin(), tb.end());
    const double a = ta[ta.size() / 2], b = tb[tb.size() / 2];
    emit(world,
         fmt::format("{{\"suite\": \"reshard\", \"name\": \"reshard_{}_{}x{}\", \"unit\": \"ms\", "
                     "\"meshtrain\": {:.3f}, \"peer\": {:.3f}, \"ratio\": {:.3f}, "
                     "\"value\": {:.3f}, \"value_best\": {:.3f}, \"peer_ms\": {:.3f}, "
                     "\"peer_best_ms\": {:.3f}, \"bytes_sent\": {}, \"peer_bytes_sent\": {}, "
                     "\"cross_mesh_bytes\": {}, \"peer_cross_mesh_bytes\": {}, "
                     "\"peer_is\": \"assemble on source rank 0, send whole to each destination\", "
                     "\"ranks\": {}, \"samples\": {}, \"load_average\": {:.2f}}}",
                     c.name, shape[0], shape[1], a, b, b / a, a, ta.front(), b, tb.front(),
                     so.bytes, st.bytes, so.cross_bytes, st.cross_bytes, world.size(), samples,
                     load_average()));
  }
};

}  // namespace

int main(int argc, char** argv) {
  bool quick = std::getenv("MT_BENCH_QUICK") != nullptr;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--quick") quick = true;
  }
  auto comm = make_mpi_communicator();
  if (comm->size() != 4) {
    emit(*comm,
         "{\"suite\": \"reshard\", \"name\": \"reshard_bench\", \"error\": \"needs 4 "
         "ranks (mpirun -np 4)\"}");
    return 1;
  }
  const int64_t side = quick ? 512 : 1024;
  const Shape shape({side, side});
  const std::vector<int> src{0, 1}, dst{2, 3};
  const int both[] = {0, 1};
  Runner r{*comm, comm->subgroup(both, "source"), shape, quick ? 5 : 15};
  try {
    r.run_case({"replicated_to_replicated", TensorLayout::replicated(shape, src),
                TensorLayout::replicated(shape, dst)});
    r.run_case({"partial_to_replicated", TensorLayout::partial_sum(shape, src),
                TensorLayout::replicated(shape, dst)});
    r.run_case({"split0_to_split1", TensorLayout::split(shape, src, 0),
                TensorLayout::split(shape, dst, 1)});
  } catch (const Failure& e) {
    std::string msg = e.what();
    std::replace(msg.begin(), msg.end(), '"', '\'');
    emit(*comm,
         fmt::format("{{\"suite\": \"reshard\", \"name\": \"reshard_bench\", \"error\": \"{}\"}}",
                     msg));
    return 1;
  }
  return 0;
}
