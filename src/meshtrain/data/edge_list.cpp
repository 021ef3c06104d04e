#include "meshtrain/data/edge_list.h"

#include <fmt/format.h>

#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "meshtrain/base/error.h"

namespace mt {

GraphData read_edge_list(const std::string& path, const EdgeListOptions& o) {
  std::ifstream in(path);
  if (!in) throw FileError(fmt::format("edge list {}: cannot open it", path));
  auto bad = [&](int64_t line, const std::string& what) {
    return ConfigError(fmt::format("edge list {}:{}: {}", path, line, what));
  };
  int64_t n = -1, classes = -1, line_no = 0;
  std::vector<int32_t> labels;
  std::vector<std::pair<int32_t, int32_t>> edges;
  std::vector<std::vector<float>> features;
  int64_t feature_width = -1, with_features = 0;
  // A vertex id in [0, n) at `line`, or the error naming it.
  auto vertex = [&](const std::string& word, int64_t line, const char* field) {
    int64_t v = -1;
    try {
      size_t used = 0;
      v = std::stoll(word, &used);
      if (used != word.size()) v = -1;
    } catch (const std::exception&) {
      v = -1;
    }
    if (v < 0 || v >= n) {
      throw bad(line, fmt::format("{} '{}' is not a vertex id in [0, {})", field, word, n));
    }
    return static_cast<int32_t>(v);
  };
  std::string text;
  while (std::getline(in, text)) {
    ++line_no;
    if (const auto hash = text.find('#'); hash != std::string::npos) text.resize(hash);
    std::istringstream words(text);
    std::string key;
    if (!(words >> key)) continue;
    if (key == "vertices") {
      std::string c;
      if (n >= 0) throw bad(line_no, "a second 'vertices' line");
      if (!(words >> n >> c >> classes) || c != "classes" || n < 2 || n > (int64_t{1} << 30) ||
          classes < 1 || classes > n) {
        throw bad(line_no, "expected 'vertices N classes C' with 2 <= N <= 2^30 and 1 <= C <= N");
      }
      labels.assign(static_cast<size_t>(n), -1);
      features.resize(static_cast<size_t>(n));
      continue;
    }
    if (n < 0) throw bad(line_no, fmt::format("'{}' before the 'vertices N classes C' line", key));
    std::string a, b;
    if (key == "label") {
      int64_t c = -1;
      if (!(words >> a >> c)) throw bad(line_no, "expected 'label VERTEX CLASS'");
      const int32_t v = vertex(a, line_no, "vertex");
      if (c < 0 || c >= classes) {
        throw bad(line_no, fmt::format("class {} outside [0, {})", c, classes));
      }
      if (labels[static_cast<size_t>(v)] >= 0) {
        throw bad(line_no, fmt::format("vertex {} is labelled twice", v));
      }
      labels[static_cast<size_t>(v)] = static_cast<int32_t>(c);
    } else if (key == "edge") {
      if (!(words >> a >> b)) throw bad(line_no, "expected 'edge U V'");
      edges.emplace_back(vertex(a, line_no, "endpoint"), vertex(b, line_no, "endpoint"));
    } else if (key == "feature") {
      if (!(words >> a)) throw bad(line_no, "expected 'feature VERTEX X1 X2 ...'");
      const int32_t v = vertex(a, line_no, "vertex");
      std::vector<float> row;
      float x = 0;
      while (words >> x) row.push_back(x);
      if (!words.eof()) throw bad(line_no, "a feature value that is not a number");
      if (row.empty()) throw bad(line_no, "a feature row without values");
      if (feature_width >= 0 && static_cast<int64_t>(row.size()) != feature_width) {
        throw bad(line_no, fmt::format("{} feature values, the rows before have {}", row.size(),
                                       feature_width));
      }
      if (!features[static_cast<size_t>(v)].empty()) {
        throw bad(line_no, fmt::format("vertex {} has a second feature row", v));
      }
      feature_width = static_cast<int64_t>(row.size());
      features[static_cast<size_t>(v)] = std::move(row);
      ++with_features;
    } else {
      throw bad(line_no, fmt::format("unknown keyword '{}' (expected vertices, label, edge or "
                                     "feature)",
                                     key));
    }
  }
  if (n < 0) throw bad(line_no, "no 'vertices N classes C' line");
  for (int64_t v = 0; v < n; ++v) {
    if (labels[static_cast<size_t>(v)] < 0) {
      throw ConfigError(
          fmt::format("edge list {}: vertex {} has no 'label' line (every vertex of "
                      "the {} needs one)",
                      path, v, n));
    }
  }
  if (with_features > 0 && with_features < n) {
    throw ConfigError(
        fmt::format("edge list {}: {} of {} vertices have a 'feature' row (all or none)", path,
                    with_features, n));
  }
  GraphData g;
  g.name = fmt::format("edge list {}", path);
  g.adj = simple_undirected(n, edges);
  g.labels = std::move(labels);
  g.classes = classes;
  if (with_features == 0) {
    g.features = Tensor::zeros({n, n}, DType::f32);
    float* f = g.features.data<float>();
    for (int64_t v = 0; v < n; ++v) f[v * n + v] = 1.0F;
  } else {
    g.features = Tensor::empty({n, feature_width}, DType::f32);
    float* f = g.features.data<float>();
    for (int64_t v = 0; v < n; ++v) {
      const auto& row = features[static_cast<size_t>(v)];
      std::copy(row.begin(), row.end(), f + v * feature_width);
    }
  }
  random_split(g, o.train_fraction, o.val_fraction, o.seed, "edge list");
  g.validate(g.name);
  return g;
}

}  // namespace mt
