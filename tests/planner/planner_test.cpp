// The planner's cost model and simulator: operator times against hand
// values, the simulator on tiny programs against closed forms (GPipe and
// 1F1B bubbles, ring all-reduce, overlap of gradient buckets with
// backward), the trainer's own memory plan, deduplicated rank programs and
// determinism (the trace file bytes included).
#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/temp_dir.h"
#include "meshtrain/base/error.h"
#include "meshtrain/comm/backends/local/local_world.h"
#include "meshtrain/graph/autodiff.h"
#include "meshtrain/graph/builder.h"
#include "meshtrain/graph/collective.h"
#include "meshtrain/graph/cost.h"
#include "meshtrain/planner/cost_model.h"
#include "meshtrain/planner/simulator.h"
#include "meshtrain/spmd/collective_runner.h"
#include "meshtrain/spmd/pipeline_runtime.h"
#include "meshtrain/spmd/pipeline_stage.h"
#include "meshtrain/spmd/plan.h"
#include "meshtrain/spmd/schedule.h"
#include "meshtrain/spmd/shorthand.h"
#include "meshtrain/train/pipeline_training.h"
#include "meshtrain/train/training_plan.h"

namespace mt::planner {
namespace {

DeviceKind device(double peak = 1e12, double bw = 1e11) {
  DeviceKind k;
  k.name = "test";
  k.peak_flops_f32 = peak;
  k.peak_flops_bf16 = 4 * peak;
  k.memory_bytes = 1e12;
  k.memory_bandwidth = bw;
  k.default_efficiency = 0.5;
  return k;
}

// n ranks, one per node, every inter-node link (L, W).
ClusterModel cluster(int n, double latency = 0, double bandwidth = 0, int node_size = 1) {
  ClusterModel c;
  c.source = "test";
  c.kinds = {device()};
  c.kind_of.assign(static_cast<size_t>(n), 0);
  c.layout = ClusterLayout::by_node_size(n, node_size);
  c.layout.inter_node = {latency, bandwidth};
  return c;
}

TEST(OpSeconds, FlopsOrBytesWhicheverIsLarger) {
  Graph g;
  Builder b(g);
  const ValueId x = b.input("x", {64, 128}, DType::f32);
  const ValueId w = b.param("w", {128, 256}, ParamInit{});
  const ValueId y = b.matmul(x, w);
  const ValueId z = b.relu(y);
  DeviceKind k = device(1e12, 1e11);
  k.efficiency["matmul"] = 0.8;
  const Node& mm = g.node(0);
  const Node& relu = g.node(1);
  ASSERT_EQ(mm.op, OpKind::matmul);
  const double flops = 2.0 * 64 * 128 * 256;
  EXPECT_DOUBLE_EQ(op_seconds(k, g, mm), flops / (1e12 * 0.8));
  EXPECT_DOUBLE_EQ(op_seconds(k, g, mm, 2.0), 2 * flops / (1e12 * 0.8));
  // relu: memory-bound, 64x256 f32 read and written.
  EXPECT_DOUBLE_EQ(op_seconds(k, g, relu),
                   std::max(op_cost(g, relu).flops / (1e12 * 0.5), 2.0 * 64 * 256 * 4 / 1e11));
  (void)z;
  // bf16 inputs use the bf16 peak.
  Graph h;
  Builder hb(h);
  const ValueId xa = hb.input("x", {64, 128}, DType::bf16);
  const ValueId wa = hb.input("w", {128, 256}, DType::bf16);
  hb.matmul(xa, wa);
  k.memory_bandwidth = 1e14;  // compute-bound at the bf16 peak too
  EXPECT_DOUBLE_EQ(op_seconds(k, h, h.node(0)), flops / (4e12 * 0.8));
}

// DeviceKind::weight_bandwidth: a matmul's weights (read) and weight
// gradient (written) move at that rate on top of the FLOP time, instead of
// hiding under max(FLOP time, byte time); the other operands' bytes still
// overlap the FLOPs. By hand on a forward matmul and the training graph's.
TEST(OpSeconds, WeightTrafficAddsToTheFlops) {
  Graph g;
  Builder b(g);
  const ValueId x = b.input("x", {64, 128}, DType::f32);
  const ValueId w = b.param("w", {128, 256}, ParamInit{});
  const ValueId y = b.matmul(x, w);
  build_backward(g, b.sum_to(b.relu(y), Shape{}));
  DeviceKind k = device(1e12, 1e11);
  k.efficiency["matmul"] = 0.8;
  k.op_overhead_s = 5e-6;
  const double flops = 2.0 * 64 * 128 * 256;
  const double t_flops = flops / (1e12 * 0.8);  // 5.2 us: above x and y's 1 us of bytes
  ASSERT_GT(t_flops, (64.0 * 128 + 64.0 * 256) * 4 / 1e11);
  const Node& fwd = g.node(0);
  ASSERT_EQ(fwd.op, OpKind::matmul);
  EXPECT_DOUBLE_EQ(op_seconds(k, g, fwd), t_flops + 5e-6);  // no setting: hidden
  k.weight_bandwidth = 1e10;
  const double t_w = 128.0 * 256 * 4 / 1e10;  // 13.1 us
  EXPECT_DOUBLE_EQ(op_seconds(k, g, fwd), t_flops + t_w + 5e-6);
  EXPECT_DOUBLE_EQ(op_seconds(k, g, fwd, 2.0), 2 * (t_flops + t_w) + 5e-6);
  // Which values do not scale with the batch: w and its gradient, not x, y.
  const std::vector<char> wv = weight_values(g);
  EXPECT_TRUE(wv[static_cast<size_t>(w)]);
  EXPECT_FALSE(wv[static_cast<size_t>(x)]);
  EXPECT_FALSE(wv[static_cast<size_t>(y)]);
  ASSERT_NE(g.grad_of(w), kNoValue);
  EXPECT_TRUE(wv[static_cast<size_t>(g.grad_of(w))]);
  // The backward: dW = x^T dy writes a weight-sized gradient (x needs none):
  // the same 13.1 us of traffic, the FLOPs the forward's.
  std::vector<double> traffic;
  const std::vector<double> t = node_seconds(k, g, DType::f32, 1.0, nullptr, &traffic);
  int matmuls = 0;
  double sum = 0;
  for (NodeId i = 0; i < g.num_nodes(); ++i) {
    const Node& n = g.node(i);
    const auto at = static_cast<size_t>(i);
    if (n.op != OpKind::matmul) {
      EXPECT_EQ(traffic[at], 0.0) << i;
      continue;
    }
    ++matmuls;
    sum += traffic[at];
    EXPECT_DOUBLE_EQ(traffic[at], t_w) << i;
    EXPECT_DOUBLE_EQ(t[at], t_flops + t_w + 5e-6) << i;
  }
  EXPECT_EQ(matmuls, 2);
  EXPECT_DOUBLE_EQ(sum, 2 * t_w);
  // A 16-bit copy of the weights is a weight too (value_bytes: 2 per element).
  Graph h;
  Builder hb(h);
  const ValueId xh = hb.input("x", {64, 128}, DType::bf16);
  const ValueId wh = hb.param("w", {128, 256}, ParamInit{});
  hb.matmul(xh, hb.cast(wh, DType::bf16));
  k.memory_bandwidth = 1e14;
  const std::vector<double> th = node_seconds(k, h, DType::bf16);
  EXPECT_DOUBLE_EQ(th[1], flops / (4e12 * 0.8) + 128.0 * 256 * 2 / 1e10 + 5e-6);
}

// DeviceKind::cache_bytes: a rank whose weights and gradients (2 x its
// parameters' f32 bytes) fit its share of the node's cache prices no
// weight traffic; the share is the cache over the node's ranks.
TEST(OpSeconds, WeightsInTheCacheShareMoveNoTraffic) {
  Graph g;
  Builder b(g);
  b.matmul(b.input("x", {64, 512}, DType::f32), b.param("w", {512, 512}, ParamInit{}));
  const double twice = 2.0 * 512 * 512 * 4;  // 2 MiB
  ClusterModel c = cluster(4, 0, 0, 4);      // 4 ranks on one node
  c.kinds[0].weight_bandwidth = 1e10;
  c.kinds[0].cache_bytes = 4 * twice;  // exactly each rank's share
  EXPECT_EQ(rank_device(c, 3, g).weight_bandwidth, 0.0);
  c.kinds[0].cache_bytes = 4 * twice - 4;  // a byte short each
  EXPECT_EQ(rank_device(c, 3, g).weight_bandwidth, 1e10);
  c.layout = ClusterLayout::by_node_size(4, 2);  // 2 ranks per node: twice the share
  EXPECT_EQ(rank_device(c, 3, g).weight_bandwidth, 0.0);
  c.kinds[0].cache_bytes = 0;  // no cache: always priced
  EXPECT_EQ(rank_device(c, 3, g).weight_bandwidth, 1e10);
}

// op_overhead_s (the executor's own time per kernel, `meshtrain calibrate`'s
// op_overhead_us): added once to every operator that costs anything, not
// slowed down (the emulation stretches the kernel only); views and
// collectives stay free; a fused run pays it once, on its last operator.
TEST(OpSeconds, OverheadOncePerKernel) {
  Graph g;
  Builder b(g);
  const ValueId x = b.input("x", {64, 128}, DType::f32);
  const ValueId w = b.param("w", {128, 256}, ParamInit{});
  const ValueId y = b.matmul(x, w);               // node 0
  const ValueId r = b.reshape(y, {256, 64});      // node 1: a view
  b.scale(b.relu(b.reshape(r, {64, 256})), 2.0);  // reshape 2, relu 3, scale 4
  DeviceKind k = device(1e12, 1e11);
  k.efficiency["matmul"] = 0.8;
  k.op_overhead_s = 5e-6;
  const double flops = 2.0 * 64 * 128 * 256;
  EXPECT_DOUBLE_EQ(op_seconds(k, g, g.node(0)), flops / (1e12 * 0.8) + 5e-6);
  EXPECT_DOUBLE_EQ(op_seconds(k, g, g.node(0), 3.0), 3 * flops / (1e12 * 0.8) + 5e-6);
  EXPECT_EQ(op_seconds(k, g, g.node(1)), 0.0);
  // relu: 64x256 f32 read and written at 1e11 B/s (memory-bound), + 5 us.
  EXPECT_DOUBLE_EQ(op_seconds(k, g, g.node(3)), 2.0 * 64 * 256 * 4 / 1e11 + 5e-6);
  // Fused: relu and scale are one kernel (reads y through the view, writes
  // the result): 2 tensors' bytes + one overhead, on the scale.
  k.fused_elementwise = true;
  const std::vector<double> t = node_seconds(k, g, DType::f32);
  EXPECT_EQ(t[3], 0.0);
  EXPECT_DOUBLE_EQ(t[4], 2.0 * 64 * 256 * 4 / 1e11 + 5e-6);
  // A collective costs no compute time, overhead or not.
  Graph h;
  Builder hb(h);
  hb.reduce_from_group(hb.input("x", {8}, DType::f32), 0);
  EXPECT_EQ(op_seconds(k, h, h.node(0)), 0.0);
}

// Without runtime settings every operator is its own pass: node_seconds is
// op_seconds node by node, whatever the run's precision.
TEST(NodeSeconds, WithoutRuntimeSettingsEachOperatorIsOp_seconds) {
  Graph g;
  Builder b(g);
  const ValueId x = b.input("x", {64, 256}, DType::f32);
  const ValueId w = b.param("w", {256, 256}, ParamInit{});
  b.relu(b.scale(b.matmul(b.cast(x, DType::bf16), b.cast(w, DType::bf16)), 0.5));
  const DeviceKind k = device(1e12, 1e11);
  for (DType prec : {DType::f32, DType::bf16}) {
    const std::vector<double> t = node_seconds(k, g, prec, 2.0);
    ASSERT_EQ(t.size(), static_cast<size_t>(g.num_nodes()));
    for (NodeId i = 0; i < g.num_nodes(); ++i) {
      EXPECT_DOUBLE_EQ(t[static_cast<size_t>(i)], op_seconds(k, g, g.node(i), 2.0)) << i;
    }
  }
}

// half_activations under a bf16 run: floating-point tensors at 2 bytes an
// element, casts between floating types free (the same 16-bit tensor, the
// weights' copy written by the optimizer); under an f32 run nothing changes.
TEST(NodeSeconds, HalfActivationsHandValues) {
  Graph g;
  Builder b(g);
  const ValueId x = b.input("x", {64, 256}, DType::f32);
  const ValueId w = b.param("w", {256, 128}, ParamInit{});
  const ValueId r = b.relu(x);  // node 0
  const ValueId y = b.matmul(b.cast(r, DType::bf16), b.cast(w, DType::bf16), false, false,
                             DType::f32);  // casts 1, 2; matmul 3
  b.scale(y, 2.0);                         // node 4
  DeviceKind k = device(1e12, 1e9);        // slow memory: every operator memory-bound
  k.half_activations = true;
  const std::vector<double> t = node_seconds(k, g, DType::bf16);
  EXPECT_DOUBLE_EQ(t[0], 2.0 * 64 * 256 * 2 / 1e9);  // relu: read + write, 2 bytes each
  EXPECT_EQ(t[1], 0.0);                              // cast of an activation
  EXPECT_EQ(t[2], 0.0);                              // cast of a weight
  EXPECT_DOUBLE_EQ(t[3], (64.0 * 256 + 256.0 * 128 + 64.0 * 128) * 2 / 1e9);
  EXPECT_DOUBLE_EQ(t[4], 2.0 * 64 * 128 * 2 / 1e9);  // f32 in the graph, 16-bit priced
  const std::vector<double> f = node_seconds(k, g, DType::f32);
  for (NodeId i = 0; i < g.num_nodes(); ++i) {
    EXPECT_DOUBLE_EQ(f[static_cast<size_t>(i)], op_seconds(k, g, g.node(i))) << i;
  }
  const Pricing half = Pricing::of(k, DType::bf16);
  EXPECT_EQ(element_bytes(half, DType::f32), 2u);
  EXPECT_EQ(element_bytes(half, DType::i32), 4u);
  EXPECT_EQ(element_bytes(Pricing::of(k, DType::f32), DType::f32), 4u);
  // AdamW: parameter, gradient and two moments read and written in f32,
  // plus the 16-bit copy written.
  EXPECT_EQ(optimizer_bytes_per_element(half, 2), 4.0 * 2 * 4 + 2);
  EXPECT_EQ(optimizer_bytes_per_element(Pricing::of(k, DType::f32), 2), 4.0 * 2 * 4);
}

// fused_elementwise: a run of consecutive element-wise operators is one
// kernel that reads its outside inputs once and writes what is read after
// it; a matmul ends the run.
TEST(NodeSeconds, FusedElementwiseRunIsOnePass) {
  Graph g;
  Builder b(g);
  const int64_t M = 64, N = 256;
  const ValueId a = b.input("a", {M, N}, DType::f32);
  const ValueId c = b.input("c", {M, N}, DType::f32);
  const ValueId w = b.param("w", {N, N}, ParamInit{});
  const ValueId s1 = b.add(a, c);                        // node 0: run 1
  const ValueId s2 = b.scale(s1, 0.5);                   // node 1: run 1
  const ValueId s3 = b.relu(b.reshape(s2, {N, M}));      // reshape 2 (joins), relu 3: run 1
  const ValueId y = b.matmul(b.reshape(s3, {M, N}), w);  // reshape 4 (transparent), matmul 5
  const ValueId z = b.add(y, s1);                        // node 6: run 2, reads s1 again
  b.relu(z);                                             // node 7: run 2, output read by nothing
  DeviceKind k = device(1e15, 1e9);                      // memory-bound
  k.fused_elementwise = true;
  const std::vector<double> t = node_seconds(k, g, DType::f32);
  const double e = static_cast<double>(M * N) * 4;  // one tensor's bytes
  // Run 1 reads a and c and writes s1 (read after the run) and s3; s2 and
  // the reshape stay on chip. Charged to its last operator.
  EXPECT_EQ(t[0], 0.0);
  EXPECT_EQ(t[1], 0.0);
  EXPECT_EQ(t[2], 0.0);
  EXPECT_DOUBLE_EQ(t[3], 4 * e / 1e9);
  EXPECT_DOUBLE_EQ(t[5], op_seconds(k, g, g.node(5)));
  // Run 2 reads y and s1, writes relu's output (read by nothing: a result).
  EXPECT_EQ(t[6], 0.0);
  EXPECT_DOUBLE_EQ(t[7], 3 * e / 1e9);
  // A value kept for later (a pipeline pass's stash) is written too.
  const std::vector<std::string> kept = {g.value(z).name};
  EXPECT_DOUBLE_EQ(node_seconds(k, g, DType::f32, 1.0, &kept)[7], 4 * e / 1e9);
  // The slowdown scales the run; with both settings the bytes are 16-bit.
  EXPECT_DOUBLE_EQ(node_seconds(k, g, DType::f32, 3.0)[3], 3 * 4 * e / 1e9);
  k.half_activations = true;
  EXPECT_DOUBLE_EQ(node_seconds(k, g, DType::bf16)[3], 4 * e / 2 / 1e9);
}

// attention_dropout: each softmax (forward) and softmax_grad (backward)
// carries a dropout kernel of its own, E x (2 x element + 1) bytes over the
// bandwidth, outside any fused run; other operators are unchanged.
TEST(NodeSeconds, AttentionDropoutHandValues) {
  Graph g;
  Builder b(g);
  const int64_t H = 4, T = 32;
  const ValueId x = b.input("x", {H, T, T}, DType::f32);
  const ValueId w = b.param("w", {H, T, T}, ParamInit{});
  const ValueId p = b.softmax(b.scale(b.mul(x, w), 0.5), /*causal=*/true);
  build_backward(g, b.sum_to(p, Shape{}));
  DeviceKind k = device(1e15, 1e9);
  k.attention_dropout = true;
  const std::vector<double> t = node_seconds(k, g, DType::f32);
  const double e = static_cast<double>(H * T * T);
  int softmaxes = 0, grads = 0;
  for (NodeId i = 0; i < g.num_nodes(); ++i) {
    const Node& n = g.node(i);
    const double extra = n.op == OpKind::softmax || n.op == OpKind::softmax_grad
                             ? e * (2 * 4 + 1) / 1e9  // f32: read 4, write 4, mask 1
                             : 0.0;
    softmaxes += n.op == OpKind::softmax;
    grads += n.op == OpKind::softmax_grad;
    EXPECT_DOUBLE_EQ(t[static_cast<size_t>(i)], op_seconds(k, g, n) + extra) << i;
    EXPECT_DOUBLE_EQ(dropout_seconds(k, Pricing::of(k, DType::f32), g, n, 2.0), 2 * extra) << i;
  }
  EXPECT_EQ(softmaxes, 1);
  EXPECT_EQ(grads, 1);
  // Under 16-bit activations and fusion: 2 x 2 + 1 bytes an element, added
  // to whatever the fused run charges the softmax node.
  k.half_activations = true;
  k.fused_elementwise = true;
  const std::vector<double> fused = node_seconds(k, g, DType::bf16);
  k.attention_dropout = false;
  const std::vector<double> fused_plain = node_seconds(k, g, DType::bf16);
  for (NodeId i = 0; i < g.num_nodes(); ++i) {
    const Node& n = g.node(i);
    const double extra =
        n.op == OpKind::softmax || n.op == OpKind::softmax_grad ? e * (2 * 2 + 1) / 1e9 : 0.0;
    EXPECT_DOUBLE_EQ(fused[static_cast<size_t>(i)], fused_plain[static_cast<size_t>(i)] + extra)
        << i;
  }
  // No memory bandwidth stated: nothing to price it by.
  k.attention_dropout = true;
  k.memory_bandwidth = 0;
  for (NodeId i = 0; i < g.num_nodes(); ++i) {
    EXPECT_EQ(dropout_seconds(k, Pricing::of(k, DType::f32), g, g.node(i)), 0.0) << i;
  }
}

// Tile and wave quantization of matmuls on hand values (the A100 example
// of NVIDIA's matmul guide: 108 SMs, 256x128 tiles).
TEST(WaveEfficiency, HandValues) {
  DeviceKind k = device(1e12, 1e15);
  k.efficiency["matmul"] = 0.8;
  auto eff = [&](int64_t M, int64_t N, int64_t K, int64_t batch = 1) {
    Graph g;
    Builder b(g);
    const ValueId x = b.input("x", batch > 1 ? Shape{batch, M, K} : Shape{M, K}, DType::bf16);
    const ValueId w = b.input("w", batch > 1 ? Shape{batch, K, N} : Shape{K, N}, DType::bf16);
    b.matmul(x, w);
    return std::make_pair(wave_efficiency(k, g, g.node(0)), op_seconds(k, g, g.node(0)));
  };
  EXPECT_EQ(eff(2048, 3840, 64).first, 1.0);  // no compute_units: not modelled
  k.compute_units = 108;
  k.matmul_tile = {256, 128};
  // 8 x 30 = 240 tiles (16 x 15 turned): 3 waves of 108.
  EXPECT_DOUBLE_EQ(eff(2048, 3840, 64).first, 240.0 / 324);
  // [MAMF]'s best shape fills 32 waves exactly.
  EXPECT_DOUBLE_EQ(eff(6912, 16384, 64).first, 1.0);
  // 100 x 100: one partial tile of 128 x 256 in one wave.
  EXPECT_DOUBLE_EQ(eff(100, 100, 64).first, 100.0 * 100 / (108.0 * 256 * 128));
  // Batched: 12 x (8 x 16) = 1536 tiles, 15 waves (either orientation).
  EXPECT_DOUBLE_EQ(eff(2048, 2048, 64, 12).first, 1536.0 / (15 * 108));
  // op_seconds: the FLOP time at efficiency x fill.
  EXPECT_DOUBLE_EQ(eff(2048, 3840, 64).second,
                   2.0 * 2048 * 3840 * 64 / (4e12 * 0.8 * (240.0 / 324)));
}

// Programs of a pipeline schedule with forward f and backward b per stage,
// in the form build_programs makes (sends on the comm lane).
Programs pipeline_programs(const PipelineSchedule& s, double f, double b, uint64_t bytes,
                           double bi = 0, double bw = 0) {
  Programs out;
  const int p = s.stages;
  std::map<std::pair<int, int>, int> done;
  for (int st = 0; st < p; ++st) {
    Program prog;
    prog.signature = fmt::format("stage {}", st);
    for (int q = 0; q < p; ++q) prog.peers.push_back(fmt::format("pp{}", q));
    std::map<std::pair<int, int>, int> last;
    for (const PipelineAction& a : s.actions[static_cast<size_t>(st)]) {
      Task t;
      t.name = describe(a);
      const int64_t tag = (a.microbatch << 8) | a.stage;
      switch (a.kind) {
        case ActionKind::forward:
          t.seconds = f;
          t.category = "forward";
          last[{a.microbatch, a.stage}] = static_cast<int>(prog.tasks.size());
          break;
        case ActionKind::backward:
          t.seconds = b;
          t.category = "backward";
          last[{a.microbatch, a.stage}] = static_cast<int>(prog.tasks.size());
          break;
        case ActionKind::backward_input:
          t.seconds = bi;
          t.category = "backward";
          last[{a.microbatch, a.stage}] = static_cast<int>(prog.tasks.size());
          break;
        case ActionKind::backward_weight:
          t.seconds = bw;
          t.category = "backward";
          break;
        case ActionKind::send_activation:
        case ActionKind::send_grad:
          t.kind = Task::Kind::send;
          t.lane = 1;
          t.peer = a.peer;
          t.bytes = bytes;
          t.tag = (a.kind == ActionKind::send_grad ? 1 << 20 : 0) | tag;
          t.after = {last.at({a.microbatch, a.stage})};
          break;
        case ActionKind::recv_activation:
          t.kind = Task::Kind::recv;
          t.peer = a.peer;
          t.tag = (a.microbatch << 8) | (a.stage - 1);
          break;
        case ActionKind::recv_grad:
          t.kind = Task::Kind::recv;
          t.peer = a.peer;
          t.tag = (1 << 20) | (a.microbatch << 8) | (a.stage + 1);
          break;
        default:
          ADD_FAILURE() << "unexpected action";
      }
      prog.tasks.push_back(t);
    }
    out.programs.push_back(prog);
    RankBinding bind;
    bind.program = st;
    for (int q = 0; q < p; ++q) bind.peer_ranks.push_back(q);
    out.ranks.push_back(bind);
  }
  return out;
}

TEST(Simulator, PipelineBubblesMatchTheClosedForms) {
  for (ScheduleKind kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b}) {
    for (auto [p, m] : {std::pair{2, 4}, std::pair{4, 8}, std::pair{4, 4}}) {
      const double f = 1e-3, b = 2e-3;
      const PipelineSchedule s = make_schedule(kind, p, m);
      const StepEstimate e = simulate(pipeline_programs(s, f, b, 1000), cluster(p));
      EXPECT_NEAR(e.step_s, (m + p - 1) * (f + b), 1e-12) << schedule_name(kind) << p << m;
      double busy = 0, total = 0;
      for (const RankEstimate& r : e.ranks) {
        busy += r.compute_s;
        total += e.step_s;
      }
      EXPECT_NEAR(1 - busy / total, formula_idle_fraction(kind, p, m, 1), 1e-9);
      EXPECT_EQ(e.distinct_programs, p);
    }
  }
}

TEST(Simulator, EverySchedulesMakespanIsTheSchedulesOwn) {
  // Interleaved and zero-bubble too: with free links the simulator's step is
  // the makespan spmd/schedule.h's simulate() gives for the same costs, and
  // the interleaved bubble is (p-1)/(v m + p-1).
  const double f = 1e-3, bi = 1e-3, bw = 1e-3;
  struct Case {
    ScheduleKind kind;
    int p, m, v;
  };
  for (const Case& k :
       {Case{ScheduleKind::interleaved, 2, 4, 2}, Case{ScheduleKind::interleaved, 4, 8, 2},
        Case{ScheduleKind::zero_bubble, 4, 8, 1}, Case{ScheduleKind::one_f_one_b, 3, 5, 1}}) {
    const PipelineSchedule s = make_schedule(k.kind, k.p, k.m, k.v);
    const StepEstimate e = simulate(pipeline_programs(s, f, bi + bw, 1000, bi, bw), cluster(k.p));
    const ScheduleSimulation want = simulate(s, ActionCosts{f, bi, bw});
    EXPECT_NEAR(e.step_s, want.makespan * 1.0, 1e-12) << schedule_name(k.kind) << k.p << k.m;
    if (k.kind == ScheduleKind::interleaved) {
      double busy = 0;
      for (const RankEstimate& r : e.ranks) busy += r.compute_s;
      EXPECT_NEAR(1 - busy / (k.p * e.step_s), formula_idle_fraction(k.kind, k.p, k.m, k.v), 1e-9);
    }
  }
}

TEST(Simulator, GPipeWithLinkLatency) {
  // Each of the p-1 hops costs L + bytes/W once on the way in and once on
  // the way back: step = (m+p-1)(f+b) + 2(p-1)(L + bytes/W).
  const int p = 4, m = 6;
  const double f = 1e-3, b = 2e-3, L = 1e-4, W = 1e9;
  const uint64_t bytes = 100'000;
  const PipelineSchedule s = make_schedule(ScheduleKind::gpipe, p, m);
  const StepEstimate e = simulate(pipeline_programs(s, f, b, bytes), cluster(p, L, W));
  EXPECT_NEAR(e.step_s, (m + p - 1) * (f + b) + 2 * (p - 1) * (L + bytes / W), 1e-12);
  EXPECT_EQ(e.ranks[0].bytes_sent, static_cast<uint64_t>(m) * bytes);
}

// One all-reduce of `count` f32 over n ranks after `compute` seconds.
Programs all_reduce_programs(int n, size_t count, double compute) {
  Programs out;
  Program prog;
  prog.groups = {"world"};
  Task c;
  c.name = "work";
  c.category = "forward";
  c.seconds = compute;
  prog.tasks.push_back(c);
  Task ar;
  ar.kind = Task::Kind::collective;
  ar.name = "all_reduce";
  ar.group = 0;
  ar.shape = 0;
  prog.tasks.push_back(ar);
  prog.shapes.push_back({Collective::all_reduce, count, {}, 4, 0});
  out.programs.push_back(prog);
  std::vector<int> all(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) all[static_cast<size_t>(r)] = r;
  out.groups = {all};
  for (int r = 0; r < n; ++r) out.ranks.push_back(RankBinding{0, {0}, {}});
  return out;
}

TEST(Simulator, RingAllReduceStartsWhenTheLastMemberArrives) {
  const int n = 4;
  const double L = 1e-5, W = 1e9;
  const size_t count = 4 * 250'000;
  const double B = count * 4.0;
  ClusterModel c = cluster(n, L, W);
  c.slowdown = {1, 1, 3, 1};  // rank 2 arrives at 3 ms
  Programs progs = all_reduce_programs(n, count, 1e-3);
  // Per-rank programs differ by slowdown here only through the compute time;
  // give rank 2 its own program.
  progs.programs.push_back(progs.programs[0]);
  progs.programs[1].tasks[0].seconds = 3e-3;
  progs.ranks[2].program = 1;
  const StepEstimate e = simulate(progs, c);
  const double ring = 2.0 * (n - 1) / n * B / W + 2.0 * (n - 1) * L;
  EXPECT_NEAR(e.step_s, 3e-3 + ring, 1e-12);
  EXPECT_NEAR(e.ranks[0].idle_s, 2e-3, 1e-12);  // waited for rank 2
  EXPECT_NEAR(e.ranks[2].idle_s, 0.0, 1e-12);
  EXPECT_EQ(e.ranks[1].bytes_sent, static_cast<uint64_t>(2 * (n - 1) * B / n));
}

// DeviceKind::compute_jitter: ranks of equal programs reach a collective at
// one predicted time, but measured ranks jitter and the call waits for the
// last of them: it starts E[max of n standard normals] x jitter x the
// compute since the previous synchronisation later (E = 1/sqrt(pi) for 2,
// 1.0294 for 4), and a second call on the same lane counts only the
// compute since the first.
TEST(Simulator, ComputeJitterDelaysEachCollectiveByTheLastMembersLateness) {
  EXPECT_DOUBLE_EQ(expected_max_normal(1), 0.0);
  EXPECT_NEAR(expected_max_normal(2), 1 / std::sqrt(M_PI), 1e-9);
  EXPECT_NEAR(expected_max_normal(4), 1.029375, 1e-5);
  EXPECT_NEAR(expected_max_normal(8), 1.423600, 1e-5);
  const double L = 1e-5, W = 1e9, work = 4e-3, j = 0.03;
  const size_t count = 250'000;
  for (int n : {2, 4}) {
    ClusterModel c = cluster(n, L, W);
    Programs progs = all_reduce_programs(n, count, work);
    // A second segment of half the work and another all-reduce.
    Program& p = progs.programs[0];
    p.tasks.push_back(p.tasks[0]);
    p.tasks.back().seconds = work / 2;
    p.tasks.push_back(p.tasks[1]);
    p.tasks.back().seq = 1;
    const double plain = simulate(progs, c).step_s;
    c.kinds[0].compute_jitter = j;
    const StepEstimate e = simulate(progs, c);
    EXPECT_NEAR(e.step_s - plain, expected_max_normal(n) * j * (work + work / 2), 1e-12) << n;
    // The wait is idle time, not compute.
    EXPECT_NEAR(e.ranks[0].compute_s, 1.5 * work, 1e-12);
  }
}

TEST(Simulator, BucketsOverlapBackward) {
  // Backward in two halves; bucket 0 ready after the first half, bucket 1
  // after the second; buckets run on the comm lane in order, the optimizer
  // waits for both. Closed form: max(b1 + c0, b1 + b2) + c1 (+ optimizer).
  const double b1 = 4e-3, b2 = 2e-3, opt = 1e-3, W = 1e9;
  const size_t count = 1'000'000;  // 4 MB: ring at 2 ranks, c = B / W
  const double c0 = count * 4.0 / W;
  Programs out;
  Program prog;
  prog.groups = {"world"};
  auto compute = [&](const char* name, double s, std::vector<int> after = {}) {
    Task t;
    t.name = name;
    t.category = "backward";
    t.seconds = s;
    t.after = std::move(after);
    prog.tasks.push_back(t);
    return static_cast<int>(prog.tasks.size()) - 1;
  };
  auto bucket = [&](int seq, int after) {
    Task t;
    t.kind = Task::Kind::collective;
    t.lane = 1;
    t.name = "bucket";
    t.group = 0;
    t.seq = seq;
    t.shape = 0;
    t.after = {after};
    prog.tasks.push_back(t);
    return static_cast<int>(prog.tasks.size()) - 1;
  };
  prog.shapes.push_back({Collective::all_reduce, count, {}, 4, 0});
  const int h1 = compute("backward 1", b1);
  const int k0 = bucket(0, h1);
  const int h2 = compute("backward 2", b2);
  const int k1 = bucket(1, h2);
  compute("optimizer", opt, {k0, k1});
  out.programs.push_back(prog);
  out.groups = {{0, 1}};
  out.ranks = {RankBinding{0, {0}, {}}, RankBinding{0, {0}, {}}};
  const StepEstimate e = simulate(out, cluster(2, 0, W));
  EXPECT_NEAR(e.step_s, std::max(b1 + c0, b1 + b2) + c0 + opt, 1e-12);
  EXPECT_NEAR(e.ranks[0].comm_s, 2 * c0, 1e-12);
}

TEST(Simulator, DeadlockIsAnError) {
  Programs progs = all_reduce_programs(3, 10, 1e-3);
  progs.groups = {{0, 1, 2}};
  Program lonely;
  lonely.signature = "no collective";
  lonely.tasks.push_back(Task{});
  progs.programs.push_back(lonely);
  progs.ranks[2] = RankBinding{1, {}, {}};
  EXPECT_THROW(simulate(progs, cluster(3)), InternalError);
}

TrainerOptions mlp_options(int world) {
  TrainerOptions o;
  o.batch_size = 64;
  o.eval = false;
  o.dist.dp.bucket_bytes = 64 * 1024;
  (void)world;
  return o;
}

ModelSpec mlp() {
  ModelSpec s;
  s.kind = "mlp";
  s.hidden = {128, 64};
  return s;
}

TEST(CostModel, DataParallelUsesTheTrainersPlanAndOneProgram) {
  const int n = 4;
  const ModelSpec spec = mlp();
  const TrainerOptions o = mlp_options(n);
  const ClusterModel c = cluster(n, 1e-5, 1e9);
  const Programs progs = build_programs(spec, o, c);
  EXPECT_EQ(progs.programs.size(), 1u);
  const StepEstimate e = simulate(progs, c);
  ASSERT_EQ(e.ranks.size(), static_cast<size_t>(n));
  const TrainingPlan tp = plan_training(spec, o, 0, n);
  EXPECT_EQ(e.ranks[0].peak_memory_bytes, tp.total_bytes());
  // Every gradient element crosses the ring: 2 (n-1)/n of the buckets per rank
  // (each bucket's ring splits it evenly up to one element per rank).
  const double want = 2.0 * (n - 1) / n * tp.param_count * 4;
  EXPECT_NEAR(static_cast<double>(e.ranks[1].bytes_sent), want, want * 1e-3);
  EXPECT_GT(e.step_s, 0);
  EXPECT_GT(e.mfu, 0);
  EXPECT_LT(e.mfu, 1);
  // Slowing one rank slows the step (everyone waits at the buckets).
  ClusterModel slow = c;
  slow.slowdown = {1, 1, 1, 2};
  const StepEstimate es = estimate_step(spec, o, slow);
  EXPECT_GT(es.step_s, e.step_s);
  EXPECT_EQ(build_programs(spec, o, slow).programs.size(), 2u);
}

// The per-kernel overhead lands in a data-parallel rank's compute time
// once per operator of its training graph that costs anything.
TEST(CostModel, OpOverheadAddsOncePerKernelOfTheStep) {
  const int n = 2;
  const ModelSpec spec = mlp();
  const TrainerOptions o = mlp_options(n);
  ClusterModel c = cluster(n, 1e-5, 1e9);
  const StepEstimate e0 = simulate(build_programs(spec, o, c), c);
  TrainerOptions one = o;
  const TrainingGraph tg = build_training_graph(spec, one, o.batch_size / n, 0);
  const Graph& g = tg.model.graph;
  int kernels = 0;
  for (NodeId i = 0; i < g.num_nodes(); ++i) {
    const OpCost cost = op_cost(g, g.node(i));
    if (!is_group_op(g.node(i).op) && (cost.flops > 0 || cost.bytes > 0)) ++kernels;
  }
  ASSERT_GT(kernels, 10);
  c.kinds[0].op_overhead_s = 7e-6;
  const StepEstimate e1 = simulate(build_programs(spec, o, c), c);
  for (int r = 0; r < n; ++r) {
    EXPECT_NEAR(
        e1.ranks[static_cast<size_t>(r)].compute_s - e0.ranks[static_cast<size_t>(r)].compute_s,
        kernels * 7e-6, 1e-12)
        << r;
  }
  EXPECT_GT(e1.step_s, e0.step_s);
}

TEST(CostModel, TensorAndPipelinePlansDeduplicatePrograms) {
  ModelSpec spec;
  spec.kind = "gpt";
  spec.layers = 4;
  spec.d_model = 64;
  spec.heads = 4;
  spec.seq_len = 16;
  spec.vocab = 64;
  TrainerOptions o;
  o.batch_size = 16;
  o.eval = false;
  const int world = 8;
  ParallelShorthand sh;
  sh.tp = 2;
  sh.pp = 2;
  sh.microbatches = 4;
  const ModelGraph m = build_model(spec, o.batch_size);
  o.dist.plan = std::make_shared<Plan>(
      expand_shorthand(sh, ShorthandModel{"gpt", spec.d_model / spec.heads}, m.graph, world));
  const ClusterModel c = cluster(world, 1e-5, 10e9, 2);
  const Programs progs = build_programs(spec, o, c);
  // 2 stages x 2 tensor coordinates; the 2 data-parallel replicas share them.
  EXPECT_EQ(progs.programs.size(), 4u);
  const StepEstimate e = simulate(progs, c);
  EXPECT_GT(e.step_s, 0);
  for (const RankEstimate& r : e.ranks) {
    EXPECT_GT(r.compute_s, 0);
    EXPECT_GT(r.peak_memory_bytes, 0);
    EXPECT_GT(r.bytes_sent, 0u);
    EXPECT_LE(r.compute_s, e.step_s * (1 + 1e-12));
  }
}

// A program built for one rank and taken by a rank of another tensor group
// (a slower rank, or a rank on another device kind, gets its own program
// built from the graph of the first rank with its tensor coordinates) names
// its collectives' groups by mesh axis, bound to that rank's own groups:
// dp=2 x tp=2 with one slow rank, and with the second replica on another
// device kind, neither throws nor deadlocks, and the slow rank slows the step.
TEST(CostModel, ProgramsSharedAcrossTensorGroupsUseTheRanksOwnGroups) {
  ModelSpec spec;
  spec.kind = "gpt";
  spec.layers = 2;
  spec.d_model = 32;
  spec.heads = 4;
  spec.seq_len = 8;
  spec.vocab = 64;
  const int world = 4;
  TrainerOptions o = mlp_options(world);
  o.batch_size = 8;
  ParallelShorthand sh;
  sh.tp = 2;
  const ModelGraph m = build_model(spec, o.batch_size);
  o.dist.plan = std::make_shared<Plan>(
      expand_shorthand(sh, ShorthandModel{"gpt", spec.d_model / spec.heads}, m.graph, world));
  ASSERT_EQ(o.dist.plan->mesh.axis_size("dp"), 2);
  const ClusterModel even = cluster(world, 1e-5, 10e9, 2);
  const StepEstimate e = estimate_step(spec, o, even);

  ClusterModel slow = even;
  slow.slowdown = {1, 1, 1, 3};
  const Programs progs = build_programs(spec, o, slow);
  EXPECT_EQ(progs.programs.size(), 3u);  // tp coordinates 0, 1, and the slow rank 3
  // Rank 3's tensor group is [2, 3], not rank 1's [0, 1].
  const RankBinding& b3 = progs.ranks[3];
  const Program& p3 = progs.programs[static_cast<size_t>(b3.program)];
  for (size_t s = 0; s < p3.groups.size(); ++s) {
    const std::vector<int>& ranks = progs.groups[static_cast<size_t>(b3.group_ids[s])];
    EXPECT_TRUE(std::find(ranks.begin(), ranks.end(), 3) != ranks.end())
        << "slot " << p3.groups[s] << " of rank 3 is ranks " << fmt::format("{}", ranks);
  }
  const StepEstimate es = simulate(progs, slow);
  EXPECT_GT(es.step_s, e.step_s);

  ClusterModel mixed = even;
  mixed.kinds.push_back(device(0.5e12));
  mixed.kinds.back().name = "half";
  mixed.kind_of = {0, 0, 1, 1};
  const StepEstimate em = estimate_step(spec, o, mixed);
  EXPECT_GT(em.step_s, e.step_s);
}

// The search's cache of cut stage passes: 1F1B and GPipe of one shape share
// them (hits), and what they predict is what an uncached build predicts.
TEST(CostModel, CachedStagePassesPredictTheSame) {
  ModelSpec spec;
  spec.kind = "gpt";
  spec.layers = 4;
  spec.d_model = 32;
  spec.heads = 4;
  spec.seq_len = 8;
  spec.vocab = 64;
  const int world = 4;
  TrainerOptions o = mlp_options(world);
  o.batch_size = 8;
  const ModelGraph m = build_model(spec, o.batch_size);
  const ClusterModel c = cluster(world, 1e-5, 10e9, 2);
  BuildCache cache;
  for (ScheduleKind kind : {ScheduleKind::one_f_one_b, ScheduleKind::gpipe}) {
    ParallelShorthand sh;
    sh.tp = 2;
    sh.pp = 2;
    sh.microbatches = 4;
    sh.schedule = kind;
    o.dist.plan = std::make_shared<Plan>(
        expand_shorthand(sh, ShorthandModel{"gpt", spec.d_model / spec.heads}, m.graph, world));
    const StepEstimate plain = simulate(build_programs(spec, o, c), c);
    const StepEstimate cached = simulate(build_programs(spec, o, c, &cache), c);
    EXPECT_EQ(plain.step_s, cached.step_s) << schedule_name(kind);
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(plain.ranks[static_cast<size_t>(r)].peak_memory_bytes,
                cached.ranks[static_cast<size_t>(r)].peak_memory_bytes);
      EXPECT_EQ(plain.ranks[static_cast<size_t>(r)].bytes_sent,
                cached.ranks[static_cast<size_t>(r)].bytes_sent);
    }
  }
  EXPECT_EQ(cache.misses, 2);  // one per tensor coordinate
  EXPECT_EQ(cache.hits, 2);    // GPipe took 1F1B's
}

