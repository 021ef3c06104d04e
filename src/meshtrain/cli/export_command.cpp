// `meshtrain export`: a checkpoint's weights as a PyTorch-layout safetensors
// file (train/export.h), and optionally the model's logits for the first test
// examples, so another framework can check it computes the same function.
#include <fmt/format.h>

#include <algorithm>

#include "meshtrain/cli/commands.h"
#include "meshtrain/cli/run_config.h"
#include "meshtrain/data/loader.h"
#include "meshtrain/exec/executor.h"
#include "meshtrain/models/torch_names.h"
#include "meshtrain/tensor/kernels.h"
#include "meshtrain/train/export.h"
#include "meshtrain/train/safetensors.h"

namespace mt {

namespace {

std::string default_logits_path(const std::string& out) {
  const std::string ext = ".safetensors";
  if (out.size() > ext.size() && out.ends_with(ext)) {
    return out.substr(0, out.size() - ext.size()) + ".logits" + ext;
  }
  return out + ".logits.safetensors";
}

// The model's f32 forward pass over the first `n` test examples (file
// order), with the checkpoint's parameters as they are (not through the
// PyTorch map, so a mistake in the map shows up as a difference).
std::map<std::string, Tensor> first_logits(const RunConfig& rc,
                                           const std::map<std::string, Tensor>& params, int64_t n) {
  auto test = open_dataset(rc.data, rc.model, DataSplit::test);
  n = std::min<int64_t>(n, test->size());
  if (n <= 0) {
    throw ConfigError(fmt::format("--logits-for: the test split of {} is empty", test->describe()));
  }
  LoaderOptions lo;
  lo.batch_size = n;
  lo.shuffle = false;
  lo.drop_last = false;
  DataLoader loader(*test, lo);
  Batch b = loader.batch(0, 0);

  ModelSpec spec = rc.model;
  spec.compute = DType::f32;
  ModelGraph m = build_model(spec, n);
  kernels(rc.train.exec.backend, rc.train.exec.fast).set_num_threads(rc.train.threads);
  ExecOptions eo = rc.train.exec;
  eo.outputs = {m.logits};
  eo.recompute = false;
  Executor ex(m.graph, eo);
  for (ValueId id : m.graph.params()) ex.bind(id, params.at(m.graph.value(id).name));
  for (auto& [id, t] : m.constants) ex.bind(id, t);
  Tensor x = b.x.reshape(m.graph.value(m.x).shape);
  ex.bind(m.x, x);
  ex.bind(m.y, b.y);
  ex.run_forward();
  return {{"x", x.clone()}, {"y", b.y.clone()}, {"logits", ex.get(m.logits).clone()}};
}

}  // namespace

int cmd_export(const CommandOptions& opts) {
  Config c = Config::load(opts.config_path);
  c.set_all(opts.overrides);
  const RunConfig rc = read_run_config(c);
  ModelSpec spec = rc.model;
  spec.compute = DType::f32;
  const std::string ckpt =
      opts.export_checkpoint.empty() ? rc.train.checkpoint_path : opts.export_checkpoint;
  if (ckpt.empty()) {
    throw ConfigError(
        fmt::format("export: no checkpoint to read: pass --checkpoint PATH or set train.checkpoint "
                    "in {}",
                    opts.config_path));
  }
  const CheckpointParams cp = read_checkpoint_params(ckpt, spec);
  std::map<std::string, std::string> extra = {{"source", ckpt}};
  if (auto it = cp.metadata.find("step"); it != cp.metadata.end()) extra["step"] = it->second;
  save_torch_weights(opts.export_out, spec, cp.params, extra);
  const TorchNameMap map = torch_name_map(spec);
  int64_t values = 0;
  for (const auto& [name, t] : cp.params) values += t.numel();
  fmt::print("exported {} ({} tensors, {} parameters; layout {}, {} names) from {}{} to {}\n",
             spec.kind, map.tensors.size(), values, kTorchLayout, map.naming, ckpt,
             extra.contains("step") ? " (step " + extra["step"] + ")" : "", opts.export_out);

  if (opts.logits_for > 0) {
    const std::string path =
        opts.logits_out.empty() ? default_logits_path(opts.export_out) : opts.logits_out;
    std::map<std::string, Tensor> t = first_logits(rc, cp.params, opts.logits_for);
    const int64_t n = t.at("x").shape()[0];
    save_safetensors(path, t,
                     {{"model", spec.kind},
                      {"model_config", model_config_json(spec)},
                      {"weights", opts.export_out}});
    fmt::print("logits of the first {} test examples (f32): {}\n", n, path);
  }
  return 0;
}

}  // namespace mt
