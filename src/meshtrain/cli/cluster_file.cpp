#include "meshtrain/cli/cluster_file.h"

#include <fstream>
#include <set>
#include <sstream>

#include <toml++/toml.h>

#include "meshtrain/base/error.h"

namespace mt {

namespace {

class Reader {
 public:
  explicit Reader(std::string source) : source_(std::move(source)) {}

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    throw ConfigError(fmt::format("cluster file {}: {}: {}", source_, key, what));
  }

  static std::string show(const toml::node& n) {
    std::ostringstream s;
    if (n.is_string()) {
      s << "string \"" << *n.value<std::string>() << "\"";
    } else if (n.is_table()) {
      s << "a table";
    } else if (n.is_array()) {
      s << "an array";
    } else if (n.is_integer()) {
      s << *n.value<int64_t>();
    } else if (n.is_floating_point()) {
      s << *n.value<double>();
    } else if (n.is_boolean()) {
      s << (*n.value<bool>() ? "true" : "false");
    } else {
      s << "a date or time";
    }
    return s.str();
  }

  // Keys of `t` must be among `known`.
  void only(const toml::table& t, const std::string& prefix,
            std::initializer_list<std::string_view> known) const {
    for (const auto& [k, v] : t) {
      bool ok = false;
      for (std::string_view w : known) ok = ok || k.str() == w;
      if (!ok) {
        std::string list;
        for (std::string_view w : known) list += fmt::format("{}{}", list.empty() ? "" : ", ", w);
        fail(prefix + std::string(k.str()), fmt::format("unknown key (expected one of: {})", list));
      }
    }
  }

  double number(const toml::node& n, const std::string& key, double lo, bool lo_open) const {
    std::optional<double> v = n.value<double>();
    if (!v || n.is_boolean() || n.is_string()) {
      fail(key, fmt::format("expected a number, got {}", show(n)));
    }
    if (lo_open ? !(*v > lo) : !(*v >= lo)) {
      fail(key, fmt::format("expected a number {} {}, got {}", lo_open ? ">" : ">=", lo, show(n)));
    }
    return *v;
  }

  int64_t integer(const toml::node& n, const std::string& key, int64_t lo) const {
    if (!n.is_integer()) fail(key, fmt::format("expected an integer, got {}", show(n)));
    const int64_t v = *n.value<int64_t>();
    if (v < lo) fail(key, fmt::format("expected an integer >= {}, got {}", lo, v));
    return v;
  }

  bool boolean(const toml::node& n, const std::string& key) const {
    if (!n.is_boolean()) fail(key, fmt::format("expected true or false, got {}", show(n)));
    return *n.value<bool>();
  }

  std::string string(const toml::node& n, const std::string& key) const {
    if (!n.is_string()) fail(key, fmt::format("expected a string, got {}", show(n)));
    return *n.value<std::string>();
  }

  const toml::table& table(const toml::node& n, const std::string& key) const {
    if (!n.is_table()) fail(key, fmt::format("expected a table, got {}", show(n)));
    return *n.as_table();
  }

  const toml::array& array(const toml::node& n, const std::string& key) const {
    if (!n.is_array()) fail(key, fmt::format("expected an array, got {}", show(n)));
    return *n.as_array();
  }

  LinkSpec link(const toml::table& t, const std::string& prefix,
                std::initializer_list<std::string_view> extra = {}) const {
    std::vector<std::string_view> known = {"latency_ms", "bandwidth_gbit_s"};
    known.insert(known.end(), extra.begin(), extra.end());
    for (const auto& [k, v] : t) {
      if (std::find(known.begin(), known.end(), k.str()) == known.end()) {
        fail(prefix + std::string(k.str()), "unknown key (expected latency_ms, bandwidth_gbit_s)");
      }
    }
    LinkSpec l;
    if (const toml::node* n = t.get("latency_ms")) {
      l.latency_s = number(*n, prefix + "latency_ms", 0, false) * 1e-3;
    }
    if (const toml::node* n = t.get("bandwidth_gbit_s")) {
      l.bandwidth_bytes_s = number(*n, prefix + "bandwidth_gbit_s", 0, true) * 1e9 / 8;
    }
    return l;
  }

 private:
  std::string source_;
};

}  // namespace