// The tensor-parallel collectives of a lowered program cost the planner
// what the runtime's CollectiveRunner states for them on live communicators
// (threads as ranks, one node: shared memory), rank by rank.
TEST(CostModel, TensorParallelBytesAreTheRunnersStatedCosts) {
  ModelSpec gpt;
  gpt.kind = "gpt";
  gpt.layers = 2;
  gpt.d_model = 32;
  gpt.heads = 4;
  gpt.seq_len = 8;
  struct Case {
    ModelSpec spec;
    int tp;
    bool sp;
  };
  // MLP at tp 2 (its head's 10 classes split in two); GPT at tp 4, with and
  // without sequence parallelism (all-reduce, all-gather, reduce-scatter,
  // the vocabulary-parallel gathers).
  for (const Case& k : {Case{mlp(), 2, false}, Case{gpt, 4, false}, Case{gpt, 4, true}}) {
    TrainerOptions o = mlp_options(k.tp);
    o.batch_size = 8;
    ParallelShorthand sh;
    sh.tp = k.tp;
    sh.sp = k.sp;
    const ModelGraph m = build_model(k.spec, o.batch_size);
    const ShorthandModel sm{k.spec.kind, k.spec.kind == "gpt" ? k.spec.d_model / k.spec.heads : 1};
    o.dist.plan = std::make_shared<Plan>(expand_shorthand(sh, sm, m.graph, k.tp));
    ClusterModel c = cluster(k.tp, 0, 0, k.tp);  // one node, no emulation
    const Programs progs = build_programs(k.spec, o, c);
    EXPECT_EQ(progs.programs.size(), static_cast<size_t>(k.tp));
    const StepEstimate e = simulate(progs, c);
    LocalWorldOptions lo;
    lo.size = k.tp;
    LocalWorld::run(lo, [&](Communicator& world) {
      const int r = world.rank();
      const TrainingGraph tg = build_training_graph(k.spec, o, o.batch_size, r);
      CommCollectiveRunner runner(world, tg.lowered.groups);
      uint64_t want = 0;
      for (const Node& n : tg.model.graph.nodes()) {
        if (communicates(n.op)) want += runner.cost_of(tg.model.graph, n).bytes_sent;
      }
      EXPECT_GT(want, 0u);
      EXPECT_EQ(e.ranks[static_cast<size_t>(r)].bytes_sent, want)
          << k.spec.kind << " tp " << k.tp << " sp " << k.sp << " rank " << r;
    });
  }
}

