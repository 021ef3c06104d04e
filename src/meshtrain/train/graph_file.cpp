#include "meshtrain/train/graph_file.h"

#include <cstring>

#include <fmt/format.h>

#include "meshtrain/base/error.h"
#include "meshtrain/train/checkpoint.h"

namespace mt {

namespace {

constexpr const char* kFormatKey = "graph_format";

template <class T>
Tensor vec_tensor(const std::vector<T>& v, DType t) {
  Tensor x = Tensor::empty(Shape{static_cast<int64_t>(v.size())}, t);
  if (!v.empty()) std::memcpy(x.raw(), v.data(), v.size() * sizeof(T));
  return x;
}

template <class T>
std::vector<T> tensor_vec(const std::string& path, const Tensor& t, const char* field, DType want) {
  if (t.dtype() != want || t.rank() != 1) {
    throw CheckpointError(fmt::format("graph file '{}': field '{}': is {}, expected a {} vector",
                                      path, field, t.desc(), dtype_name(want)));
  }
  std::vector<T> v(static_cast<size_t>(t.numel()));
  if (!v.empty()) std::memcpy(v.data(), t.raw(), v.size() * sizeof(T));
  return v;
}

}  // namespace

void save_graph(const std::string& path, const GraphData& g) {
  std::map<std::string, Tensor> t;
  t["row_ptr"] = vec_tensor(g.adj.row_ptr, DType::i32);
  t["col_idx"] = vec_tensor(g.adj.col_idx, DType::i32);
  t["features"] = g.features;
  t["labels"] = vec_tensor(g.labels, DType::i32);
  t["train_mask"] = vec_tensor(g.train_mask, DType::u8);
  t["val_mask"] = vec_tensor(g.val_mask, DType::u8);
  t["test_mask"] = vec_tensor(g.test_mask, DType::u8);
  save_checkpoint(path, t,
                  {{kFormatKey, "1"}, {"classes", std::to_string(g.classes)}, {"name", g.name}});
}

GraphData load_graph(const std::string& path) {
  CheckpointReader r(path);
  const auto& md = r.metadata();
  auto meta = [&](const char* key) -> const std::string& {
    auto it = md.find(key);
    if (it == md.end()) {
      throw CheckpointError(fmt::format(
          "graph file '{}': metadata '{}' is missing (not a meshtrain graph file?)", path, key));
    }
    return it->second;
  };
  if (meta(kFormatKey) != "1") {
    throw CheckpointError(fmt::format("graph file '{}': format version '{}' is not supported (1)",
                                      path, meta(kFormatKey)));
  }
  GraphData g;
  g.name = md.count("name") ? md.at("name") : path;
  try {
    g.classes = std::stoll(meta("classes"));
  } catch (const std::logic_error&) {
    throw CheckpointError(fmt::format("graph file '{}': metadata 'classes' is '{}', not an integer",
                                      path, meta("classes")));
  }
  g.adj.row_ptr = tensor_vec<int32_t>(path, r.read("row_ptr"), "row_ptr", DType::i32);
  g.adj.col_idx = tensor_vec<int32_t>(path, r.read("col_idx"), "col_idx", DType::i32);
  if (g.adj.row_ptr.empty()) {
    throw ConfigError(
        fmt::format("graph file '{}': field 'row_ptr': is empty (needs vertices + 1 "
                    "entries)",
                    path));
  }
  g.adj.rows = g.adj.cols = static_cast<int64_t>(g.adj.row_ptr.size()) - 1;
  g.features = r.read("features");
  g.labels = tensor_vec<int32_t>(path, r.read("labels"), "labels", DType::i32);
  g.train_mask = tensor_vec<uint8_t>(path, r.read("train_mask"), "train_mask", DType::u8);
  g.val_mask = tensor_vec<uint8_t>(path, r.read("val_mask"), "val_mask", DType::u8);
  g.test_mask = tensor_vec<uint8_t>(path, r.read("test_mask"), "test_mask", DType::u8);
  try {
    g.validate(fmt::format("graph file '{}'", path));
  } catch (const ConfigError& e) {
    throw FileError(e.what());  // a malformed file (docs/errors.md)
  }
  return g;
}

}  // namespace mt