ClusterFile parse_cluster_file(const std::string& text, const std::string& source) {
  Reader rd(source);
  toml::table root;
  try {
    root = toml::parse(text, std::string_view(source));
  } catch (const toml::parse_error& e) {
    throw ConfigError(fmt::format("cluster file {}: line {}, column {}: {}", source,
                                  e.source().begin.line, e.source().begin.column, e.description()));
  }
  ClusterFile f;
  f.path = source;
  rd.only(root, "",
          {"node_size", "nodes", "sites", "links", "link_pairs", "ranks", "devices", "device",
           "collectives"});
  if (const toml::node* n = root.get("node_size")) {
    f.node_size = static_cast<int>(rd.integer(*n, "node_size", 1));
  }
  if (const toml::node* n = root.get("devices")) {
    for (const auto& [name, v] : rd.table(*n, "devices")) {
      const std::string p = fmt::format("devices.{}.", name.str());
      const toml::table& d = rd.table(v, p.substr(0, p.size() - 1));
      rd.only(d, p,
              {"peak_tflops", "peak_tflops_f32", "peak_tflops_tf32", "peak_tflops_bf16",
               "memory_gb", "memory_bandwidth_gb_s", "efficiency", "default_efficiency", "source",
               "runtime", "compute_units", "matmul_tile", "op_overhead_us", "compute_jitter",
               "weight_bandwidth_gb_s", "cache_mb"});
      ClusterFile::Device dev;
      if (d.get("peak_tflops") && d.get("peak_tflops_f32")) {
        rd.fail(p + "peak_tflops_f32", "give peak_tflops or peak_tflops_f32 (the same), not both");
      }
      for (const char* key : {"peak_tflops", "peak_tflops_f32"}) {
        if (const toml::node* x = d.get(key)) dev.peak_tflops = rd.number(*x, p + key, 0, true);
      }
      if (const toml::node* x = d.get("peak_tflops_tf32")) {
        dev.peak_tflops_tf32 = rd.number(*x, p + "peak_tflops_tf32", 0, true);
      }
      if (const toml::node* x = d.get("peak_tflops_bf16")) {
        dev.peak_tflops_bf16 = rd.number(*x, p + "peak_tflops_bf16", 0, true);
      }
      if (const toml::node* x = d.get("memory_gb")) {
        dev.memory_gb = rd.number(*x, p + "memory_gb", 0, true);
      }
      if (const toml::node* x = d.get("memory_bandwidth_gb_s")) {
        dev.memory_bandwidth_gb_s = rd.number(*x, p + "memory_bandwidth_gb_s", 0, true);
      }
      if (const toml::node* x = d.get("weight_bandwidth_gb_s")) {
        dev.weight_bandwidth_gb_s = rd.number(*x, p + "weight_bandwidth_gb_s", 0, true);
      }
      if (const toml::node* x = d.get("cache_mb")) {
        dev.cache_mb = rd.number(*x, p + "cache_mb", 0, false);
      }
      if (const toml::node* x = d.get("compute_jitter")) {
        dev.compute_jitter = rd.number(*x, p + "compute_jitter", 0, false);
      }
      if (const toml::node* x = d.get("op_overhead_us")) {
        dev.op_overhead_us = rd.number(*x, p + "op_overhead_us", 0, false);
      }
      auto fraction = [&](const toml::node& x, const std::string& key) {
        const double e = rd.number(x, key, 0, true);
        if (e > 1) rd.fail(key, fmt::format("expected a fraction of peak in (0, 1], got {}", e));
        return e;
      };
      if (const toml::node* x = d.get("efficiency")) {
        for (const auto& [op, e] : rd.table(*x, p + "efficiency")) {
          dev.efficiency[std::string(op.str())] =
              fraction(e, fmt::format("{}efficiency.{}", p, op.str()));
        }
      }
      if (const toml::node* x = d.get("default_efficiency")) {
        dev.default_efficiency = fraction(*x, p + "default_efficiency");
      }
      if (const toml::node* x = d.get("source")) dev.source = rd.string(*x, p + "source");
      if (const toml::node* x = d.get("compute_units")) {
        dev.compute_units = rd.integer(*x, p + "compute_units", 1);
      }
      if (const toml::node* x = d.get("matmul_tile")) {
        const toml::array& a = rd.array(*x, p + "matmul_tile");
        if (a.size() != 2) {
          rd.fail(p + "matmul_tile",
                  fmt::format("expected [rows, columns] (2 integers), got {} entries", a.size()));
        }
        for (size_t i = 0; i < 2; ++i) {
          dev.matmul_tile[i] = rd.integer(*a.get(i), fmt::format("{}matmul_tile[{}]", p, i), 1);
        }
      }
      if ((dev.compute_units > 0) != (dev.matmul_tile[0] > 0)) {
        rd.fail(p + (dev.compute_units > 0 ? "matmul_tile" : "compute_units"),
                "missing: compute_units and matmul_tile are given together (matmul wave "
                "quantization needs both)");
      }
      if (const toml::node* x = d.get("runtime")) {
        const std::string q = p + "runtime.";
        const toml::table& rt = rd.table(*x, p + "runtime");
        rd.only(rt, q,
                {"half_activations", "fused_elementwise", "attention_dropout", "blocking_p2p",
                 "source"});
        if (const toml::node* y = rt.get("half_activations")) {
          dev.half_activations = rd.boolean(*y, q + "half_activations");
        }
        if (const toml::node* y = rt.get("fused_elementwise")) {
          dev.fused_elementwise = rd.boolean(*y, q + "fused_elementwise");
        }
        if (const toml::node* y = rt.get("attention_dropout")) {
          dev.attention_dropout = rd.boolean(*y, q + "attention_dropout");
        }
        if (const toml::node* y = rt.get("blocking_p2p")) {
          dev.blocking_p2p = rd.boolean(*y, q + "blocking_p2p");
        }
        if (const toml::node* y = rt.get("source"))
          dev.runtime_source = rd.string(*y, q + "source");
        if ((dev.half_activations || dev.fused_elementwise || dev.attention_dropout ||
             dev.blocking_p2p) &&
            dev.runtime_source.empty()) {
          rd.fail(q + "source",
                  "missing: say which runtime these settings model and where they come from");
        }
      }
      f.devices[std::string(name.str())] = dev;
    }
  }
  auto known_device = [&](const std::string& key, const std::string& name) {
    if (f.devices.count(name)) return;
    std::string list;
    for (const auto& [k, d] : f.devices)
      list += fmt::format("{}\"{}\"", list.empty() ? "" : ", ", k);
    rd.fail(key, fmt::format("unknown device kind \"{}\" (expected a [devices.{}] table; defined: "
                             "{})",
                             name, name, list.empty() ? "none" : list));
  };
  if (const toml::node* n = root.get("device")) {
    f.device = rd.string(*n, "device");
    known_device("device", f.device);
  }
  if (const toml::node* n = root.get("collectives")) {
    for (const auto& [alg, v] : rd.table(*n, "collectives")) {
      const std::string pa = fmt::format("collectives.{}", alg.str());
      for (const auto& [kind, w] : rd.table(v, pa)) {
        const std::string k(kind.str());
        const std::string pk = fmt::format("{}.{}", pa, k);
        if (k != "self" && k != "intra_node" && k != "inter_node" && k != "inter_site") {
          rd.fail(pk, "unknown link kind (expected intra_node, inter_node, inter_site, self)");
        }
        f.collectives[fmt::format("{}/{}", alg.str(), k)] = rd.link(rd.table(w, pk), pk + ".");
      }
    }
  }
  std::set<std::string> names;
  // nodes given with count > 1: the name -> the nodes it expands to (sites may name it).
  std::map<std::string, std::vector<std::string>> groups;
  if (const toml::node* n = root.get("nodes")) {
    if (f.node_size > 0) {
      rd.fail("nodes", "give either node_size or [[nodes]], not both");
    }
    const toml::array& arr = rd.array(*n, "nodes");
    std::map<int64_t, std::string> owner;
    int next_rank = 0;  // where the next ranks_per_node node starts
    for (size_t i = 0; i < arr.size(); ++i) {
      const std::string p = fmt::format("nodes[{}].", i);
      const toml::table& t = rd.table(arr[i], p.substr(0, p.size() - 1));
      rd.only(t, p, {"name", "ranks", "device", "count", "ranks_per_node", "cores"});
      const std::string base =
          t.get("name") ? rd.string(*t.get("name"), p + "name") : fmt::format("node{}", i);
      std::string device;
      if (const toml::node* d = t.get("device")) {
        device = rd.string(*d, p + "device");
        known_device(p + "device", device);
      }
      const int cores =
          t.get("cores") ? static_cast<int>(rd.integer(*t.get("cores"), p + "cores", 1)) : 0;
      auto add = [&](ClusterFile::Node node, const std::string& key) {
        if (!names.insert(node.name).second) {
          rd.fail(key, fmt::format("node \"{}\" is defined twice", node.name));
        }
        node.device = device;
        node.cores = cores;
        f.nodes.push_back(std::move(node));
      };
      const toml::node* rn = t.get("ranks");
      const toml::node* per = t.get("ranks_per_node");
      if (rn != nullptr && (per != nullptr || t.get("count"))) {
        rd.fail(p + "ranks", "give ranks, or count and ranks_per_node, not both");
      }
      if (rn == nullptr) {
        if (per == nullptr) {
          rd.fail(p + "ranks",
                  "required key is missing (the node's ranks, or ranks_per_node [and count])");
        }
        const int k = static_cast<int>(rd.integer(*per, p + "ranks_per_node", 1));
        const int count =
            t.get("count") ? static_cast<int>(rd.integer(*t.get("count"), p + "count", 1)) : 1;
        if (count > 1) {
          if (names.count(base) || groups.count(base)) {
            rd.fail(p + "name", fmt::format("node \"{}\" is defined twice", base));
          }
          groups[base] = {};
        }
        for (int c = 0; c < count; ++c) {
          ClusterFile::Node node;
          node.name = count > 1 ? fmt::format("{}-{}", base, c) : base;
          for (int j = 0; j < k; ++j) {
            const int r = next_rank++;
            if (auto [it, added] = owner.try_emplace(r, node.name); !added) {
              rd.fail(p + "ranks_per_node",
                      fmt::format("rank {} is already on node \"{}\" (a rank belongs to one "
                                  "node; ranks_per_node numbers ranks on from the last such node)",
                                  r, it->second));
            }
            node.ranks.push_back(r);
          }
          if (count > 1) groups[base].push_back(node.name);
          add(std::move(node), p + "name");
        }
        continue;
      }
      ClusterFile::Node node;
      node.name = base;
      const toml::array& ranks = rd.array(*rn, p + "ranks");
      if (ranks.empty()) rd.fail(p + "ranks", "expected at least one rank, got []");
      for (size_t j = 0; j < ranks.size(); ++j) {
        const int64_t r = rd.integer(ranks[j], fmt::format("{}ranks[{}]", p, j), 0);
        if (auto [it, added] = owner.try_emplace(r, node.name); !added) {
          rd.fail(p + "ranks", fmt::format("rank {} is already on node \"{}\" (a rank belongs to "
                                           "one node)",
                                           r, it->second));
        }
        node.ranks.push_back(static_cast<int>(r));
      }
      add(std::move(node), p + "name");
    }
  } else if (f.node_size == 0) {
    rd.fail("nodes", "required: either node_size = N or [[nodes]] entries with their ranks");
  }
  auto known_node = [&](const std::string& key, const std::string& name) {
    if (f.node_size > 0) {
      // node0, node1, ...: the names node_size gives; their count depends on the world.
      if (name.rfind("node", 0) == 0 && name.size() > 4 &&
          name.find_first_not_of("0123456789", 4) == std::string::npos) {
        return;
      }
      rd.fail(key,
              fmt::format("no node \"{}\" (with node_size the nodes are node0, node1, ...)", name));
    }
    if (!names.count(name) && !groups.count(name)) {
      std::string list;
      for (const auto& n : f.nodes)
        list += fmt::format("{}\"{}\"", list.empty() ? "" : ", ", n.name);
      rd.fail(key, fmt::format("no node \"{}\" (the nodes are {})", name, list));
    }
  };
  if (const toml::node* n = root.get("sites")) {
    const toml::array& arr = rd.array(*n, "sites");
    std::map<std::string, std::string> site_of;
    for (size_t i = 0; i < arr.size(); ++i) {
      const std::string p = fmt::format("sites[{}].", i);
      const toml::table& t = rd.table(arr[i], p.substr(0, p.size() - 1));
      rd.only(t, p, {"name", "nodes"});
      ClusterFile::Site site;
      site.name = t.get("name") ? rd.string(*t.get("name"), p + "name") : fmt::format("site{}", i);
      const toml::node* nn = t.get("nodes");
      if (nn == nullptr) rd.fail(p + "nodes", "required key is missing (the site's node names)");
      const toml::array& nodes = rd.array(*nn, p + "nodes");
      for (size_t j = 0; j < nodes.size(); ++j) {
        const std::string key = fmt::format("{}nodes[{}]", p, j);
        const std::string name = rd.string(nodes[j], key);
        known_node(key, name);
        const auto g = groups.find(name);
        for (const std::string& one :
             g != groups.end() ? g->second : std::vector<std::string>{name}) {
          if (auto [it, added] = site_of.try_emplace(one, site.name); !added) {
            rd.fail(key, fmt::format("node \"{}\" is already in site \"{}\"", one, it->second));
          }
          site.nodes.push_back(one);
        }
      }
      f.sites.push_back(std::move(site));
    }
  }
  if (const toml::node* n = root.get("links")) {
    const toml::table& t = rd.table(*n, "links");
    rd.only(t, "links.", {"intra_node", "inter_node", "inter_site", "sharing"});
    if (const toml::node* x = t.get("sharing")) {
      const std::string v = rd.string(*x, "links.sharing");
      if (v == "node_pair") {
        f.sharing = LinkSharing::node_pair;
      } else if (v != "rank_pair") {
        rd.fail("links.sharing",
                fmt::format("expected \"rank_pair\" or \"node_pair\", got \"{}\"", v));
      }
    }
    if (const toml::node* x = t.get("intra_node")) {
      f.intra_node = rd.link(rd.table(*x, "links.intra_node"), "links.intra_node.");
    }
    if (const toml::node* x = t.get("inter_node")) {
      f.inter_node = rd.link(rd.table(*x, "links.inter_node"), "links.inter_node.");
    }
    if (const toml::node* x = t.get("inter_site")) {
      f.inter_site = rd.link(rd.table(*x, "links.inter_site"), "links.inter_site.");
    }
  }
  if (const toml::node* n = root.get("link_pairs")) {
    const toml::array& arr = rd.array(*n, "link_pairs");
    for (size_t i = 0; i < arr.size(); ++i) {
      const std::string p = fmt::format("link_pairs[{}].", i);
      const toml::table& t = rd.table(arr[i], p.substr(0, p.size() - 1));
      const toml::node* nn = t.get("nodes");
      if (nn == nullptr) rd.fail(p + "nodes", "required key is missing (two node names)");
      const toml::array& two = rd.array(*nn, p + "nodes");
      if (two.size() != 2) {
        rd.fail(p + "nodes", fmt::format("expected two node names, got {}", two.size()));
      }
      ClusterFile::Pair pair;
      pair.a = rd.string(two[0], p + "nodes[0]");
      pair.b = rd.string(two[1], p + "nodes[1]");
      known_node(p + "nodes[0]", pair.a);
      known_node(p + "nodes[1]", pair.b);
      for (const auto& [key, name] :
           {std::pair{p + "nodes[0]", pair.a}, {p + "nodes[1]", pair.b}}) {
        if (groups.count(name)) {
          rd.fail(key, fmt::format("\"{}\" names {} nodes (count); a link pair joins two nodes "
                                   "(\"{}-0\", ...)",
                                   name, groups.at(name).size(), name));
        }
      }
      if (pair.a == pair.b) {
        rd.fail(p + "nodes",
                fmt::format("a link joins two different nodes, got \"{}\" twice", pair.a));
      }
      pair.link = rd.link(t, p, {"nodes"});
      f.pairs.push_back(std::move(pair));
    }
  }
  if (const toml::node* n = root.get("ranks")) {
    const toml::table& t = rd.table(*n, "ranks");
    rd.only(t, "ranks.", {"slowdown"});
    if (const toml::node* s = t.get("slowdown")) {
      const toml::array& arr = rd.array(*s, "ranks.slowdown");
      for (size_t i = 0; i < arr.size(); ++i) {
        f.slowdown.push_back(rd.number(arr[i], fmt::format("ranks.slowdown[{}]", i), 1, false));
      }
    }
  }
  return f;
}

