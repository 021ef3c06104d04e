// Graph neural networks for full-graph node classification (see model.h).
// The adjacency enters as i32 inputs bound once (ModelGraph::constants), so
// the same graph code runs for any graph the model was built for.
#include <fmt/format.h>

#include "meshtrain/base/error.h"
#include "meshtrain/graph/builder.h"
#include "meshtrain/models/layers.h"
#include "meshtrain/models/model.h"

namespace mt {

namespace {

// One adjacency as graph inputs: row_ptr, col_idx and per-entry values.
struct AdjInputs {
  ValueId row_ptr = kNoValue, col_idx = kNoValue, values = kNoValue, rows = kNoValue;
};

AdjInputs bind_adj(Builder& b, ModelGraph& m, const std::string& name, const Csr& a,
                   const std::vector<float>* values, bool entry_rows_too) {
  AdjInputs in;
  in.row_ptr = b.input(name + ".row_ptr", {a.rows + 1}, DType::i32);
  m.constants.emplace_back(in.row_ptr, tensor_from(a.row_ptr));
  in.col_idx = b.input(name + ".col_idx", {a.nnz()}, DType::i32);
  m.constants.emplace_back(in.col_idx, tensor_from(a.col_idx));
  if (values != nullptr) {
    in.values = b.input(name + ".values", {a.nnz()});
    m.constants.emplace_back(in.values, tensor_from(*values));
  }
  if (entry_rows_too) {
    in.rows = b.input(name + ".entry_rows", {a.nnz()}, DType::i32);
    m.constants.emplace_back(in.rows, tensor_from(entry_rows(a)));
  }
  return in;
}

ValueId bias_add(Builder& b, ValueId h, int64_t width, const std::string& name) {
  return b.add(h, b.param(name + ".b", {width}, ParamInit{ParamInit::Kind::zeros, 0}));
}

ValueId weight(Builder& b, const std::string& name, int64_t in, int64_t out) {
  return b.param(name, {in, out}, layers::fan_in_uniform(in));
}

ValueId gcn_conv(Builder& b, const AdjInputs& a, ValueId h, int64_t in, int64_t out,
                 const std::string& name) {
  ValueId z = b.matmul(h, weight(b, name + ".w", in, out));
  return bias_add(b, b.spmm(a.row_ptr, a.col_idx, z, a.values), out, name);
}

ValueId sage_conv(Builder& b, const AdjInputs& a, ValueId h, int64_t in, int64_t out,
                  const std::string& name, bool max) {
  ValueId self = b.matmul(h, weight(b, name + ".w_self", in, out));
  ValueId agg =
      max ? b.spmm_max(a.row_ptr, a.col_idx, h) : b.spmm(a.row_ptr, a.col_idx, h, a.values);
  ValueId neigh = b.matmul(agg, weight(b, name + ".w_neigh", in, out));
  return bias_add(b, b.add(self, neigh), out, name);
}

ValueId gat_conv(Builder& b, const AdjInputs& a, ValueId h, int64_t in, int64_t out, int64_t n,
                 int64_t e, const std::string& name) {
  ValueId z = b.matmul(h, weight(b, name + ".w", in, out));
  ValueId s_src = b.matmul(z, weight(b, name + ".att_src", out, 1));  // [N, 1]
  ValueId s_dst = b.matmul(z, weight(b, name + ".att_dst", out, 1));
  (void)n;
  // Per entry (i <- j): s_dst[i] + s_src[j], gathered with embedding lookups.
  ValueId score = b.add(b.embedding(s_dst, a.rows), b.embedding(s_src, a.col_idx));  // [E, 1]
  score = b.reshape(score, {e});
  // leaky_relu(x, 0.2) = 0.8 relu(x) + 0.2 x
  score = b.add(b.scale(b.relu(score), 0.8), b.scale(score, 0.2));
  ValueId alpha = b.edge_softmax(a.row_ptr, score);
  return bias_add(b, b.spmm(a.row_ptr, a.col_idx, z, alpha), out, name);
}

}  // namespace

bool is_gnn(const std::string& kind) {
  return kind == "gcn" || kind == "sage" || kind == "gat" || kind == "resgcn";
}

ModelGraph build_gnn(const ModelSpec& spec, const GnnGraph& g) {
  if (!is_gnn(spec.kind)) {
    throw ConfigError(
        fmt::format("model.kind: '{}' is not a graph neural network (expected gcn, "
                    "sage, gat or resgcn)",
                    spec.kind));
  }
  if (spec.compute != DType::f32) {
    throw ConfigError(
        fmt::format("model.kind {}: sparse operators compute in f32 only; set "
                    "train.precision = \"f32\"",
                    spec.kind));
  }
  MT_CHECK(g.adj != nullptr, "build_gnn: no adjacency");
  const Csr& adj = *g.adj;
  if (adj.rows != adj.cols) {
    throw ConfigError(fmt::format("build_gnn: adjacency is {}x{}, not square", adj.rows, adj.cols));
  }
  if (g.loss_vertices.empty()) {
    throw ConfigError("build_gnn: no vertex is in the training mask, so the loss is empty");
  }
  if (spec.gnn_layers < 1 || spec.gnn_hidden < 1) {
    throw ConfigError(fmt::format("model.gnn_layers ({}) and model.gnn_hidden ({}) must be >= 1",
                                  spec.gnn_layers, spec.gnn_hidden));
  }
  const int64_t n = adj.rows, f = g.features, c = g.classes, hid = spec.gnn_hidden;
  ModelGraph m;
  m.batch = static_cast<int64_t>(g.loss_vertices.size());
  Builder b(m.graph);
  m.x = b.input("x", {n, f});
  m.y = b.input("y", {m.batch}, DType::i32);
  ValueId idx = b.input("loss_vertices", {m.batch}, DType::i32);
  m.constants.emplace_back(idx, tensor_from(g.loss_vertices));

  ValueId h = m.x;
  if (spec.kind == "gcn" || spec.kind == "resgcn") {
    const Csr a = with_self_loops(adj);
    const std::vector<float> w = gcn_norm_values(a);
    const AdjInputs in = bind_adj(b, m, "adj", a, &w, false);
    if (spec.kind == "gcn") {
      int64_t width = f;
      for (int64_t l = 0; l < spec.gnn_layers; ++l) {
        const bool last = l + 1 == spec.gnn_layers;
        const int64_t out = last ? c : hid;
        h = gcn_conv(b, in, h, width, out, fmt::format("conv{}", l + 1));
        if (!last) h = b.relu(h);
        width = out;
      }
    } else {
      h = b.matmul(h, weight(b, "input.w", f, hid));
      auto norm = [&](ValueId v, const std::string& name) {
        ValueId gm = b.param(name + ".gamma", {hid}, ParamInit{ParamInit::Kind::ones, 0});
        ValueId bt = b.param(name + ".beta", {hid}, ParamInit{ParamInit::Kind::zeros, 0});
        return b.relu(b.layer_norm(v, gm, bt));
      };
      for (int64_t l = 0; l < spec.gnn_layers; ++l) {
        const std::string name = fmt::format("block{}", l + 1);
        h = b.add(h, gcn_conv(b, in, norm(h, name + ".norm"), hid, hid, name + ".conv"));
      }
      h = bias_add(b, b.matmul(norm(h, "final_norm"), weight(b, "head.w", hid, c)), c, "head");
    }
  } else if (spec.kind == "sage") {
    if (spec.sage_aggregation != "mean" && spec.sage_aggregation != "max") {
      throw ConfigError(fmt::format("model.sage_aggregation: '{}' (expected mean or max)",
                                    spec.sage_aggregation));
    }
    const bool max = spec.sage_aggregation == "max";
    const std::vector<float> w = mean_values(adj);
    const AdjInputs in = bind_adj(b, m, "adj", adj, max ? nullptr : &w, false);
    int64_t width = f;
    for (int64_t l = 0; l < spec.gnn_layers; ++l) {
      const bool last = l + 1 == spec.gnn_layers;
      const int64_t out = last ? c : hid;
      h = sage_conv(b, in, h, width, out, fmt::format("conv{}", l + 1), max);
      if (!last) h = b.relu(h);
      width = out;
    }
  } else {  // gat
    const Csr a = with_self_loops(adj);
    const AdjInputs in = bind_adj(b, m, "adj", a, nullptr, true);
    int64_t width = f;
    for (int64_t l = 0; l < spec.gnn_layers; ++l) {
      const bool last = l + 1 == spec.gnn_layers;
      const int64_t out = last ? c : hid;
      h = gat_conv(b, in, h, width, out, n, a.nnz(), fmt::format("conv{}", l + 1));
      if (!last) h = b.relu(h);
      width = out;
    }
  }
  m.logits = b.name(h, "logits");
  m.loss = b.cross_entropy(b.embedding(m.logits, idx), m.y);
  return m;
}

}  // namespace mt
