// What the layer-pipeline tests under mpirun share (the pure pipeline's
// test_train_layer_pipeline_mpi and the hybrid's
// test_train_layer_pipeline_hybrid_mpi): a small CSBM graph, the training
// options and model, and the check that a run equals the single-process one.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>

#include "meshtrain/train/full_graph.h"
#include "train/mpi_world.h"

namespace mt::test {

inline GraphData small_csbm() {
  CsbmOptions o;
  o.vertices = 400;
  o.classes = 4;
  o.avg_degree = 8;
  o.homophily = 0.8;
  o.features = 12;
  o.feature_signal = 0.7;
  o.train_fraction = 0.3;
  o.val_fraction = 0.1;
  return make_csbm(o);
}

inline TrainerOptions gnn_options() {
  TrainerOptions t;
  t.epochs = 8;
  t.optimizer = "adamw";
  t.schedule.lr = 0.01;
  t.optim.adamw.weight_decay = 5e-4;
  t.clip_grad_norm = 1;  // the norm is one over all stages' parameters
  t.threads = 1;
  t.log_every = 0;
  t.exec.backend = "fast";
  t.exec.profile = false;
  return t;
}

inline ModelSpec gnn_spec(const std::string& kind, int64_t layers) {
  ModelSpec s;
  s.kind = kind;
  s.gnn_hidden = 16;
  s.gnn_layers = layers;
  return s;
}

// Loss every epoch within 2e-5 relative and every final parameter within
// 1e-4 relative (+ 2e-6) of the single-process run; rank 0 prints the
// largest parameter difference.
inline void expect_equivalent(const FullGraphResult& single, const FullGraphResult& run,
                              const std::string& what) {
  ASSERT_EQ(single.epochs.size(), run.epochs.size()) << what;
  double worst = 0;
  for (size_t e = 0; e < single.epochs.size(); ++e) {
    const double a = single.epochs[e].loss, b = run.epochs[e].loss;
    EXPECT_NEAR(b, a, 2e-5 * std::fabs(a)) << what << " epoch " << e + 1;
  }
  EXPECT_NEAR(run.final_loss, single.final_loss, 2e-5 * std::fabs(single.final_loss)) << what;
  std::map<std::string, Tensor> mine(run.final_params.begin(), run.final_params.end());
  ASSERT_EQ(mine.size(), single.final_params.size()) << what;
  for (const auto& [name, a] : single.final_params) {
    ASSERT_TRUE(mine.count(name)) << what << ": no " << name;
    const Tensor& b = mine.at(name);
    ASSERT_EQ(a.numel(), b.numel()) << name;
    for (int64_t k = 0; k < a.numel(); ++k) {
      const double x = a.item(k), y = b.item(k);
      worst = std::max(worst, std::fabs(x - y) / std::max(std::fabs(x), 2e-2));
      ASSERT_NEAR(y, x, 1e-4 * std::fabs(x) + 2e-6) << what << " " << name << "[" << k << "]";
    }
  }
  if (mpi_world().rank() == 0)
    std::printf("%s: largest parameter difference %.2e\n", what.c_str(), worst);
}

}  // namespace mt::test