ClusterFile read_cluster_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw FileError(fmt::format("cluster file {}: cannot read it (dist.cluster names it): {}", path,
                                std::strerror(errno)));
  }
  std::ostringstream s;
  s << in.rdbuf();
  return parse_cluster_file(s.str(), path);
}

ClusterLayout resolve_cluster(const ClusterFile& f, int world) {
  Reader rd(f.path);
  ClusterLayout l;
  l.source = fmt::format("file {}", f.path);
  if (f.node_size > 0) {
    l = ClusterLayout::by_node_size(world, f.node_size);
    l.source = fmt::format("file {}", f.path);
  } else {
    l.node_of.assign(static_cast<size_t>(world), -1);
    for (size_t k = 0; k < f.nodes.size(); ++k) {
      for (int r : f.nodes[k].ranks) {
        if (r >= world) {
          rd.fail(fmt::format("nodes[{}].ranks", k),
                  fmt::format("rank {} is not in the job, which has {} rank{} (0..{})", r, world,
                              world == 1 ? "" : "s", world - 1));
        }
        l.node_of[static_cast<size_t>(r)] = static_cast<int>(k);
      }
      l.node_names.push_back(f.nodes[k].name);
    }
    std::vector<int> missing;
    for (int r = 0; r < world; ++r) {
      if (l.node_of[static_cast<size_t>(r)] < 0) missing.push_back(r);
    }
    if (!missing.empty()) {
      rd.fail("nodes", fmt::format("the nodes do not cover the job's {} ranks: rank{} {} {} on "
                                   "no node (expected every rank 0..{} on exactly one node)",
                                   world, missing.size() == 1 ? "" : "s", fmt::join(missing, ", "),
                                   missing.size() == 1 ? "is" : "are", world - 1));
    }
    l.site_of_node.assign(f.nodes.size(), 0);
  }
  auto index_of = [&](const std::string& key, const std::string& name) {
    const auto it = std::find(l.node_names.begin(), l.node_names.end(), name);
    if (it == l.node_names.end()) {
      rd.fail(key, fmt::format("no node \"{}\" in a job of {} ranks (nodes: {})", name, world,
                               fmt::join(l.node_names, ", ")));
    }
    return static_cast<int>(it - l.node_names.begin());
  };
  // Nodes outside every [[sites]] entry share one more site.
  if (!f.sites.empty()) {
    std::vector<int> site(l.node_names.size(), static_cast<int>(f.sites.size()));
    for (size_t s = 0; s < f.sites.size(); ++s) {
      for (size_t j = 0; j < f.sites[s].nodes.size(); ++j) {
        site[static_cast<size_t>(index_of(fmt::format("sites[{}].nodes[{}]", s, j),
                                          f.sites[s].nodes[j]))] = static_cast<int>(s);
      }
    }
    // Renumber densely (a site may have no node in this job).
    std::map<int, int> dense;
    for (int& s : site) s = dense.try_emplace(s, static_cast<int>(dense.size())).first->second;
    l.site_of_node = site;
  }
  l.sharing = f.sharing;
  l.intra_node = f.intra_node;
  l.inter_node = f.inter_node;
  l.inter_site = f.inter_site;
  for (size_t i = 0; i < f.pairs.size(); ++i) {
    const int a = index_of(fmt::format("link_pairs[{}].nodes[0]", i), f.pairs[i].a);
    const int b = index_of(fmt::format("link_pairs[{}].nodes[1]", i), f.pairs[i].b);
    l.node_pairs[{std::min(a, b), std::max(a, b)}] = f.pairs[i].link;
  }
  if (!f.slowdown.empty() && static_cast<int>(f.slowdown.size()) != world) {
    rd.fail("ranks.slowdown",
            fmt::format("{} factors given for {} rank{} (expected one factor per rank)",
                        f.slowdown.size(), world, world == 1 ? "" : "s"));
  }
  l.validate();
  return l;
}