// A pipeline's point-to-point bytes per rank (boundary activations and
// gradients, the tied embedding's gradient exchange) are what the pipeline
// runtime predicts for its own sends.
TEST(CostModel, PipelineBytesAreTheRuntimesPrediction) {
  ModelSpec spec;
  spec.kind = "gpt";
  spec.layers = 4;
  spec.d_model = 32;
  spec.heads = 4;
  spec.seq_len = 8;
  for (ScheduleKind kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b}) {
    TrainerOptions o = mlp_options(2);
    o.batch_size = 8;
    ParallelShorthand sh;
    sh.pp = 2;
    sh.microbatches = 4;
    sh.schedule = kind;
    const ModelGraph m = build_model(spec, o.batch_size);
    const Plan plan = expand_shorthand(sh, ShorthandModel{"gpt", 8}, m.graph, 2);
    o.dist.plan = std::make_shared<Plan>(plan);
    const ClusterModel c = cluster(2, 1e-5, 1e9);
    const StepEstimate e = estimate_step(spec, o, c);
    LocalWorld::run(2, [&](Communicator& world) {
      const ModelGraph mb = build_model(spec, o.batch_size / sh.microbatches);
      const PipelineCut cut = cut_pipeline(mb.graph, mb.loss, plan.stages);
      PipelineRuntime rt(world, cut, make_schedule(kind, 2, sh.microbatches), {});
      EXPECT_GT(rt.predicted_bytes_sent(), 0u);
      EXPECT_EQ(e.ranks[static_cast<size_t>(world.rank())].bytes_sent, rt.predicted_bytes_sent())
          << schedule_name(kind) << " rank " << world.rank();
    });
  }
}

