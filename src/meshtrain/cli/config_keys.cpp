#include "meshtrain/cli/config_keys.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>

#include "meshtrain/cli/run_config.h"

namespace mt {

namespace {

// One line per key that run_config.cpp reads. A new key gets its line here
// (config_keys_test fails otherwise); defaults, types and allowed values
// come from the getters, so they are not repeated.
const std::vector<KeyMeaning> kMeanings = {
    {"model.kind",
     "which model to train (gpt trains on text, mlp and cnn on fashion_mnist, the graph neural "
     "networks gcn, sage, gat and resgcn on a graph, full-graph (one process, or gnn.parallel)"},
    {"model.hidden", "mlp: widths of the hidden layers"},
    {"model.conv_channels", "cnn: output channels of each conv-relu-pool block"},
    {"model.fc", "cnn: width of the hidden layer of the classifier"},
    {"model.layers", "gpt: transformer blocks"},
    {"model.d_model", "gpt: width of the residual stream (embedding size)"},
    {"model.heads", "gpt: attention heads (must divide model.d_model)"},
    {"model.seq_len",
     "gpt: context length in tokens (bytes); activation memory grows with its square"},
    {"model.vocab",
     "gpt: vocabulary size (embedding rows and logits); the data is bytes, so at least 256; "
     "larger sizes (GPT-3's 51200) shape plans and simulations of published models"},
    {"model.gnn_hidden", "gcn, sage, gat, resgcn: width of the hidden vertex embeddings"},
    {"model.gnn_layers",
     "gcn, sage, gat: graph convolutions; resgcn: residual blocks (e.g. 32) between an input "
     "and an output linear layer"},
    {"model.gat_heads",
     "gat: attention heads; hidden layers concatenate them (gnn_hidden / gat_heads columns "
     "each), the last layer averages them"},
    {"model.sage_aggregation",
     "sage: how a vertex combines its in-neighbours' features (mean, or the feature-wise max)"},

    {"data.kind",
     "data set; default text for model.kind gpt, graph for gcn / sage / gat / resgcn, "
     "fashion_mnist otherwise"},
    {"data.graph",
     "graph: csbm (contextual stochastic block model) or rmat generated from data.graph_seed, knn "
     "(the k-nearest-neighbour graph of the Fashion-MNIST images in data.dir), file "
     "(data.graph_file, docs/graph_format.md) or edges (data.graph_file as a text edge list, e.g. "
     "scripts/graphs/debian_graphs.py's karate club)"},
    {"data.graph_file",
     "graph: the graph file (data.graph = file) or text edge list (edges) to read"},
    {"data.vertices", "graph csbm: number of vertices"},
    {"data.classes", "graph csbm / rmat: number of classes (rmat: degree buckets)"},
    {"data.avg_degree", "graph csbm: mean vertex degree (undirected edges, both ends count)"},
    {"data.homophily", "graph csbm: fraction of a vertex's edges that stay inside its class"},
    {"data.features", "graph csbm / rmat: vertex feature width"},
    {"data.feature_signal",
     "graph csbm: length of each class's mean feature vector (noise is standard normal)"},
    {"data.train_fraction", "graph csbm / rmat / edges: fraction of vertices in the training mask"},
    {"data.val_fraction",
     "graph csbm / rmat / edges: fraction in the validation mask (the rest: test); knn: fraction "
     "of the "
     "training images held out for validation"},
    {"data.graph_seed",
     "graph csbm / rmat: seed of the generator and of the split; edges: of the split; knn: of the "
     "validation draw"},
    {"data.rmat_scale", "graph rmat: 2^scale vertices"},
    {"data.rmat_edge_factor", "graph rmat: edges drawn per vertex before deduplication"},
    {"data.rmat_a", "graph rmat: probability of the top-left quadrant (d = 1 - a - b - c)"},
    {"data.rmat_b", "graph rmat: probability of the top-right quadrant"},
    {"data.rmat_c", "graph rmat: probability of the bottom-left quadrant"},
    {"data.knn_k",
     "graph knn: neighbours per image (exact Euclidean search; the graph is symmetrised, so "
     "degrees are >= k)"},
    {"data.dir",
     "fashion_mnist, graph knn: directory of the idx(.gz) files (Debian dataset-fashion-mnist)"},
    {"data.path", "text: a file or a directory of files (Debian fortunes)"},
    {"data.test_fraction", "text: fraction at the end of the text held out for evaluation"},
    {"data.limit_train",
     "use only the first N training examples (text: windows; graph knn: images); -1 = all"},
    {"data.limit_test",
     "use only the first N test examples (text: windows; graph knn: images); -1 = all"},
    {"data.shuffle",
     "training batches from a seeded permutation per epoch (train.seed + epoch); false = file "
     "order"},
    {"data.normalize",
     "fashion_mnist, graph knn: pixels as (x/255 - data.mean) / data.std (mean_std) or x/255 "
     "(none)"},
    {"data.mean", "fashion_mnist, graph knn: the mean subtracted by data.normalize = mean_std"},
    {"data.std",
     "fashion_mnist, graph knn: the standard deviation divided by data.normalize = mean_std"},

    {"train.epochs", "passes over the training split"},
    {"train.steps", "> 0: the run is this many optimizer steps (capped by train.epochs)"},
    {"train.batch_size", "global batch: examples per optimizer step over all ranks together"},
    {"train.eval_batch_size", "examples per evaluation batch (all ranks together)"},
    {"train.eval_batches",
     "> 0: each evaluation covers only the first N test batches (file order); 0 = all"},
    {"train.seed", "seed of parameter initialisation and data order"},
    {"train.threads", "threads per rank for the kernels"},
    {"train.precision",
     "f32, or mixed precision with bf16 / f16 matmuls and f32 master weights; bf16_storage: f32 "
     "compute with the activations the backward reads stored in bf16; auto: bf16 where its "
     "matmuls measure >= 1.1x f32 on the model's shapes at start-up, else bf16_storage where its "
     "casts measure <= 2% of the matmul time or the f32 run would not fit in memory, else f32 "
     "(docs/engines.md)"},
    {"train.eval", "evaluate on the test split after every epoch and at the end"},
    {"train.eval_every",
     "> 0: with train.eval, also evaluate every this-many optimizer steps; 0 = per epoch only"},
    {"train.log_every", "steps between metrics lines"},
    {"train.checkpoint",
     "checkpoint path written at the end (.safetensors file or a directory); \"\" = none"},
    {"train.checkpoint_every", "> 0: also write the checkpoint every N steps"},
    {"train.checkpoint_keep",
     "> 0: train.checkpoint is a directory of step_NNNNNNNN checkpoints, the newest N kept; 0 = "
     "each save replaces train.checkpoint"},
    {"train.resume",
     "continue from this checkpoint (file or sharded directory, same model exactly), or \"auto\": "
     "the newest valid one under train.checkpoint; \"\" = fresh run"},
    {"train.init",
     "start a new run from a PyTorch-layout safetensors file (meshtrain export); not applied "
     "when resuming"},
    {"train.init_partial",
     "train.init loads only the tensors that match by name and shape, and lists the rest"},
    {"train.tensorboard",
     "directory for a TensorBoard event file of the metrics (as --tensorboard); \"\" = none"},
    {"train.halt_after",
     "> 0: stop this invocation after N steps without changing the run's schedule"},

    {"optim.name", "optimizer"},
    {"optim.lr", "peak learning rate"},
    {"optim.weight_decay", "decoupled weight decay; default 0 for sgd, 0.01 for the others"},
    {"optim.momentum", "sgd and lars: momentum"},
    {"optim.nesterov", "sgd: Nesterov momentum"},
    {"optim.beta1", "adamw and lamb: first-moment decay"},
    {"optim.beta2", "adamw and lamb: second-moment decay"},
    {"optim.eps", "adamw and lamb: denominator epsilon; default 1e-6 for lamb, 1e-8 otherwise"},
    {"optim.trust_coefficient", "lars: trust coefficient of the layer-wise learning rate"},
    {"optim.schedule", "learning-rate schedule after the warm-up"},
    {"optim.warmup_steps", "steps of linear warm-up from 0 to optim.lr"},
    {"optim.min_lr", "cosine: the learning rate at the end of the run"},
    {"optim.clip_grad_norm", "> 0: clip the global gradient norm to this value"},

    {"exec.backend", "kernels: fast (oneDNN, OpenBLAS, AVX-512) or reference (the oracle)"},
    {"exec.recompute", "recompute cheap activations in backward instead of keeping them"},
    {"exec.matmul",
     "f32 matmul library; measure picks per shape by timing the first calls among the engines "
     "that pass the correctness probe (docs/engines.md)"},
    {"exec.conv_layout", "convolution layout; measure picks per shape by timing"},
    {"exec.openblas_coretype",
     "auto: restart with OPENBLAS_CORETYPE set when OpenBLAS chose kernels below the CPU's "
     "(an environment's setting is kept); best: even over the environment's; keep: never"},

    {"dist.nproc", "local ranks to start through mpirun (as --nproc)"},
    {"dist.zero_stage",
     "0 data parallel, 1 + sharded optimizer state, 2 + sharded gradients, 3 + sharded parameters"},
    {"dist.bucket_mb", "gradient bucket size in MiB"},
    {"dist.overlap", "start each bucket's collective during backward"},
    {"dist.accumulation_steps", "micro-steps per optimizer step (splits each rank's batch)"},
    {"dist.batch_shares", "per-rank integer shares of the global batch, e.g. [2, 1]; [] = equal"},
    {"dist.consistency_every",
     "steps between parameter checksum comparisons across ranks; 0 = never"},
    {"dist.straggler_report", "report ranks that are persistently slower than the others"},
    {"dist.straggler_threshold", "a straggler is this many times slower than the others' median"},
    {"dist.trace", "Chrome-trace JSON timeline of every rank, merged (as --trace); \"\" = none"},
    {"dist.slowdown", "per-rank factor stretching compute, to stand in for slower devices"},
    {"dist.cluster",
     "cluster file (TOML, docs/cluster.md): node groups, emulated link latency and bandwidth, "
     "per-rank slowdown; \"\" = none (links unconstrained)"},
    {"dist.node_size",
     "group ranks into nodes of this many (hierarchical all-reduce, for tests without a "
     "cluster file); 0 = the machine's hosts"},
    {"dist.hierarchical",
     "all-reduce, reduce-scatter and all-gather in two levels (inside each node, then across "
     "nodes) when the ranks span several nodes of equal size; false = flat ring / "
     "halving-doubling"},
    {"dist.algorithm_choice",
     "how collectives pick their algorithm: \"static\" (fixed rules: shared memory on one "
     "node) or \"measured\" (a short probe when the ranks start times every algorithm at a few "
     "sizes and keeps the fastest per size range; docs/comm.md)"},
    {"dist.fault", "drill: \"kill:RANK@STEP\" or \"stall:RANK@STEP\"; \"\" = none"},
    {"dist.timeout_s", "deadline of every collective, in seconds"},
    {"dist.stop_grace_s",
     "seconds the --nproc launcher gives ranks to stop after SIGINT/SIGTERM before SIGKILL"},
    {"parallel.dp", "data-parallel degree of the plan; 0 = the ranks left: dist.nproc / (tp * pp)"},
    {"parallel.tp",
     "tensor-parallel degree (Megatron column/row splits, lowered into each rank's graph)"},
    {"parallel.pp", "pipeline stages (run by the pipeline runtime)"},
    {"parallel.sp", "sequence parallelism in the layer-norm regions over the tp axis (gpt)"},
    {"parallel.microbatches", "micro-batches per step through the pipeline (pp > 1)"},
    {"parallel.schedule", "pipeline schedule"},
    {"parallel.virtual_stages",
     "model chunks per pipeline stage (schedule interleaved needs >= 2, zbv and dualpipev "
     "exactly 2, the others 1)"},
    {"parallel.warmup_extra",
     "schedule 1f1b: extra warm-up forwards on every stage but the last, so a stage has the "
     "next activation in flight while it waits for a gradient (transfer latency stops adding "
     "up per micro-batch); each holds one more micro-batch's stash"},
    {"parallel.async",
     "asynchronous pipelining on schedule 1f1b: none (synchronous), pipedream (each stage "
     "updates after every micro-batch's backward; the backward uses the weights its forward "
     "used, kept in a stash) or spectrain (the forward uses weights predicted s updates ahead, "
     "s the micro-batch's version gap); not equivalent to the synchronous run"},
    {"parallel.recompute",
     "pipeline activation recomputation: true (every stage), or a list of virtual stages; a "
     "stage keeps only its received inputs per micro-batch in flight and runs its forward "
     "again before the backward"},
    {"parallel.tp_ratios",
     "per-tp-rank integer shares of every tensor-parallel split, e.g. [2, 1]; [] = even"},
    {"sync.scheme",
     "how data-parallel replicas agree: allreduce (every step, ZeRO per dist.zero_stage), "
     "local_sgd, diloco, gossip (D-PSGD), adpsgd (AD-PSGD), partial (layer-wise) or ps "
     "(parameter server) (docs/sync.md, sync/replica_sync.h)"},
    {"sync.period",
     "local_sgd / diloco: optimizer steps between synchronizations (H); partial: layer groups, "
     "each averaged once every this-many steps"},
    {"sync.sync_until",
     "local_sgd: average after every step for the first this-many steps (post-local SGD)"},
    {"sync.outer_lr", "diloco: the outer Nesterov step's learning rate"},
    {"sync.outer_momentum", "diloco: the outer Nesterov momentum"},
    {"sync.fragments",
     "diloco: Streaming DiLoCo's fragments, consecutive element-balanced pieces of the "
     "parameters, each synchronized every sync.period steps at its own evenly spread phase"},
    {"sync.overlap_steps",
     "diloco: inner steps a fragment's exchange overlaps before it lands (tau, < sync.period; "
     "0 = blocking)"},
    {"sync.merge_alpha",
     "diloco with overlap: a landing fragment becomes alpha x local + (1 - alpha) x global"},
    {"sync.outer_bits",
     "diloco: bits per pseudo-gradient value on the outer exchange: 32 (f32 all-reduce) or 4 "
     "(per-chunk-scaled stochastic 4-bit codes, summed in f32; see sync.outer_exchange)"},
    {"sync.outer_exchange",
     "diloco, outer_bits = 4: all_gather (every rank's codes to every rank, one rounding) or "
     "reduce_scatter (pieces to their owner by all_to_all, summed, re-quantized, all-gathered: "
     "2 (N - 1) / N instead of N - 1 payloads)"},
    {"sync.topology",
     "gossip: the graph replicas average over (uniform weights 1 / (degree + 1)); adpsgd: an "
     "active (even) rank picks its partner among its odd neighbours on it"},
    {"sync.codec",
     "codec on the exchange: none, f16, bf16, topk:K[:compact], randk:K[:compact] (K a count or "
     "a fraction; compact: bf16 values, Elias-Fano indices), "
     "qsgd:BITS[:BUCKET], sign[:CHUNK], powersgd:RANK; on the gradients (allreduce; under "
     "ZeRO a compressed reduce-scatter, not powersgd), the pseudo-gradients (local_sgd, diloco "
     "and its fragments, partial), the pushes (ps; powersgd: each worker's own factors) or the "
     "parameters' difference from their public copy (gossip, adpsgd: CHOCO-SGD) "
     "(docs/codecs.md)"},
    {"sync.codec_error_feedback",
     "keep what a codec did not send and add it to the next exchange's input"},
    {"sync.codec_momentum",
     "allreduce with a topk codec: Deep Gradient Compression's momentum correction -- "
     "optim.momentum (and optim.nesterov) applied to each rank's gradient before the codec, the "
     "residual accumulating velocity; the optimizer then steps without momentum (sgd only; "
     "docs/codecs.md)"},
    {"sync.codec_momentum_masking",
     "with sync.codec_momentum: zero the velocity of the coordinates sent (momentum factor "
     "masking)"},
    {"sync.powersgd_batched",
     "allreduce with powersgd:R: every tensor's P in one all-reduce per step and every Q in "
     "another (as PyTorch's hook per bucket) instead of one or two per tensor: 2 latencies a "
     "step"},
    {"sync.codec_warmup_steps",
     "allreduce with topk:FRACTION: Deep Gradient Compression's sparsity warm-up -- the first "
     "this-many steps in 4 stages at densities shrinking exponentially from "
     "sync.codec_warmup_density to the fraction (0 = off; the warm-up's bytes count in the run's)"},
    {"sync.codec_warmup_density",
     "with sync.codec_warmup_steps: the density of the warm-up's first stage, in [the codec's "
     "fraction, 1]"},
    {"sync.gossip_gamma",
     "gossip / adpsgd with a sync.codec (CHOCO-SGD): the consensus step size in (0, 1], x_i += "
     "gamma sum_j w_ij (xhat_j - xhat_i) over the public copies"},
    {"sync.consensus_every",
     "steps between consensus-distance metrics lines (replicas' spread; 0 = summary only)"},
    {"sync.servers",
     "ps: the last this-many ranks hold the parameter shards and run the optimizer; the others "
     "compute"},
    {"sync.ps_mode",
     "ps: bsp (every step waits for every worker: all-reduce DP), asp (each push applied as it "
     "comes) or ssp (asp, no worker more than sync.staleness steps ahead of the slowest)"},
    {"sync.staleness", "ps with ps_mode ssp: the staleness bound s in steps (>= 0)"},
    {"sync.ps_switch",
     "ps: \"\" (no switch), \"after:N\" (BSP for N steps, then ASP) or \"straggler\" (BSP "
     "until the straggler report sees a persistent straggler, then ASP)"},
    {"sync.staleness_lr",
     "ps: divide an asynchronous push's learning rate by its staleness (server updates since "
     "its parameters were pulled)"},
    {"parallel.stage_layers",
     "layers (gpt: transformer blocks) per pipeline stage, e.g. [3, 1]; [] = balanced by FLOPs"},
    {"gnn.parallel",
     "full-graph GNN training over dist.nproc ranks: none (one process), graph (1D row "
     "partitioning, halo exchange of the boundary rows) or layer (GNNPipe: consecutive layers "
     "per rank, vertex chunks flow through them; docs/graph_format.md)"},
    {"gnn.chunks",
     "gnn.parallel = layer: vertex chunks that flow through the stages (split by gnn.partition); "
     "a chunk reads later chunks' messages from the previous epoch (historical embeddings)"},
    {"gnn.startup_epochs",
     "gnn.parallel = layer: the first epochs run as one chunk (no historical embeddings)"},
    {"gnn.graph_parts",
     "gnn.parallel = layer: GNNPipe's hybrid with graph parallelism; dist.nproc = stages x "
     "graph_parts, each graph part (split by gnn.partition) goes through the stages on its own "
     "ranks, a stage's parts exchange halo rows each layer and all-reduce its gradients; 1 = "
     "pure layer pipelining"},
    {"gnn.partition",
     "which rank owns each vertex: contiguous id blocks, random (seeded by train.seed), or "
     "locality (LDG streaming + label propagation, balanced within gnn.imbalance)"},
    {"gnn.replication",
     "gnn.parallel = graph: CAGNET's replication factor c; 1 = 1D, c > 1 = 1.5D (dist.nproc / c "
     "row blocks, each held by c ranks that split its halo and all-reduce their partial "
     "aggregations); must divide dist.nproc"},
    {"gnn.imbalance",
     "gnn.partition = locality: a part holds at most (1 + imbalance) x vertices / ranks"},
};

std::string section_of(std::string_view key) {
  const size_t dot = key.rfind('.');
  return std::string(dot == std::string_view::npos ? std::string_view() : key.substr(0, dot));
}

std::string leaf_of(std::string_view key) {
  const size_t dot = key.rfind('.');
  return std::string(dot == std::string_view::npos ? key : key.substr(dot + 1));
}

}  // namespace

const std::vector<KeyMeaning>& key_meanings() {
  return kMeanings;
}

std::string_view key_meaning(std::string_view key) {
  for (const KeyMeaning& m : kMeanings) {
    if (m.key == key) return m.meaning;
  }
  return {};
}

std::vector<KeyInfo> known_keys() {
  Config empty;
  read_run_config(empty);
  return empty.catalogue();
}

namespace {

// known_keys() in the table's order, then any key the table lacks (the test
// keeps that part empty).
std::vector<KeyInfo> keys_in_table_order() {
  std::vector<KeyInfo> keys = known_keys();
  auto rank = [](const std::string& k) {
    for (size_t i = 0; i < kMeanings.size(); ++i) {
      if (kMeanings[i].key == k) return i;
    }
    return kMeanings.size();
  };
  std::stable_sort(keys.begin(), keys.end(),
                   [&](const KeyInfo& a, const KeyInfo& b) { return rank(a.key) < rank(b.key); });
  return keys;
}

std::string md_cell(std::string_view text) {
  std::string out;
  for (char c : text) {
    if (c == '|') out += '\\';
    out += c;
  }
  return out;
}

}  // namespace

std::string format_key_markdown() {
  std::string out = "| key | type | default | allowed | meaning |\n|---|---|---|---|---|\n";
  for (const KeyInfo& k : keys_in_table_order()) {
    out += fmt::format("| `{}` | {} | {} | {} | {} |\n", k.key, k.type,
                       k.required ? "required" : fmt::format("`{}`", k.def),
                       k.allowed.empty() ? "" : md_cell(k.allowed), md_cell(key_meaning(k.key)));
  }
  return out;
}

std::string format_key_list() {
  const std::vector<KeyInfo> keys = keys_in_table_order();
  size_t wk = 3, wt = 4, wd = 7, wa = 7;
  for (const KeyInfo& k : keys) {
    wk = std::max(wk, k.key.size());
    wt = std::max(wt, k.type.size());
    wd = std::max(wd, k.required ? 8 : k.def.size());
    wa = std::max(wa, k.allowed.size());
  }
  std::string out = fmt::format("{:<{}}  {:<{}}  {:<{}}  {:<{}}  {}\n", "KEY", wk, "TYPE", wt,
                                "DEFAULT", wd, "ALLOWED", wa, "MEANING");
  std::string section;
  for (const KeyInfo& k : keys) {
    const std::string s = section_of(k.key);
    if (s != section && !section.empty()) out += "\n";
    section = s;
    std::string_view meaning = key_meaning(k.key);
    out += fmt::format("{:<{}}  {:<{}}  {:<{}}  {:<{}}  {}\n", k.key, wk, k.type, wt,
                       k.required ? "required" : k.def, wd, k.allowed.empty() ? "-" : k.allowed, wa,
                       meaning.empty() ? "(no description)" : meaning);
  }
  return out;
}

std::string format_effective_config(const Config& config) {
  // Sections in the order they were first read, keys in reading order.
  std::vector<std::string> sections;
  std::map<std::string, std::vector<const KeyInfo*>> by_section;
  for (const KeyInfo& k : config.catalogue()) {
    const std::string s = section_of(k.key);
    if (by_section.find(s) == by_section.end()) sections.push_back(s);
    by_section[s].push_back(&k);
  }
  std::string out = fmt::format(
      "# effective configuration from {} and --set; keys marked \"# default\" were not set\n",
      config.source().empty() ? "(no file)" : config.source());
  for (const std::string& s : sections) {
    if (!s.empty()) out += fmt::format("\n[{}]\n", s);
    for (const KeyInfo* k : by_section[s]) {
      if (auto v = config.value_text(k->key)) {
        out += fmt::format("{} = {}\n", leaf_of(k->key), *v);
      } else if (!k->required) {
        out += fmt::format("{} = {}  # default\n", leaf_of(k->key), k->def);
      }
    }
  }
  return out;
}

}  // namespace mt