int ClusterFile::ranks() const {
  if (node_size > 0) return 0;
  int n = 0;
  for (const Node& node : nodes) n += static_cast<int>(node.ranks.size());
  return n;
}

planner::ClusterModel cluster_model(const ClusterFile& f, int world) {
  Reader rd(f.path);
  if (world <= 0) {
    world = f.ranks();
    if (world == 0) {
      rd.fail("node_size",
              "the file gives a node size, not its ranks: the planner needs the number of ranks "
              "(--nproc), or [[nodes]] with ranks or ranks_per_node");
    }
  }
  planner::ClusterModel m;
  m.source = f.path;
  m.layout = resolve_cluster(f, world);
  std::map<std::string, int> index;
  for (const auto& [name, d] : f.devices) {
    const std::string p = fmt::format("devices.{}.", name);
    planner::DeviceKind k;
    k.name = name;
    k.peak_flops_f32 = d.peak_tflops_tf32.value_or(d.peak_tflops.value_or(0)) * 1e12;
    k.peak_flops_bf16 = d.peak_tflops_bf16.value_or(0) * 1e12;
    k.memory_bytes = d.memory_gb.value_or(0) * 1e9;
    k.memory_bandwidth = d.memory_bandwidth_gb_s.value_or(0) * 1e9;
    k.op_overhead_s = d.op_overhead_us * 1e-6;
    k.weight_bandwidth = d.weight_bandwidth_gb_s * 1e9;
    k.cache_bytes = d.cache_mb * 1e6;
    k.compute_jitter = d.compute_jitter;
    k.efficiency = d.efficiency;
    if (d.default_efficiency) k.default_efficiency = *d.default_efficiency;
    k.source = d.source;
    k.compute_units = d.compute_units;
    k.matmul_tile = d.matmul_tile;
    k.half_activations = d.half_activations;
    k.fused_elementwise = d.fused_elementwise;
    k.attention_dropout = d.attention_dropout;
    k.blocking_p2p = d.blocking_p2p;
    k.runtime_source = d.runtime_source;
    index[name] = static_cast<int>(m.kinds.size());
    m.kinds.push_back(std::move(k));
  }
  // Each rank's kind: its node's, else the file's `device`, else the only one.
  std::vector<std::string> node_device;
  if (f.node_size > 0) {
    node_device.assign(m.layout.node_names.size(), "");
  } else {
    for (const auto& n : f.nodes) node_device.push_back(n.device);
  }
  m.kind_of.assign(static_cast<size_t>(world), -1);
  std::set<int> used;
  for (int r = 0; r < world; ++r) {
    const size_t node = static_cast<size_t>(m.layout.node_of[static_cast<size_t>(r)]);
    std::string name = node_device[node];
    const std::string key =
        f.node_size > 0 ? std::string("device") : fmt::format("nodes[{}].device", node);
    if (name.empty()) name = f.device;
    if (name.empty() && f.devices.size() == 1) name = f.devices.begin()->first;
    if (name.empty()) {
      rd.fail(key, fmt::format("node \"{}\" has no device kind and the file {} (the planner needs "
                               "each rank's device: give the node a device, or a top-level "
                               "device = \"NAME\")",
                               m.layout.node_names[node],
                               f.devices.empty() ? "defines no [devices.NAME] table"
                                                 : "defines several kinds"));
    }
    m.kind_of[static_cast<size_t>(r)] = index.at(name);
    used.insert(index.at(name));
  }
  for (int k : used) {
    const ClusterFile::Device& d = f.devices.at(m.kinds[static_cast<size_t>(k)].name);
    const std::string p = fmt::format("devices.{}.", m.kinds[static_cast<size_t>(k)].name);
    if (!d.peak_tflops && !d.peak_tflops_tf32) {
      rd.fail(p + "peak_tflops_f32",
              "required by the planner (the device's dense f32 peak, TFLOP/s), missing");
    }
    if (!d.memory_gb) {
      rd.fail(p + "memory_gb", "required by the planner (the device's memory, GB), missing");
    }
  }
  m.slowdown = f.slowdown;
  // Nodes whose ranks outnumber their cores: each rank computes on
  // cores / ranks of a core (the ranks time-share them).
  if (f.node_size == 0) {
    std::vector<int> on_node(m.layout.node_names.size(), 0);
    for (int r = 0; r < world; ++r)
      ++on_node[static_cast<size_t>(m.layout.node_of[static_cast<size_t>(r)])];
    for (size_t i = 0; i < f.nodes.size() && i < on_node.size(); ++i) {
      const int cores = f.nodes[i].cores;
      if (cores > 0 && on_node[i] > cores) {
        m.node_core_sharing.resize(on_node.size(), 1.0);
        m.node_core_sharing[i] = static_cast<double>(on_node[i]) / cores;
      }
    }
  }
  m.algorithm_links = f.collectives;
  return m;
}

}  // namespace mt