// A bf16 pipeline sends no weight copies (the cut places the tied head's
// cast of wte in the reading stage, as the trainer's does) unless it runs
// parallel.async (the runtime sends the copy there); under
// half_activations it sends its f32 boundaries at 2 bytes an element (the
// runtime it models keeps them 16-bit), and fused 16-bit pricing makes
// this memory-bound step faster.
TEST(CostModel, HalfActivationsHalvePipelineMessages) {
  ModelSpec spec;
  spec.kind = "gpt";
  spec.layers = 4;
  spec.d_model = 32;
  spec.heads = 4;
  spec.seq_len = 8;
  TrainerOptions o = mlp_options(2);
  o.batch_size = 8;
  o.precision = DType::bf16;
  ParallelShorthand sh;
  sh.pp = 2;
  sh.microbatches = 4;
  const ModelGraph m = build_model(spec, o.batch_size);
  o.dist.plan = std::make_shared<Plan>(expand_shorthand(sh, ShorthandModel{"gpt", 8}, m.graph, 2));
  ClusterModel c = cluster(2, 1e-5, 1e9);
  c.kinds[0].memory_bandwidth = 1e9;
  // Bytes of the stage messages (the tied embedding's gradient exchange is
  // f32 parameter gradients, not activations: left out).
  auto sent = [](const Programs& p) {
    uint64_t bytes = 0;
    for (const Task& t : p.programs[0].tasks) {
      if (t.kind == Task::Kind::send && t.name.find("shared") == std::string::npos)
        bytes += t.bytes;
    }
    return bytes;
  };
  // At f32 stage 0 sends the residual stream h (f32); at bf16 the same
  // (the tied head's bf16 copy of wte is cast in the last stage).
  o.precision = DType::f32;
  const uint64_t h_bytes = sent(build_programs(spec, o, c));
  o.precision = DType::bf16;
  const Programs plain = build_programs(spec, o, c);
  const StepEstimate e_plain = estimate_step(spec, o, c);
  ASSERT_GT(h_bytes, 0u);
  EXPECT_EQ(sent(plain), h_bytes);
  {
    // Asynchronous: the cast stays in wte's stage and its copy is sent.
    TrainerOptions oa = o;
    ParallelShorthand sa = sh;
    sa.async = AsyncMode::pipedream;
    oa.dist.plan =
        std::make_shared<Plan>(expand_shorthand(sa, ShorthandModel{"gpt", 8}, m.graph, 2));
    EXPECT_GT(sent(build_programs(spec, oa, c)), h_bytes);
  }
  c.kinds[0].half_activations = true;
  c.kinds[0].fused_elementwise = true;
  const StepEstimate e_half = estimate_step(spec, o, c);
  // h at 2 bytes an element; the weight's 16-bit copy is not sent (the
  // stage that reads it keeps its own).
  EXPECT_EQ(sent(build_programs(spec, o, c)), h_bytes / 2);
  EXPECT_LT(e_half.step_s, e_plain.step_s);
  // An f32 run keeps 4-byte messages under the same device settings.
  o.precision = DType::f32;
  EXPECT_EQ(sent(build_programs(spec, o, c)), h_bytes);
}

