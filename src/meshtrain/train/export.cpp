#include "meshtrain/train/export.h"

#include <cstring>
#include <filesystem>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "meshtrain/models/torch_names.h"
#include "meshtrain/tensor/box.h"
#include "meshtrain/train/checkpoint.h"
#include "meshtrain/train/safetensors.h"
#include "meshtrain/train/sharded_checkpoint.h"

namespace mt {

namespace fs = std::filesystem;

namespace {

// At most this many differences are listed in one error; the rest are counted.
constexpr size_t kMaxListed = 40;

std::string listing(const std::vector<std::string>& lines) {
  std::string out;
  for (size_t i = 0; i < lines.size() && i < kMaxListed; ++i) out += "\n  " + lines[i];
  if (lines.size() > kMaxListed)
    out += fmt::format("\n  ... and {} more", lines.size() - kMaxListed);
  return out;
}

std::string shape_diff(const std::string& name, const Shape& file, const Shape& model) {
  std::string s =
      fmt::format("{}: the file holds {}, the model has {}", name, file.str(), model.str());
  if (file.rank() == 2 && model.rank() == 2 && file[0] == model[1] && file[1] == model[0]) {
    s += " (transposed: [in, out] instead of PyTorch's [out, in]?)";
  }
  return s;
}

std::map<std::string, Shape> graph_params(const ModelSpec& spec) {
  ModelSpec s = spec;
  s.compute = DType::f32;
  const ModelGraph m = build_model(s, 1);
  std::map<std::string, Shape> out;
  for (ValueId id : m.graph.params()) out.emplace(m.graph.value(id).name, m.graph.value(id).shape);
  return out;
}

// A stored tensor as a PyTorch-layout file may hold it, converted to f32.
Tensor read_f32(const SafetensorsReader& r, const std::string& name) {
  Tensor t = r.read(name);
  return t.dtype() == DType::f32 ? t : t.to(DType::f32);
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

}  // namespace

std::string model_config_json(const ModelSpec& s) {
  nlohmann::json j = {{"kind", s.kind}};
  if (s.kind == "gpt") {
    j.update({{"layers", s.layers},
              {"d_model", s.d_model},
              {"heads", s.heads},
              {"seq_len", s.seq_len},
              {"vocab", s.vocab}});
  } else {
    j.update({{"image_channels", s.image_channels},
              {"image_size", s.image_size},
              {"classes", s.classes}});
    if (s.kind == "mlp") j["hidden"] = s.hidden;
    if (s.kind == "cnn") j.update({{"conv_channels", s.conv_channels}, {"fc", s.fc}});
  }
  return j.dump();
}

CheckpointParams read_checkpoint_params(const std::string& path, const ModelSpec& spec) {
  const std::map<std::string, Shape> want = graph_params(spec);
  constexpr std::string_view kPrefix = "param/";
  std::map<std::string, std::pair<DType, Shape>> stored;
  CheckpointParams out;
  std::optional<CheckpointReader> reader;
  std::string kind;
  std::error_code ec;
  const bool sharded = fs::is_directory(path, ec);
  if (sharded) {
    const ShardedIndex index = read_index(path);
    out.metadata = index.metadata;
    for (const auto& [name, info] : index.tensors) {
      if (name.starts_with(kPrefix)) stored[name.substr(kPrefix.size())] = {info.dtype, info.shape};
    }
    if (auto it = out.metadata.find("model"); it != out.metadata.end()) kind = it->second;
  } else {
    reader.emplace(path);
    out.metadata = reader->metadata();
    for (const SafetensorsEntry& e : reader->header().entries) {
      if (e.name.starts_with(kPrefix)) stored[e.name.substr(kPrefix.size())] = {e.dtype, e.shape};
    }
    if (auto it = out.metadata.find("extra/model"); it != out.metadata.end()) kind = it->second;
  }
  if (!kind.empty() && kind != spec.kind) {
    throw CheckpointError(
        fmt::format("checkpoint {}: holds a {} model, but the config describes a {} (model.kind)",
                    path, kind, spec.kind));
  }
  std::vector<std::string> diffs;
  for (const auto& [name, shape] : want) {
    auto it = stored.find(name);
    if (it == stored.end()) {
      diffs.push_back(fmt::format("missing: {} {}", name, shape.str()));
    } else if (it->second.first != DType::f32 || !(it->second.second == shape)) {
      diffs.push_back(fmt::format("{}: the checkpoint holds {} {}, the model has f32 {}", name,
                                  dtype_name(it->second.first), it->second.second.str(),
                                  shape.str()));
    }
  }
  for (const auto& [name, ds] : stored) {
    if (!want.contains(name))
      diffs.push_back(fmt::format("unexpected: {} {}", name, ds.second.str()));
  }
  if (stored.empty()) {
    throw CheckpointError(fmt::format(
        "checkpoint {}: holds no parameters (no 'param/...' tensors): not a meshtrain training "
        "checkpoint",
        path));
  }
  if (!diffs.empty()) {
    throw CheckpointError(fmt::format(
        "checkpoint {}: its parameters do not match the {} model of the config ({} difference{}; "
        "is it the config that trained it?):{}",
        path, spec.kind, diffs.size(), diffs.size() == 1 ? "" : "s", listing(diffs)));
  }
  for (const auto& [name, shape] : want) out.params[name] = Tensor::empty(shape, DType::f32);
  if (sharded) {
    std::vector<ShardPiece> wanted;
    for (auto& [name, t] : out.params) wanted.push_back(full_piece(std::string(kPrefix) + name, t));
    load_sharded(nullptr, path, wanted);
  } else {
    for (auto& [name, t] : out.params) t = reader->read(std::string(kPrefix) + name);
  }
  return out;
}

void save_torch_weights(const std::string& path, const ModelSpec& spec,
                        const std::map<std::string, Tensor>& params,
                        const std::map<std::string, std::string>& extra) {
  const TorchNameMap map = torch_name_map(spec);
  std::map<std::string, std::string> meta = extra;
  meta["format"] = "pt";
  meta["layout"] = std::string(kTorchLayout);
  meta["naming"] = map.naming;
  meta["model"] = spec.kind;
  meta["model_config"] = model_config_json(spec);
  save_safetensors(path, to_torch(map, params), meta);
}

namespace {

// A model tensor matched in the file: the entry to read it from, and its
// value when the tie check had to read it already.
struct MatchedTensor {
  const TorchTensor* tensor = nullptr;
  std::string entry;
  std::optional<Tensor> value;  // f32, PyTorch's layout
};

struct TorchMatch {
  TorchLoadReport report;
  std::vector<MatchedTensor> staged;
};

// Opens the file as load_torch_weights does (directories refused).
SafetensorsReader open_torch_file(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    if (is_sharded_checkpoint(path)) {
      throw CheckpointError(fmt::format(
          "{}: is a sharded meshtrain training checkpoint, not a PyTorch-layout weights file: "
          "continue that run with train.resume, or write its weights with `meshtrain export` first",
          path));
    }
    throw FileError(fmt::format("{}: is a directory, not a safetensors file", path));
  }
  return SafetensorsReader(path);
}

// Matches the file's header (and the values of tied aliases) against the
// model; throws as load_torch_weights documents. Reads no other values.
TorchMatch match_torch_file(const SafetensorsReader& r, const std::string& path,
                            const ModelSpec& spec, const TorchNameMap& map,
                            const TorchLoadOptions& options) {
  const SafetensorsHeader& h = r.header();
  TorchMatch match;
  TorchLoadReport& report = match.report;
  report.path = path;

  // What the file says about itself.
  auto meta = [&](const std::string& key) -> std::optional<std::string> {
    auto it = h.metadata.find(key);
    if (it == h.metadata.end()) return std::nullopt;
    return it->second;
  };
  bool training_checkpoint = false;
  for (const auto& [key, value] : h.metadata) training_checkpoint |= key.starts_with("meshtrain/");
  for (const SafetensorsEntry& e : h.entries) training_checkpoint |= e.name.starts_with("param/");
  if (training_checkpoint) {
    throw CheckpointError(fmt::format(
        "{}: is a meshtrain training checkpoint, not a PyTorch-layout weights file: continue "
        "that run with train.resume, or write its weights with `meshtrain export` first",
        path));
  }
  auto refuse = [&](const std::string& key, const std::string& expected, const std::string& why) {
    auto v = meta(key);
    if (v && *v != expected) {
      throw CheckpointError(fmt::format("{}: __metadata__ records {} \"{}\", expected \"{}\" ({})",
                                        path, key, *v, expected, why));
    }
  };
  refuse("format", "pt", "a PyTorch file; other frameworks store matrices in other layouts");
  refuse("layout", std::string(kTorchLayout),
         "nn.Linear weights [out, in], Conv2d [out, in, kh, kw]; a square matrix in another "
         "layout has the same shape and would load transposed");
  refuse("model", spec.kind, "model.kind of the config");
  refuse("naming", map.naming, "tensor names as in docs/export.md");
  if (!meta("layout")) {
    report.assumed = fmt::format(
        "{} records no layout in its __metadata__: assuming {} (tensors as PyTorch modules hold "
        "them: nn.Linear weights [out, in], Conv2d [out, in, kh, kw]; names as in "
        "docs/export.md). A square matrix stored [in, out] cannot be told apart.",
        path, kTorchLayout);
  }

  // Match the model's tensors against the file's.
  std::set<std::string> used;
  std::vector<std::string> diffs;
  for (const TorchTensor& t : map.tensors) {
    std::vector<const SafetensorsEntry*> found;  // the name, then its aliases, as present
    if (const SafetensorsEntry* e = h.find(t.name)) found.push_back(e);
    for (const std::string& a : t.aliases) {
      if (const SafetensorsEntry* e = h.find(a)) found.push_back(e);
    }
    if (found.empty()) {
      report.left_at_init.push_back(fmt::format("{} {}: not in the file", t.name, t.shape.str()));
      diffs.push_back(fmt::format("missing: {} {}", t.name, t.shape.str()));
      continue;
    }
    std::optional<Tensor> value;
    bool ok = true;
    for (const SafetensorsEntry* e : found) {
      used.insert(e->name);
      std::string why;
      if (!is_float(e->dtype)) {
        why =
            fmt::format("{}: dtype {} is not floating-point", e->name, safetensors_dtype(e->dtype));
      } else if (!(e->shape == t.shape)) {
        why = shape_diff(e->name, e->shape, t.shape);
      } else if (found.size() > 1) {
        // Tied names: their values must agree (read whole to compare).
        Tensor v = read_f32(r, e->name);
        if (value && !same_bytes(*value, v)) {
          why = fmt::format("{}: differs from {} (the model ties them)", e->name, found[0]->name);
        } else if (!value) {
          value = v;
        }
      }
      if (!why.empty()) {
        ok = false;
        diffs.push_back(why);
        report.skipped.push_back(why);
      }
    }
    if (ok) {
      for (const SafetensorsEntry* e : found) report.loaded.push_back(e->name);
      report.elements += t.shape.numel();
      match.staged.push_back({&t, found[0]->name, value});
    } else {
      report.left_at_init.push_back(
          fmt::format("{} {}: no matching tensor", t.name, t.shape.str()));
    }
  }
  for (const SafetensorsEntry& e : h.entries) {
    if (used.contains(e.name)) continue;
    diffs.push_back(fmt::format("unexpected: {} {}", e.name, e.shape.str()));
    report.skipped.push_back(
        fmt::format("{} {}: the model has no such tensor", e.name, e.shape.str()));
  }
  if (!options.partial && !diffs.empty()) {
    throw CheckpointError(fmt::format(
        "{}: does not match the {} model ({} difference{}; train.init_partial = true loads only "
        "the tensors that match by name and shape):{}",
        path, spec.kind, diffs.size(), diffs.size() == 1 ? "" : "s", listing(diffs)));
  }
  return match;
}

}  // namespace

TorchLoadReport load_torch_weights(const std::string& path, const ModelSpec& spec,
                                   std::map<std::string, Tensor>& params,
                                   const TorchLoadOptions& options) {
  const SafetensorsReader r = open_torch_file(path);
  const TorchNameMap map = torch_name_map(spec);
  TorchMatch match = match_torch_file(r, path, spec, map, options);
  // Every destination is checked before the first is written.
  for (const TorchTensor& t : map.tensors) {
    for (const TorchPart& p : t.parts) {
      auto it = params.find(p.param);
      if (it == params.end() || it->second.dtype() != DType::f32 ||
          !(it->second.shape() == p.shape)) {
        throw ShapeError(
            fmt::format("parameter '{}': the {} model has f32 {}, the destination {}", p.param,
                        spec.kind, p.shape.str(),
                        it == params.end() ? std::string("is missing") : it->second.shape().str()));
      }
    }
  }
  std::vector<Tensor> values;  // read before anything is written
  for (const MatchedTensor& m : match.staged) {
    values.push_back(m.value ? *m.value : read_f32(r, m.entry));
  }
  for (size_t i = 0; i < values.size(); ++i) from_torch(*match.staged[i].tensor, values[i], params);
  return match.report;
}

TorchLoadReport load_torch_weights_into_boxes(const std::string& path, const ModelSpec& spec,
                                              std::map<std::string, Tensor>& held,
                                              const std::map<std::string, TensorPlace>& places,
                                              const TorchLoadOptions& options) {
  const std::map<std::string, Shape> shapes = graph_params(spec);
  auto box_of = [&](const std::string& name) {
    auto it = places.find(name);
    return it != places.end() ? it->second.box : Box::whole(shapes.at(name));
  };
  // Every destination is checked before anything is read.
  for (const auto& [name, t] : held) {
    auto it = shapes.find(name);
    if (it == shapes.end()) {
      throw ShapeError(
          fmt::format("parameter '{}': the {} model has no such parameter", name, spec.kind));
    }
    const Box b = box_of(name);
    bool fits = b.begin.size() == it->second.dims().size();
    for (size_t d = 0; fits && d < b.begin.size(); ++d) {
      fits = 0 <= b.begin[d] && b.begin[d] <= b.end[d] && b.end[d] <= it->second.dims()[d];
    }
    if (!fits || t.dtype() != DType::f32 || t.numel() != b.elements()) {
      throw ShapeError(fmt::format("parameter '{}': the destination is {} {} for box {} of {}",
                                   name, dtype_name(t.dtype()), t.shape().str(), b.str(),
                                   it->second.str()));
    }
  }
  const SafetensorsReader r = open_torch_file(path);
  const TorchNameMap map = torch_name_map(spec);
  const TorchMatch match = match_torch_file(r, path, spec, map, options);
  // Each held part: only its box's elements are read (one range read per
  // run contiguous in the file), into staging pieces first.
  std::vector<std::pair<Tensor, Tensor>> staged;  // (destination, values)
  for (const MatchedTensor& m : match.staged) {
    const SafetensorsEntry& e = *r.header().find(m.entry);
    const size_t es = dtype_size(e.dtype);
    int64_t part_offset = 0;  // elements of the earlier parts (stacked along dim 0)
    for (const TorchPart& p : m.tensor->parts) {
      const int64_t numel = p.shape.numel();
      auto it = held.find(p.param);
      if (it == held.end()) {
        part_offset += numel;
        continue;
      }
      const Box b = box_of(p.param);
      // The part as PyTorch holds it, and the box there.
      Shape file_shape = p.shape;
      Box file_box = b;
      if (p.transpose) {
        file_shape = Shape({p.shape[1], p.shape[0]});
        file_box = Box{{b.begin[1], b.begin[0]}, {b.end[1], b.end[0]}};
      }
      Tensor in_file = Tensor::empty(file_box.shape(), DType::f32);
      float* dst = in_file.data<float>();
      for (const ElementRun& run : piece_runs(file_shape, file_box, 0, file_box.elements())) {
        const int64_t n = run.end - run.begin, at = part_offset + run.begin;
        if (m.value) {
          std::copy_n(m.value->data<float>() + at, n, dst + run.offset);
        } else if (e.dtype == DType::f32) {
          r.read_bytes(m.entry, static_cast<uint64_t>(at) * es, static_cast<uint64_t>(n) * es,
                       dst + run.offset);
        } else {
          Tensor raw = Tensor::empty(Shape({n}), e.dtype);
          r.read_bytes(m.entry, static_cast<uint64_t>(at) * es, static_cast<uint64_t>(n) * es,
                       raw.raw());
          const Tensor f = raw.to(DType::f32);
          std::copy_n(f.data<float>(), n, dst + run.offset);
        }
      }
      Tensor values = in_file;
      if (p.transpose) {
        const int64_t rows = file_box.shape()[0], cols = file_box.shape()[1];
        values = Tensor::empty(b.shape(), DType::f32);
        for (int64_t i = 0; i < rows; ++i) {
          for (int64_t j = 0; j < cols; ++j) values.data<float>()[j * rows + i] = dst[i * cols + j];
        }
      }
      staged.emplace_back(it->second, values);
      part_offset += numel;
    }
  }
  for (auto& [dest, values] : staged) {
    std::copy_n(values.data<float>(), values.numel(), dest.data<float>());
  }
  return match.report;
}

}  // namespace mt
