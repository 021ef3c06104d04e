#include "meshtrain/cli/run_config.h"

#include <chrono>

#include "meshtrain/data/byte_text.h"
#include "meshtrain/data/edge_list.h"
#include "meshtrain/data/fashion_mnist.h"
#include "meshtrain/data/knn_graph.h"
#include "meshtrain/train/graph_file.h"

namespace mt {

namespace {

ModelSpec read_model(const Config& c) {
  ModelSpec m;
  m.kind = c.get_string("model.kind", "mlp", {"mlp", "cnn", "gpt", "gcn", "sage", "gat", "resgcn"});
  // Every model's size keys are read (and validated) whatever model.kind
  // says, so switching models with --set keeps a config valid.
  m.hidden = c.get_int_list("model.hidden", m.hidden, Bounds<int64_t>::positive());
  m.conv_channels =
      c.get_int_list("model.conv_channels", m.conv_channels, Bounds<int64_t>::positive());
  m.fc = c.get_int("model.fc", m.fc, Bounds<int64_t>::positive());
  m.layers = c.get_int("model.layers", m.layers, Bounds<int64_t>::positive());
  m.d_model = c.get_int("model.d_model", m.d_model, Bounds<int64_t>::positive());
  m.heads = c.get_int("model.heads", m.heads, Bounds<int64_t>::positive());
  m.seq_len = c.get_int("model.seq_len", m.seq_len, Bounds<int64_t>::positive());
  m.vocab = c.get_int("model.vocab", m.vocab, Bounds<int64_t>::at_least(256));
  m.gnn_hidden = c.get_int("model.gnn_hidden", m.gnn_hidden, Bounds<int64_t>::positive());
  m.gnn_layers = c.get_int("model.gnn_layers", m.gnn_layers, Bounds<int64_t>::positive());
  m.sage_aggregation = c.get_string("model.sage_aggregation", "mean", {"mean", "max"});
  m.gat_heads = c.get_int("model.gat_heads", m.gat_heads, Bounds<int64_t>::positive());
  return m;
}

DataSpec read_data(const Config& c, const ModelSpec& m) {
  DataSpec d;
  d.kind = c.get_string("data.kind",
                        m.kind == "gpt" ? "text" : (is_gnn(m.kind) ? "graph" : "fashion_mnist"),
                        {"fashion_mnist", "text", "graph"});
  if ((d.kind == "text") != (m.kind == "gpt") || (d.kind == "graph") != is_gnn(m.kind)) {
    throw ConfigError(
        fmt::format("config {}: data.kind '{}' does not fit model.kind '{}' (gpt "
                    "trains on text, mlp and cnn on fashion_mnist, gcn, sage, gat and resgcn "
                    "on a graph)",
                    c.source(), d.kind, m.kind));
  }
  // Graph keys (read whatever data.kind says, as the others).
  d.graph = c.get_string("data.graph", "csbm", {"csbm", "rmat", "knn", "file", "edges"});
  d.graph_file = c.get_string("data.graph_file", "");
  CsbmOptions& cs = d.csbm;
  cs.vertices = c.get_int("data.vertices", cs.vertices, Bounds<int64_t>::in(2, int64_t{1} << 30));
  cs.classes = c.get_int("data.classes", cs.classes, Bounds<int64_t>::positive());
  cs.avg_degree = c.get_double("data.avg_degree", cs.avg_degree, Bounds<double>::non_negative());
  cs.homophily = c.get_double("data.homophily", cs.homophily, Bounds<double>::in(0.0, 1.0));
  cs.features = c.get_int("data.features", cs.features, Bounds<int64_t>::positive());
  cs.feature_signal =
      c.get_double("data.feature_signal", cs.feature_signal, Bounds<double>::non_negative());
  cs.train_fraction =
      c.get_double("data.train_fraction", cs.train_fraction, Bounds<double>::in(0.0, 1.0));
  cs.val_fraction =
      c.get_double("data.val_fraction", cs.val_fraction, Bounds<double>::in(0.0, 1.0));
  cs.seed = static_cast<uint64_t>(c.get_int("data.graph_seed", 1, Bounds<int64_t>::non_negative()));
  RmatOptions& rm = d.rmat;
  rm.scale = c.get_int("data.rmat_scale", rm.scale, Bounds<int64_t>::in(1, 30));
  rm.edge_factor = c.get_int("data.rmat_edge_factor", rm.edge_factor, Bounds<int64_t>::positive());
  rm.a = c.get_double("data.rmat_a", rm.a, Bounds<double>::in(0.0, 1.0));
  rm.b = c.get_double("data.rmat_b", rm.b, Bounds<double>::in(0.0, 1.0));
  rm.c = c.get_double("data.rmat_c", rm.c, Bounds<double>::in(0.0, 1.0));
  if (!(rm.a > 0 && rm.a + rm.b + rm.c < 1)) {
    throw ConfigError(fmt::format(
        "config {}: data.rmat_a + data.rmat_b + data.rmat_c = {:g} + {:g} + {:g} must be below 1 "
        "with data.rmat_a > 0 (the fourth quadrant gets d = 1 - a - b - c)",
        c.source(), rm.a, rm.b, rm.c));
  }
  rm.features = cs.features;
  rm.classes = cs.classes;
  rm.train_fraction = cs.train_fraction;
  rm.val_fraction = cs.val_fraction;
  rm.seed = cs.seed;
  d.edges.train_fraction = cs.train_fraction;
  d.edges.val_fraction = cs.val_fraction;
  d.edges.seed = cs.seed;
  if (d.kind == "graph" && (d.graph == "file" || d.graph == "edges") && d.graph_file.empty()) {
    throw ConfigError(fmt::format(
        "config {}: data.graph = \"{}\" needs data.graph_file (a {}, see docs/graph_format.md)",
        c.source(), d.graph, d.graph == "file" ? "graph file" : "text edge list"));
  }
  // Both kinds' keys are read (and validated) whatever data.kind says, as
  // for the model and optimizer keys, so `meshtrain config --list` sees them.
  const std::string dir = c.get_string("data.dir", kFashionMnistDefaultDir);
  const std::string path = c.get_string("data.path", kFortunesDefaultDir);
  const double test_fraction =
      c.get_double("data.test_fraction", 0.1, Bounds<double>::in(0.0, 0.9));
  // Images only (text has no normalisation): "mean_std": (x/255 - data.mean)
  // / data.std, by default the training set's own statistics; "none": x/255.
  const bool normalize =
      c.get_string("data.normalize", "mean_std", {"mean_std", "none"}) == "mean_std";
  const double mean = c.get_double("data.mean", kFashionMnistMean, Bounds<double>::any());
  const double std = c.get_double("data.std", kFashionMnistStd, Bounds<double>::positive());
  if (!normalize && (c.has("data.mean") || c.has("data.std"))) {
    throw ConfigError(
        fmt::format("config {}: data.mean / data.std are set but data.normalize is \"none\"; set "
                    "data.normalize = \"mean_std\" to use them",
                    c.source()));
  }
  FashionKnnOptions& kn = d.knn;
  kn.k = c.get_int("data.knn_k", kn.k, Bounds<int64_t>::positive());
  kn.dir = dir;
  kn.normalize = normalize;
  kn.mean = static_cast<float>(mean);
  kn.std = static_cast<float>(std);
  kn.val_fraction = cs.val_fraction;
  kn.seed = cs.seed;
  if (d.kind == "fashion_mnist") {
    d.dir = dir;
    d.normalize = normalize;
    d.mean = mean;
    d.std = std;
  } else {
    d.path = path;
    d.test_fraction = test_fraction;
  }
  d.limit_train = c.get_int("data.limit_train", -1, Bounds<int64_t>::at_least(-1));
  d.limit_test = c.get_int("data.limit_test", -1, Bounds<int64_t>::at_least(-1));
  kn.limit_train = d.limit_train;
  kn.limit_test = d.limit_test;
  return d;
}

TrainerOptions read_train(const Config& c) {
  TrainerOptions t;
  t.epochs = c.get_int("train.epochs", 1, Bounds<int64_t>::non_negative());
  t.max_steps = c.get_int("train.steps", 0, Bounds<int64_t>::non_negative());
  t.batch_size = c.get_int("train.batch_size", 128, Bounds<int64_t>::positive());
  t.eval_batch_size = c.get_int("train.eval_batch_size", 1000, Bounds<int64_t>::positive());
  t.seed = static_cast<uint64_t>(c.get_int("train.seed", 1, Bounds<int64_t>::non_negative()));
  t.threads = static_cast<int>(c.get_int("train.threads", 1, Bounds<int64_t>::in(1, 256)));
  const std::string precision =
      c.get_string("train.precision", "f32", {"f32", "bf16", "f16", "auto", "bf16_storage"});
  // "auto" is decided by the trainer at start-up (train/precision.h); f32
  // until then (the larger memory plan of those it may pick).
  // "bf16_storage": f32 compute, bf16 activation stash (graph/bf16_stash.h).
  t.precision_auto = precision == "auto";
  t.bf16_storage = precision == "bf16_storage";
  t.precision = t.precision_auto || t.bf16_storage ? DType::f32 : parse_dtype(precision);
  t.eval = c.get_bool("train.eval", true);
  t.eval_batches = c.get_int("train.eval_batches", 0, Bounds<int64_t>::non_negative());
  t.eval_every = c.get_int("train.eval_every", 0, Bounds<int64_t>::non_negative());
  t.log_every = c.get_int("train.log_every", 50, Bounds<int64_t>::positive());
  t.checkpoint_path = c.get_string("train.checkpoint", "");
  t.tensorboard_dir = c.get_string("train.tensorboard", "");
  t.checkpoint_every = c.get_int("train.checkpoint_every", 0, Bounds<int64_t>::non_negative());
  t.checkpoint_keep = c.get_int("train.checkpoint_keep", 0, Bounds<int64_t>::non_negative());
  t.resume_path = c.get_string("train.resume", "");
  t.init_path = c.get_string("train.init", "");
  t.init_partial = c.get_bool("train.init_partial", false);
  t.halt_after = c.get_int("train.halt_after", 0, Bounds<int64_t>::non_negative());

  t.optimizer = c.get_string("optim.name", "sgd", {"sgd", "adamw", "lars", "lamb"});
  const double wd = c.get_double("optim.weight_decay", t.optimizer == "sgd" ? 0.0 : 0.01,
                                 Bounds<double>::non_negative());
  OptimizerOptions& op = t.optim;
  // Every optimizer's keys are read (and validated) whatever optim.name says,
  // so switching optimizers with --set keeps a config valid.
  const bool adam_like = t.optimizer == "adamw" || t.optimizer == "lamb";
  const double momentum = c.get_double("optim.momentum", 0.9, Bounds<double>::in(0.0, 1.0));
  const double beta1 = c.get_double("optim.beta1", 0.9, Bounds<double>::in(0.0, 1.0));
  const double beta2 = c.get_double("optim.beta2", 0.999, Bounds<double>::in(0.0, 1.0));
  const double eps =
      c.get_double("optim.eps", t.optimizer == "lamb" ? 1e-6 : 1e-8, Bounds<double>::positive());
  op.sgd.momentum = momentum;
  op.sgd.nesterov = c.get_bool("optim.nesterov", false) && !adam_like;
  op.sgd.weight_decay = wd;
  op.adamw.beta1 = op.lamb.beta1 = beta1;
  op.adamw.beta2 = op.lamb.beta2 = beta2;
  op.adamw.eps = op.lamb.eps = eps;
  op.adamw.weight_decay = op.lamb.weight_decay = wd;
  op.lars.momentum = momentum;
  op.lars.trust_coefficient =
      c.get_double("optim.trust_coefficient", 0.001, Bounds<double>::positive());
  op.lars.weight_decay = wd;
  t.schedule.lr = c.get_double("optim.lr", 0.01, Bounds<double>::positive());
  t.schedule.kind =
      parse_lr_schedule_kind(c.get_string("optim.schedule", "constant", {"constant", "cosine"}));
  t.schedule.warmup_steps = c.get_int("optim.warmup_steps", 0, Bounds<int64_t>::non_negative());
  t.schedule.min_lr = c.get_double("optim.min_lr", 0.0, Bounds<double>::non_negative());
  t.clip_grad_norm = c.get_double("optim.clip_grad_norm", 0.0, Bounds<double>::non_negative());

  t.exec.backend = c.get_string("exec.backend", "fast", {"fast", "reference"});
  t.exec.recompute = c.get_bool("exec.recompute", false);
  t.exec.fast.f32_matmul = parse_matmul_engine(
      c.get_string("exec.matmul", "measure", {"measure", "onednn", "openblas"}));
  t.exec.fast.conv_layout = parse_conv_layout(
      c.get_string("exec.conv_layout", "measure", {"measure", "plain", "blocked"}));
  return t;
}

ParallelShorthand read_parallel(const Config& c) {
  ParallelShorthand p;
  p.dp = static_cast<int>(c.get_int("parallel.dp", 0, Bounds<int64_t>::in(0, kMaxRanks)));
  p.tp = static_cast<int>(c.get_int("parallel.tp", 1, Bounds<int64_t>::in(1, kMaxRanks)));
  p.pp = static_cast<int>(c.get_int("parallel.pp", 1, Bounds<int64_t>::in(1, kMaxRanks)));
  p.sp = c.get_bool("parallel.sp", false);
  p.microbatches =
      static_cast<int>(c.get_int("parallel.microbatches", 1, Bounds<int64_t>::in(1, 65536)));
  p.schedule = parse_schedule_kind(
      c.get_string("parallel.schedule", "1f1b",
                   {"gpipe", "1f1b", "interleaved", "zero_bubble", "zbv", "dualpipev"}),
      "parallel.schedule");
  p.virtual_stages =
      static_cast<int>(c.get_int("parallel.virtual_stages", 1, Bounds<int64_t>::in(1, 1024)));
  p.warmup_extra =
      static_cast<int>(c.get_int("parallel.warmup_extra", 0, Bounds<int64_t>::in(0, 65536)));
  p.async = parse_async_mode(
      c.get_string("parallel.async", "none", {"none", "pipedream", "spectrain"}), "parallel.async");
  p.tp_ratios = c.get_int_list("parallel.tp_ratios", {}, Bounds<int64_t>::positive());
  p.stage_layers = c.get_int_list("parallel.stage_layers", {}, Bounds<int64_t>::non_negative());
  // true / false, or the list of virtual stages that recompute.
  if (const auto v = c.value_text("parallel.recompute"); v && v->starts_with("[")) {
    p.recompute_stages = c.get_int_list("parallel.recompute", {}, Bounds<int64_t>::non_negative());
  } else {
    p.recompute = c.get_bool("parallel.recompute", false);
  }
  return p;
}

}  // namespace

RunConfig read_run_config(const Config& c) {
  RunConfig r;
  r.model = read_model(c);
  r.data = read_data(c, r.model);
  r.openblas_coretype = c.get_string("exec.openblas_coretype", "auto", {"auto", "best", "keep"});
  r.train = read_train(c);
  r.train.shuffle = c.get_bool("data.shuffle", true);
  r.data.knn.threads = r.train.threads;
  if (r.train.eval && r.data.limit_test == 0) {
    throw ConfigError(fmt::format(
        "config {}: data.limit_test = 0 leaves no test examples, but train.eval is on; set "
        "data.limit_test > 0 (-1 = all) or train.eval = false",
        c.source()));
  }
  if (r.train.eval && r.data.kind == "text" && r.data.test_fraction == 0) {
    throw ConfigError(fmt::format(
        "config {}: data.test_fraction = 0 leaves no test split, but train.eval is on; set "
        "data.test_fraction > 0 or train.eval = false",
        c.source()));
  }
  r.nproc = static_cast<int>(c.get_int("dist.nproc", 1, Bounds<int64_t>::in(1, kMaxRanks)));
  DistOptions& d = r.train.dist;
  d.dp.stage = static_cast<int>(c.get_int("dist.zero_stage", 0, Bounds<int64_t>::in(0, 3)));
  d.dp.bucket_bytes = static_cast<int64_t>(
      c.get_double("dist.bucket_mb", 25.0, Bounds<double>::positive()) * 1024 * 1024);
  d.dp.overlap = c.get_bool("dist.overlap", true);
  d.dp.accumulation_steps =
      static_cast<int>(c.get_int("dist.accumulation_steps", 1, Bounds<int64_t>::in(1, 4096)));
  d.batch_shares = c.get_int_list("dist.batch_shares", {}, Bounds<int64_t>::positive());
  d.consistency_every = c.get_int("dist.consistency_every", 100, Bounds<int64_t>::non_negative());
  d.straggler_report = c.get_bool("dist.straggler_report", true);
  d.straggler_threshold =
      c.get_double("dist.straggler_threshold", 1.2, Bounds<double>::at_least(1.0));
  d.trace_path = c.get_string("dist.trace", "");
  d.slowdown = c.get_double_list("dist.slowdown", {}, Bounds<double>::at_least(1.0));
  const std::string cluster = c.get_string("dist.cluster", "");
  r.node_size = static_cast<int>(c.get_int("dist.node_size", 0, Bounds<int64_t>::in(0, kMaxRanks)));
  r.hierarchical = c.get_bool("dist.hierarchical", true);
  r.algorithm_choice = c.get_string("dist.algorithm_choice", "static", {"static", "measured"});
  if (!cluster.empty()) {
    if (r.node_size > 0) {
      throw ConfigError(fmt::format(
          "config {}: dist.node_size = {} and dist.cluster = \"{}\" both group ranks into "
          "nodes; expected one of them (the cluster file's node_size or [[nodes]])",
          c.source(), r.node_size, cluster));
    }
    r.cluster = read_cluster_file(cluster);
    if (!r.cluster->slowdown.empty()) {
      if (!d.slowdown.empty()) {
        throw ConfigError(fmt::format(
            "config {}: dist.slowdown and the cluster file {}'s ranks.slowdown both give "
            "per-rank slowdown; expected one of them",
            c.source(), cluster));
      }
      d.slowdown = r.cluster->slowdown;  // the trainer's emulated device speed
    }
  }
  r.fault = c.get_string("dist.fault", "");
  r.timeout_s = c.get_int("dist.timeout_s", 300, Bounds<int64_t>::positive());
  d.dp.collective.timeout = std::chrono::milliseconds(r.timeout_s * 1000);
  r.stop_grace_s = c.get_int("dist.stop_grace_s", 10, Bounds<int64_t>::in(1, 3600));
  r.parallel = read_parallel(c);
  r.parallel_given = c.has("parallel");
  SyncOptions& so = d.sync;
  so.scheme =
      c.get_string("sync.scheme", "allreduce",
                   {"allreduce", "local_sgd", "diloco", "gossip", "adpsgd", "partial", "ps"});
  so.period = c.get_int("sync.period", so.period, Bounds<int64_t>::positive());
  so.sync_until = c.get_int("sync.sync_until", so.sync_until, Bounds<int64_t>::non_negative());
  so.outer_lr = c.get_double("sync.outer_lr", so.outer_lr, Bounds<double>::positive());
  so.outer_momentum =
      c.get_double("sync.outer_momentum", so.outer_momentum, Bounds<double>::in(0.0, 0.999));
  so.fragments = c.get_int("sync.fragments", so.fragments, Bounds<int64_t>::positive());
  so.overlap_steps =
      c.get_int("sync.overlap_steps", so.overlap_steps, Bounds<int64_t>::non_negative());
  so.merge_alpha = c.get_double("sync.merge_alpha", so.merge_alpha, Bounds<double>::in(0.0, 1.0));
  so.outer_bits = c.get_int("sync.outer_bits", so.outer_bits, Bounds<int64_t>::in(4, 32));
  so.outer_exchange =
      c.get_string("sync.outer_exchange", so.outer_exchange, {"all_gather", "reduce_scatter"});
  so.topology =
      c.get_string("sync.topology", so.topology, {"ring", "torus", "exponential", "complete"});
  so.consensus_every =
      c.get_int("sync.consensus_every", so.consensus_every, Bounds<int64_t>::non_negative());
  so.codec = c.get_string("sync.codec", so.codec);
  so.codec_error_feedback = c.get_bool("sync.codec_error_feedback", so.codec_error_feedback);
  // Deep Gradient Compression's momentum correction: the optimizer's momentum
  // moves to the gradients before the codec (SyncOptions::codec_momentum);
  // the optimizer then steps without it.
  so.codec_momentum_masking = c.get_bool("sync.codec_momentum_masking", so.codec_momentum_masking);
  so.powersgd_batched = c.get_bool("sync.powersgd_batched", so.powersgd_batched);
  so.codec_warmup_steps =
      c.get_int("sync.codec_warmup_steps", so.codec_warmup_steps, Bounds<int64_t>::non_negative());
  so.codec_warmup_density = c.get_double("sync.codec_warmup_density", so.codec_warmup_density,
                                         Bounds<double>{0.0, 1.0, true, false});
  if (c.get_bool("sync.codec_momentum", false)) {
    if (r.train.optimizer != "sgd") {
      throw ConfigError(fmt::format(
          "config {}: sync.codec_momentum = true applies SGD's momentum before the codec; it needs "
          "optim.name = \"sgd\", got \"{}\"",
          c.source(), r.train.optimizer));
    }
    so.codec_momentum = r.train.optim.sgd.momentum;
    so.codec_nesterov = r.train.optim.sgd.nesterov;
    r.train.optim.sgd.momentum = 0;
    r.train.optim.sgd.nesterov = false;
  }
  so.gossip_gamma =
      c.get_double("sync.gossip_gamma", so.gossip_gamma, Bounds<double>{0.0, 1.0, true, false});
  so.servers = c.get_int("sync.servers", so.servers, Bounds<int64_t>::positive());
  so.ps_mode = c.get_string("sync.ps_mode", so.ps_mode, {"bsp", "asp", "ssp"});
  so.staleness = c.get_int("sync.staleness", so.staleness, Bounds<int64_t>::non_negative());
  so.ps_switch = c.get_string("sync.ps_switch", so.ps_switch);
  so.staleness_lr = c.get_bool("sync.staleness_lr", so.staleness_lr);
  validate_sync_options(so);
  const std::string gnn_mode = c.get_string("gnn.parallel", "none", {"none", "graph", "layer"});
  r.gnn.mode = gnn_mode == "graph"   ? GnnParallel::graph
               : gnn_mode == "layer" ? GnnParallel::layer
                                     : GnnParallel::none;
  r.gnn.chunks = c.get_int("gnn.chunks", r.gnn.chunks, Bounds<int64_t>::positive());
  r.gnn.startup_epochs =
      c.get_int("gnn.startup_epochs", r.gnn.startup_epochs, Bounds<int64_t>::non_negative());
  r.gnn.graph_parts =
      c.get_int("gnn.graph_parts", r.gnn.graph_parts, Bounds<int64_t>::in(1, kMaxRanks));
  r.gnn.partition.method = parse_partition_method(
      c.get_string("gnn.partition", "contiguous", {"contiguous", "random", "locality"}));
  r.gnn.partition.imbalance =
      c.get_double("gnn.imbalance", r.gnn.partition.imbalance, Bounds<double>::in(0.0, 1.0));
  r.gnn.partition.seed = r.train.seed;
  r.gnn.replication = c.get_int("gnn.replication", 1, Bounds<int64_t>::in(1, kMaxRanks));
  c.check_all_used();
  return r;
}

GraphData open_graph(const DataSpec& d) {
  if (d.graph == "file") return load_graph(d.graph_file);
  if (d.graph == "edges") return read_edge_list(d.graph_file, d.edges);
  if (d.graph == "rmat") return make_rmat(d.rmat);
  if (d.graph == "knn") return make_fashion_knn(d.knn);
  return make_csbm(d.csbm);
}

std::shared_ptr<const Dataset> open_dataset(const DataSpec& d, const ModelSpec& m,
                                            DataSplit split) {
  const int64_t limit = split == DataSplit::train ? d.limit_train : d.limit_test;
  if (d.kind == "fashion_mnist") {
    FashionMnistOptions o;
    o.dir = d.dir;
    o.split = split;
    o.limit = limit;
    o.flatten = m.kind == "mlp";
    o.normalize = d.normalize;
    o.mean = static_cast<float>(d.mean);
    o.std = static_cast<float>(d.std);
    return std::make_shared<FashionMnist>(o);
  }
  ByteTextOptions o;
  o.path = d.path;
  o.seq_len = m.seq_len;
  o.split = split;
  o.test_fraction = d.test_fraction;
  o.limit = limit;
  return std::make_shared<ByteText>(o);
}

}  // namespace mt