// blocking_p2p: a stage's activation and gradient sends go on its compute
// lane, so each one's transfer (L + bytes / W) is added to the rank's busy
// time (step - idle) and the step grows.
TEST(CostModel, BlockingP2pSendsOccupyTheComputeLane) {
  ModelSpec spec;
  spec.kind = "gpt";
  spec.layers = 2;
  spec.d_model = 32;
  spec.heads = 4;
  spec.seq_len = 8;
  TrainerOptions o = mlp_options(2);
  o.batch_size = 8;
  ParallelShorthand sh;
  sh.pp = 2;
  sh.microbatches = 4;
  const ModelGraph m = build_model(spec, o.batch_size);
  o.dist.plan = std::make_shared<Plan>(expand_shorthand(sh, ShorthandModel{"gpt", 8}, m.graph, 2));
  const double L = 1e-5, W = 1e9;
  ClusterModel c = cluster(2, L, W);
  const StepEstimate plain = estimate_step(spec, o, c);
  c.kinds[0].blocking_p2p = true;
  const Programs progs = build_programs(spec, o, c);
  const StepEstimate blocking = estimate_step(spec, o, c);
  ASSERT_EQ(progs.programs.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    double transfer = 0;
    int stage_sends = 0;
    const Program& prog =
        progs.programs[static_cast<size_t>(progs.ranks[static_cast<size_t>(r)].program)];
    for (const Task& t : prog.tasks) {
      if (t.kind != Task::Kind::send) continue;
      EXPECT_EQ(t.lane, 0) << t.name;
      if (t.name.find("shared") != std::string::npos) continue;  // on lane 0 either way
      ++stage_sends;
      transfer += L + static_cast<double>(t.bytes) / W;
    }
    EXPECT_EQ(stage_sends, sh.microbatches) << r;
    // Busy = step - idle = compute + communication on the compute lane:
    // grows by exactly the sends' transfers; the total communication does
    // not change (the sends were counted on the comm lane before).
    const RankEstimate& eb = blocking.ranks[static_cast<size_t>(r)];
    const RankEstimate& ep = plain.ranks[static_cast<size_t>(r)];
    EXPECT_DOUBLE_EQ(eb.compute_s, ep.compute_s) << r;
    EXPECT_NEAR((blocking.step_s - eb.idle_s) - (plain.step_s - ep.idle_s), transfer, 1e-12) << r;
    EXPECT_NEAR(eb.comm_s, ep.comm_s, 1e-12) << r;
  }
  EXPECT_GT(blocking.step_s, plain.step_s);
}

