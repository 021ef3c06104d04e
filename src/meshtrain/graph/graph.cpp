#include "meshtrain/graph/graph.h"

#include "meshtrain/base/error.h"
#include "meshtrain/graph/op_registry.h"

namespace mt {

namespace {

const char* attr_type_name(const AttrValue& v) {
  switch (v.index()) {
    case 0:
      return "int";
    case 1:
      return "float";
    case 2:
      return "bool";
    case 3:
      return "int list";
    default:
      return "string";
  }
}

template <class T>
const T& get_attr(const std::map<std::string, AttrValue>& m, const std::string& key,
                  const char* want) {
  auto it = m.find(key);
  if (it == m.end()) {
    throw InternalError(fmt::format("attribute '{}' is missing (expected {})", key, want));
  }
  const T* p = std::get_if<T>(&it->second);
  if (p == nullptr) {
    throw InternalError(
        fmt::format("attribute '{}': expected {}, got {}", key, want, attr_type_name(it->second)));
  }
  return *p;
}

}  // namespace

int64_t Attrs::i(const std::string& key) const {
  return get_attr<int64_t>(values_, key, "int");
}
double Attrs::f(const std::string& key) const {
  return get_attr<double>(values_, key, "float");
}
bool Attrs::b(const std::string& key) const {
  return get_attr<bool>(values_, key, "bool");
}
const std::vector<int64_t>& Attrs::ints(const std::string& key) const {
  return get_attr<std::vector<int64_t>>(values_, key, "int list");
}
const std::string& Attrs::s(const std::string& key) const {
  return get_attr<std::string>(values_, key, "string");
}
int64_t Attrs::i_or(const std::string& key, int64_t dflt) const {
  return has(key) ? i(key) : dflt;
}
double Attrs::f_or(const std::string& key, double dflt) const {
  return has(key) ? f(key) : dflt;
}
bool Attrs::b_or(const std::string& key, bool dflt) const {
  return has(key) ? b(key) : dflt;
}

ValueId Graph::new_value(Value v) {
  if (v.name.empty()) throw ConfigError("graph: a value needs a non-empty name");
  if (by_name_.count(v.name) != 0) {
    throw ConfigError(fmt::format("graph: duplicate value name '{}'", v.name));
  }
  const auto id = static_cast<ValueId>(values_.size());
  by_name_[v.name] = id;
  values_.push_back(std::move(v));
  return id;
}

ValueId Graph::add_input(const std::string& name, const Shape& shape, DType dtype) {
  Value v;
  v.name = name;
  v.shape = shape;
  v.dtype = dtype;
  v.role = ValueRole::input;
  ValueId id = new_value(std::move(v));
  inputs_.push_back(id);
  return id;
}

ValueId Graph::add_param(const std::string& name, const Shape& shape, DType dtype, ParamInit init) {
  if (!is_float(dtype)) {
    throw ShapeError(fmt::format("graph: parameter '{}' must have a float dtype, got {}", name,
                                 dtype_name(dtype)));
  }
  Value v;
  v.name = name;
  v.shape = shape;
  v.dtype = dtype;
  v.role = ValueRole::param;
  v.init = init;
  ValueId id = new_value(std::move(v));
  params_.push_back(id);
  return id;
}

std::vector<ValueId> Graph::add_node(OpKind op, const std::string& name,
                                     std::vector<ValueId> inputs, Attrs attrs, bool backward) {
  const OpDef& def = op_def(op);
  Node n;
  n.op = op;
  n.name = name;
  n.inputs = std::move(inputs);
  n.attrs = std::move(attrs);
  n.backward = backward;
  const int nin = static_cast<int>(n.inputs.size());
  if (nin < def.min_inputs || nin > def.max_inputs) {
    throw ShapeError(fmt::format("node '{}' ({}): expects {} input(s), got {}", name, def.name,
                                 def.min_inputs == def.max_inputs
                                     ? fmt::format("{}", def.min_inputs)
                                     : fmt::format("{} to {}", def.min_inputs, def.max_inputs),
                                 nin));
  }
  for (ValueId in : n.inputs) {
    MT_CHECK(in >= 0 && in < num_values(), "node '{}' ({}): input id {} is not a value", name,
             def.name, in);
  }
  std::vector<ValueType> types = def.infer(InferContext(*this, n));
  MT_CHECK(!types.empty(), "op {} inferred no outputs", def.name);

  // Check every output name before creating any, so a failure leaves g unchanged.
  std::vector<std::string> names;
  for (size_t k = 0; k < types.size(); ++k) {
    std::string out = name;
    if (k > 0) {
      out += "." + (k - 1 < def.extra_output_names.size() ? def.extra_output_names[k - 1]
                                                          : fmt::format("{}", k));
    }
    if (by_name_.count(out) != 0) {
      throw ConfigError(
          fmt::format("graph: duplicate value name '{}' (node '{}' ({}))", out, name, def.name));
    }
    names.push_back(std::move(out));
  }
  const auto id = static_cast<NodeId>(nodes_.size());
  for (size_t k = 0; k < types.size(); ++k) {
    Value v;
    v.name = names[k];
    v.shape = std::move(types[k].shape);
    v.dtype = types[k].dtype;
    v.role = backward ? ValueRole::grad : ValueRole::activation;
    v.producer = id;
    n.outputs.push_back(new_value(std::move(v)));
  }
  nodes_.push_back(std::move(n));
  return nodes_.back().outputs;
}

std::optional<ValueId> Graph::find(const std::string& value_name) const {
  auto it = by_name_.find(value_name);
  if (it == by_name_.end()) return std::nullopt;
  return it->second;
}

void Graph::rename_value(ValueId v, const std::string& name) {
  Value& val = value(v);
  if (val.name == name) return;
  if (by_name_.count(name) != 0) {
    throw ConfigError(
        fmt::format("graph: cannot rename '{}' to '{}': the name is taken", val.name, name));
  }
  by_name_.erase(val.name);
  by_name_[name] = v;
  val.name = name;
}

void Graph::rename_node(NodeId id, const std::string& name) {
  Node& n = nodes_.at(static_cast<size_t>(id));
  // Output k > 0 keeps its suffix after the node name ("ln.mean" -> "<name>.mean").
  std::vector<std::string> names;
  for (size_t k = 0; k < n.outputs.size(); ++k) {
    const std::string& old = value(n.outputs[k]).name;
    names.push_back(k == 0 ? name : name + old.substr(std::min(old.size(), n.name.size())));
  }
  for (size_t k = 0; k < n.outputs.size(); ++k) {
    auto it = by_name_.find(names[k]);
    if (it != by_name_.end() && it->second != n.outputs[k]) {
      throw ConfigError(fmt::format("graph: cannot rename node '{}' to '{}': '{}' is taken", n.name,
                                    name, names[k]));
    }
  }
  for (size_t k = 0; k < n.outputs.size(); ++k) by_name_.erase(value(n.outputs[k]).name);
  for (size_t k = 0; k < n.outputs.size(); ++k) {
    value(n.outputs[k]).name = names[k];
    by_name_[names[k]] = n.outputs[k];
  }
  n.name = name;
}

std::string Graph::unique_name(const std::string& base) const {
  if (by_name_.count(base) == 0) return base;
  for (int k = 2;; ++k) {
    std::string s = fmt::format("{}#{}", base, k);
    if (by_name_.count(s) == 0) return s;
  }
}

void Graph::replace_input(NodeId id, int slot, ValueId v) {
  Node& n = nodes_.at(static_cast<size_t>(id));
  MT_CHECK(slot >= 0 && slot < static_cast<int>(n.inputs.size()), "node '{}': no input {}", n.name,
           slot);
  MT_CHECK(v >= 0 && v < num_values(), "node '{}': input id {} is not a value", n.name, v);
  const Value& old = value(n.inputs[static_cast<size_t>(slot)]);
  const Value& now = value(v);
  if (old.shape != now.shape || old.dtype != now.dtype) {
    throw ShapeError(fmt::format("node '{}': input {} is {}{}, cannot become '{}' {}{}", n.name,
                                 slot, dtype_name(old.dtype), old.shape.str(), now.name,
                                 dtype_name(now.dtype), now.shape.str()));
  }
  n.inputs[static_cast<size_t>(slot)] = v;
}

void Graph::reorder_nodes(const std::vector<NodeId>& order) {
  MT_CHECK(order.size() == nodes_.size(), "reorder_nodes: {} ids for {} nodes", order.size(),
           nodes_.size());
  std::vector<bool> placed(nodes_.size(), false);
  std::vector<bool> ready(values_.size(), false);
  for (ValueId v = 0; v < num_values(); ++v) {
    ready[static_cast<size_t>(v)] = values_[static_cast<size_t>(v)].producer == kNoNode;
  }
  for (NodeId id : order) {
    MT_CHECK(id >= 0 && id < num_nodes() && !placed[static_cast<size_t>(id)],
             "reorder_nodes: node id {} missing, repeated or out of range", id);
    placed[static_cast<size_t>(id)] = true;
    const Node& n = nodes_[static_cast<size_t>(id)];
    for (ValueId in : n.inputs) {
      MT_CHECK(ready[static_cast<size_t>(in)], "reorder_nodes: node '{}' would run before '{}'",
               n.name, value(in).name);
    }
    for (ValueId out : n.outputs) ready[static_cast<size_t>(out)] = true;
  }
  std::vector<Node> nodes;
  nodes.reserve(nodes_.size());
  for (NodeId id : order) nodes.push_back(std::move(nodes_[static_cast<size_t>(id)]));
  nodes_ = std::move(nodes);
  for (NodeId id = 0; id < num_nodes(); ++id) {
    for (ValueId out : nodes_[static_cast<size_t>(id)].outputs) value(out).producer = id;
  }
}

int Graph::num_forward_nodes() const {
  int n = 0;
  for (const Node& node : nodes_) n += node.backward ? 0 : 1;
  return n;
}

ValueId Graph::grad_of(ValueId param) const {
  auto it = grads_.find(param);
  return it == grads_.end() ? kNoValue : it->second;
}

int64_t Graph::param_count() const {
  int64_t n = 0;
  for (ValueId p : params_) n += value(p).shape.numel();
  return n;
}

std::string_view op_name(OpKind op) {
  return op_def(op).name;
}

}  // namespace mt