// The pipeline memory terms on hand-computed values: f32 parameters and
// gradients, AdamW's two moments (1/dp of them under ZeRO-1; ZeRO-2 and
// -3 add the gradient and parameter shards), the kept
// bytes per micro-batch in flight, one whole stash while a recomputed
// forward is live, the arena.
TEST(CostModel, PipelineStageMemoryHandValues) {
  PipelineStageMemory m;
  m.param_bytes = 1000;
  m.state_kinds = 2;
  m.kept_bytes = 100;
  m.stash_bytes = 100;
  m.in_flight = 3;
  m.arena_bytes = 50;
  EXPECT_EQ(pipeline_stage_memory(m), 2000 + 2000 + 300 + 50);
  m.zero_dp = 4;  // ZeRO-1: the moments over 4 ranks
  EXPECT_EQ(pipeline_stage_memory(m), 2000 + 500 + 300 + 50);
  m.zero_stage = 2;  // + the reduced gradient shard
  EXPECT_EQ(pipeline_stage_memory(m), 2000 + 500 + 250 + 300 + 50);
  m.zero_stage = 3;  // + the parameter shard next to the whole copy gathered for the step
  EXPECT_EQ(pipeline_stage_memory(m), 2000 + 500 + 250 + 250 + 300 + 50);
  m.zero_stage = 0;
  m.zero_dp = 1;
  m.recompute = true;  // keeps 10 bytes of inputs per micro-batch, one whole stash
  m.kept_bytes = 10;
  EXPECT_EQ(pipeline_stage_memory(m), 2000 + 2000 + 30 + 100 + 50);
  EXPECT_EQ(even_counts(10, 4), (std::vector<size_t>{3, 3, 2, 2}));
  EXPECT_EQ(zero1_shard_elements(10, 4), 3);
  EXPECT_EQ(zero1_shard_elements(8, 4), 2);
}

namespace {

ModelSpec tiny_gpt() {
  ModelSpec spec;
  spec.kind = "gpt";
  spec.layers = 4;
  spec.d_model = 32;
  spec.heads = 4;
  spec.seq_len = 8;
  spec.vocab = 64;
  return spec;
}

// A pp=2 (x dp) plan of tiny_gpt with 4 micro-batches of 2 examples per replica.
TrainerOptions pipeline_options(const ModelSpec& spec, int dp, bool recompute) {
  TrainerOptions o = mlp_options(2 * dp);
  o.batch_size = 8 * dp;
  o.optimizer = "adamw";
  ParallelShorthand sh;
  sh.pp = 2;
  sh.dp = dp;
  sh.microbatches = 4;
  sh.recompute = recompute;
  const ModelGraph m = build_model(spec, o.batch_size);
  o.dist.plan = std::make_shared<Plan>(
      expand_shorthand(sh, ShorthandModel{"gpt", spec.d_model / spec.heads}, m.graph, 2 * dp));
  return o;
}

}  // namespace

// Recomputation on every stage (parallel.recompute): each backward first runs
// the stage's forward again -- forward time exactly doubles (4 forwards +
// 4 recomputed ones), backward, communication and bytes stay -- and a
// micro-batch in flight keeps only its received inputs: the stash term is
// the pipeline runtime's own planned_stash_bytes.
TEST(CostModel, PipelineRecomputationAddsAForwardAndKeepsOnlyInputs) {
  const ModelSpec spec = tiny_gpt();
  const ClusterModel c = cluster(2, 1e-5, 1e9);
  const StepEstimate plain = estimate_step(spec, pipeline_options(spec, 1, false), c);
  const TrainerOptions ro = pipeline_options(spec, 1, true);
  const StepEstimate rc = estimate_step(spec, ro, c);
  const ModelGraph mb = build_model(spec, 2);
  const PipelineCut cut = cut_pipeline(mb.graph, mb.loss, ro.dist.plan->stages);
  const PipelineSchedule sched = make_schedule(ScheduleKind::one_f_one_b, 2, 4);
  const ScheduleSimulation unit = simulate(sched);
  for (int r = 0; r < 2; ++r) {
    const RankEstimate& a = plain.ranks[static_cast<size_t>(r)];
    const RankEstimate& b = rc.ranks[static_cast<size_t>(r)];
    EXPECT_GT(a.forward_s, 0);
    EXPECT_NEAR(b.forward_s, 2 * a.forward_s, 1e-12 * a.forward_s) << "rank " << r;
    EXPECT_NEAR(b.backward_s, a.backward_s, 1e-12 * a.backward_s) << "rank " << r;
    EXPECT_EQ(b.bytes_sent, a.bytes_sent);
    const PipelineStage& st = cut.stages[static_cast<size_t>(r)];
    ASSERT_TRUE(st.recompute);
    ASSERT_LT(st.recompute_stash_bytes, st.stash_bytes);
    const int64_t held = unit.peak_in_flight[static_cast<size_t>(r)];
    // What recomputation saves: (whole - inputs) per chunk in flight, less the one
    // whole stash the recomputed forward holds.
    EXPECT_EQ(a.peak_memory_bytes - b.peak_memory_bytes,
              (st.stash_bytes - st.recompute_stash_bytes) * held - st.stash_bytes)
        << "rank " << r;
    EXPECT_EQ(planned_stash_bytes(cut, sched, r), st.recompute_stash_bytes * held + st.stash_bytes);
  }
  EXPECT_GT(rc.step_s, plain.step_s);
}

// ZeRO-1 and ZeRO-2 under a pipeline, as the pipeline runtime runs them:
// AdamW's moments take 1/dp per rank (ZeRO-2 adds the reduced gradient
// shard, 1/dp of the gradients), each parameter's updated shards are
// all-gathered (one block per rank on a ring of 2) and at ZeRO-2 its
// gradient reduce-scattered instead of all-reduced; no note says it is
// anything but a plan the runtime runs; ZeRO-3 as ZeRO-2 plus the
// parameter shard.
TEST(CostModel, ZeroOneAndTwoUnderAPipeline) {
  const ModelSpec spec = tiny_gpt();
  const int dp = 2;
  const ClusterModel c = cluster(4, 1e-5, 1e9);
  TrainerOptions o = pipeline_options(spec, dp, false);
  const StepEstimate z0 = estimate_step(spec, o, c);
  o.dist.dp.stage = 1;
  check_pipeline_options(o);  // the runtime takes it
  const StepEstimate z1 = estimate_step(spec, o, c);
  o.dist.dp.stage = 2;
  check_pipeline_options(o);
  const StepEstimate z2 = estimate_step(spec, o, c);
  for (const StepEstimate* e : {&z1, &z2}) {
    EXPECT_FALSE(std::any_of(e->notes.begin(), e->notes.end(), [](const std::string& n) {
      return n.find("projection") != std::string::npos;
    }));
  }
  const ModelGraph mb = build_model(spec, 2);
  const PipelineCut cut = cut_pipeline(mb.graph, mb.loss, o.dist.plan->stages);
  for (int r = 0; r < 4; ++r) {
    const int stage = o.dist.plan->mesh.coord(r, "pp");
    const Graph& fg = cut.stages[static_cast<size_t>(stage)].forward.graph;
    int64_t param_bytes = 0, half_bytes = 0;
    for (ValueId v : fg.params()) {
      const int64_t n = fg.value(v).shape.numel();
      param_bytes += n * 4;
      half_bytes += static_cast<int64_t>(even_counts(n, dp)[0]) * 4;
    }
    const RankEstimate& a = z0.ranks[static_cast<size_t>(r)];
    const RankEstimate& b = z1.ranks[static_cast<size_t>(r)];
    const RankEstimate& d = z2.ranks[static_cast<size_t>(r)];
    // 2 moments x (P - P/2).
    EXPECT_EQ(a.peak_memory_bytes - b.peak_memory_bytes, 2 * param_bytes - 2 * param_bytes / dp)
        << "rank " << r;
    // ZeRO-2: the micro-batches' full gradient plus the reduced shard.
    EXPECT_EQ(d.peak_memory_bytes - b.peak_memory_bytes, param_bytes / dp) << "rank " << r;
    // The ring all-gather over 2 ranks: each sends its own shard of every parameter.
    const int coord = o.dist.plan->mesh.coord(r, "dp");
    const int64_t own = coord == 0 ? half_bytes : param_bytes - half_bytes;
    EXPECT_EQ(static_cast<int64_t>(b.bytes_sent - a.bytes_sent), own) << "rank " << r;
    // A reduce-scatter sends half an all-reduce's bytes on a ring.
    EXPECT_LT(d.bytes_sent, b.bytes_sent) << "rank " << r;
  }
  // ZeRO-3 (the runtime gathers the stage's whole parameters once per
  // step): ZeRO-2's bytes, and its peak plus the parameter shard.
  o.dist.dp.stage = 3;
  check_pipeline_options(o);
  const StepEstimate z3 = estimate_step(spec, o, c);
  for (int r = 0; r < 4; ++r) {
    const int stage = o.dist.plan->mesh.coord(r, "pp");
    const Graph& fg = cut.stages[static_cast<size_t>(stage)].forward.graph;
    int64_t param_bytes = 0;
    for (ValueId v : fg.params()) param_bytes += fg.value(v).shape.numel() * 4;
    const RankEstimate& d = z2.ranks[static_cast<size_t>(r)];
    const RankEstimate& e = z3.ranks[static_cast<size_t>(r)];
    EXPECT_EQ(e.peak_memory_bytes - d.peak_memory_bytes, param_bytes / dp) << "rank " << r;
    EXPECT_EQ(e.bytes_sent, d.bytes_sent) << "rank " << r;
  }
  // The runtime compresses a pipeline's dp axis with a codec, but the cost
  // model prices f32 exchanges only: it refuses the codec naming
  // sync.codec rather than pricing the run as if it were not there.
  o.dist.sync.codec = "topk:0.1";
  check_pipeline_options(o);  // the runtime takes it
  try {
    (void)estimate_step(spec, o, c);
    ADD_FAILURE() << "the cost model priced sync.codec without pricing it";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("sync.codec = \"topk:0.1\""), std::string::npos)
        << e.what();
  }
  o.dist.sync.codec = "none";
  // Asynchronous pipelining updates per micro-batch, on a plain pipeline:
  // no ZeRO stage with it, refused naming both keys.
  TrainerOptions a = pipeline_options(spec, 1, false);
  Plan ap = *a.dist.plan;
  ap.async = AsyncMode::pipedream;
  a.dist.plan = std::make_shared<Plan>(ap);
  check_pipeline_options(a);
  for (int stage : {1, 3}) {
    a.dist.dp.stage = stage;
    try {
      check_pipeline_options(a);
      ADD_FAILURE() << "ZeRO-" << stage << " with parallel.async was not refused";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("parallel.async"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("dist.zero_stage"), std::string::npos) << e.what();
    }
  }
}

// Asynchronous pipelining (parallel.async) is priced as its steady-state
// window: every stage sends what PipelineRuntime::predicted_bytes_sent says
// (m activations / gradients and the tied wte each way per micro-batch);
// each backward is followed by the stage's update (m optimizer tasks, after
// a packed dp all-reduce of the micro-batch's gradients on a dp axis, not
// one per parameter after the pipeline); PipeDream's stage r holds p - 1 - r
// more copies of its weights, SpecTrain's every stage one (u). A plan whose
// stages carry meshes of their own is refused naming the stage's mesh (the
// programs read each rank's stage off the plan's pp axis; simulate crashed
// on one).
TEST(CostModel, AsyncPipeliningIsPricedPerMicroBatchAndStageMeshesAreRefused) {
  const ModelSpec spec = tiny_gpt();
  for (int dp : {1, 2}) {
    const ClusterModel c = cluster(2 * dp, 1e-5, 1e9);
    const TrainerOptions sync = pipeline_options(spec, dp, false);
    const Programs sp = build_programs(spec, sync, c);
    const StepEstimate se = simulate(sp, c);
    const int m = sync.dist.plan->microbatches;
    CutOptions co;
    co.param_casts_join_consumers = false;       // as the trainer cuts under async
    const ModelGraph mb = build_model(spec, 2);  // a micro-batch: 8 examples per replica / 4
    const PipelineCut cut = cut_pipeline(mb.graph, mb.loss, sync.dist.plan->stages, co);
    for (AsyncMode mode : {AsyncMode::pipedream, AsyncMode::spectrain}) {
      Plan ap = *sync.dist.plan;
      ap.async = mode;
      TrainerOptions o = sync;
      o.dist.plan = std::make_shared<Plan>(ap);
      check_pipeline_options(o);  // the runtime takes it
      const Programs pr = build_programs(spec, o, c);
      const StepEstimate e = simulate(pr, c);
      ASSERT_EQ(e.ranks.size(), static_cast<size_t>(2 * dp));
      for (int r = 0; r < 2 * dp; ++r) {
        const int stage = o.dist.plan->mesh.coord(r, "pp");
        const Program& prog =
            pr.programs[static_cast<size_t>(pr.ranks[static_cast<size_t>(r)].program)];
        int updates = 0, reduces = 0;
        for (const Task& t : prog.tasks) {
          updates += t.category == "optimizer";
          reduces += t.kind == Task::Kind::collective;
        }
        EXPECT_EQ(updates, m) << async_name(mode) << " rank " << r;
        EXPECT_EQ(reduces, dp > 1 ? m : 0) << async_name(mode) << " rank " << r;
        // The memory: the synchronous stage's plus the weight copies.
        const Graph& fg = cut.stages[static_cast<size_t>(stage)].forward.graph;
        int64_t param_bytes = 0;
        for (ValueId v : fg.params()) param_bytes += fg.value(v).shape.numel() * 4;
        const int copies = mode == AsyncMode::pipedream ? 1 - stage : 1;
        EXPECT_GT(param_bytes, 0);
        EXPECT_EQ(e.ranks[static_cast<size_t>(r)].peak_memory_bytes,
                  se.ranks[static_cast<size_t>(r)].peak_memory_bytes + copies * param_bytes)
            << async_name(mode) << " rank " << r;
      }
      // No flush, no warm-up: each stage runs at its own pace, so on links
      // that cost ~nothing the step is the busiest stage's compute (m x (F +
      // B + update)), where the synchronous step waits in the bubble.
      if (dp == 1) {
        const ClusterModel fast = cluster(2, 1e-12, 1e18);
        const StepEstimate af = estimate_step(spec, o, fast);
        const StepEstimate sf = estimate_step(spec, sync, fast);
        double busiest = 0, sync_busiest = 0;
        for (int r = 0; r < 2; ++r) {
          busiest = std::max(busiest, af.ranks[static_cast<size_t>(r)].compute_s);
          sync_busiest = std::max(sync_busiest, sf.ranks[static_cast<size_t>(r)].compute_s);
        }
        EXPECT_GE(af.step_s, busiest * (1 - 1e-9));
        EXPECT_LT(af.step_s - busiest, 0.01 * af.step_s) << async_name(mode);
        EXPECT_GT(sf.step_s - sync_busiest, 0.1 * sf.step_s) << "the synchronous bubble";
      }
      if (dp > 1) continue;
      // Bytes: the runtime's own prediction, per stage.
      LocalWorld::run(2, [&](Communicator& world) {
        PipelineOptions po;
        po.async = mode;
        po.update = [](int) {};
        PipelineRuntime rt(world, cut, make_schedule(ScheduleKind::one_f_one_b, 2, m), po);
        EXPECT_GT(rt.predicted_bytes_sent(), 0u);
        EXPECT_EQ(e.ranks[static_cast<size_t>(world.rank())].bytes_sent, rt.predicted_bytes_sent())
            << async_name(mode) << " rank " << world.rank();
      });
      // The synchronous step sends wte's gradient once; async sends it
      // (and the value) per micro-batch: more bytes.
      EXPECT_GT(e.ranks[0].bytes_sent, se.ranks[0].bytes_sent);
    }
  }
  // docs/plan.md's example: stage 0 tensor-parallel on ranks {0, 1}, stage 1 on rank 2.
  const ModelSpec xs = mlp();
  const Plan xp = plan_from_json(
      R"({"model": "mlp", "mesh": [{"name": "world", "size": 3}],
          "values": {"fc1.w": {"dims": [null, "tp"]}, "fc1.b": {"dims": ["tp"]}},
          "stages": [
            {"layers": ["fc1"], "ranks": [0, 1], "mesh": [{"name": "tp", "size": 2}]},
            {"layers": ["fc2", "head"], "ranks": [2], "mesh": []}],
          "microbatches": 2})",
      "xmesh");
  ASSERT_TRUE(xp.stage_meshes());
  TrainerOptions x = mlp_options(3);
  x.dist.plan = std::make_shared<Plan>(xp);
  try {
    (void)estimate_step(xs, x, cluster(3, 1e-5, 1e9));
    ADD_FAILURE() << "a plan with stage meshes was priced";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("stages[0].mesh"), std::string::npos) << e.what();
  }
}

TEST(Simulator, Deterministic) {
  const int n = 4;
  const ModelSpec spec = mlp();
  const TrainerOptions o = mlp_options(n);
  ClusterModel c = cluster(n, 1e-5, 1e9);
  c.slowdown = {1, 1.5, 1, 1.25};
  mt::testing::TempDir dir;
  auto run = [&](const std::string& name) {
    SimulationOptions so;
    so.trace_path = dir.file(name);
    const StepEstimate e = simulate(build_programs(spec, o, c), c, so);
    std::ifstream in(so.trace_path);
    std::stringstream ss;
    ss << in.rdbuf();
    return std::make_pair(e, ss.str());
  };
  const auto [a, ta] = run("a.json");
  const auto [b, tb] = run("b.json");
  EXPECT_EQ(a.step_s, b.step_s);
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(a.ranks[static_cast<size_t>(r)].idle_s, b.ranks[static_cast<size_t>(r)].idle_s);
  }
  EXPECT_EQ(ta, tb);
  const auto j = nlohmann::json::parse(ta);
  ASSERT_TRUE(j.contains("traceEvents"));
  EXPECT_GT(j["traceEvents"].size(), 8u);
}

}  // namespace
}  // namespace mt::planner
