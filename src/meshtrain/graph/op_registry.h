// The operator registry: everything the graph layer knows about one OpKind
// (arity, shape and dtype inference, FLOPs, gradient rule) in one OpDef entry.
// Adding an operator means adding an OpKind and one entry in the ops_*.cpp
// file of its family (plus its kernel in exec/kernel_table.cpp).
//
// The table is built once, on first use, and is read-only afterwards, so it
// may be read from several threads.
#pragma once

#include <string>
#include <vector>

#include "meshtrain/graph/graph.h"

namespace mt {

struct ValueType {
  Shape shape;
  DType dtype = DType::f32;
};

// What a shape-inference function sees: the node being added (name, op,
// attrs) and its inputs' types. fail*() throw ShapeError prefixed with
// "node '<name>' (<op>): ".
class InferContext {
 public:
  InferContext(const Graph& g, const Node& n) : g_(g), n_(n) {}
  const Node& node() const { return n_; }
  const Attrs& attrs() const { return n_.attrs; }
  int num_inputs() const { return static_cast<int>(n_.inputs.size()); }
  const Shape& shape(int i) const { return g_.value(n_.inputs.at(static_cast<size_t>(i))).shape; }
  DType dtype(int i) const { return g_.value(n_.inputs.at(static_cast<size_t>(i))).dtype; }
  std::string desc(int i) const;  // "f32[2, 3]"

  // The message is followed by the list of all input types.
  [[noreturn]] void fail(const std::string& msg) const;
  // For messages that already show every input (e.g. "f32[2, 3] @ f32[4, 5]").
  [[noreturn]] void fail_shown(const std::string& msg) const;

  void expect_rank(int i, int rank, const char* what) const;
  void expect_float(int i, const char* what) const;
  void expect_dtype(int i, DType t, const char* what) const;
  void expect_same_dtype(int i, int j) const;
  // Reads a shape attribute; throws ShapeError for a negative dimension.
  Shape shape_attr(const std::string& key) const;

 private:
  const Graph& g_;
  const Node& n_;
};

// What a gradient rule sees while autodiff walks backward: the forward node,
// the gradients of its differentiable outputs, and which inputs want a
// gradient. A rule emits backward nodes with emit() and hands each wanted
// input's gradient to give(): the input's shape, and its dtype or
// grad_dtype(i). The two differ for the output of a widening-source cast (a
// bf16 copy of an f32 value, as mixed precision makes before a matmul): its
// gradient may stay f32, so a matmul's f32 product is not rounded to bf16 only
// for the cast's own gradient to widen it again.
class GradContext {
 public:
  // wants/names: per input slot of n; names are what autodiff expects each
  // contribution to be called ("grad/<input name>" when it is the only one).
  GradContext(Graph& g, Node n, std::vector<ValueId> dys, std::vector<bool> wants,
              std::vector<std::string> names);

  Graph& graph() { return g_; }
  const Node& node() const { return n_; }
  const Attrs& attrs() const { return n_.attrs; }
  ValueId x(int i) const { return n_.inputs.at(static_cast<size_t>(i)); }
  ValueId y(int i = 0) const { return n_.outputs.at(static_cast<size_t>(i)); }
  ValueId dy(int i = 0) const { return dys_.at(static_cast<size_t>(i)); }
  const Value& value(ValueId v) const { return g_.value(v); }
  int num_inputs() const { return static_cast<int>(n_.inputs.size()); }

  bool wants(int i) const { return wants_.at(static_cast<size_t>(i)); }
  // Name for input i's contribution; helper nodes use name(i) + "." + suffix.
  const std::string& name(int i) const { return names_.at(static_cast<size_t>(i)); }
  // A helper name not tied to one input: "grad/<node name>.<suffix>".
  std::string node_name(const std::string& suffix) const;
  // Appends a backward node (its name made unique) and returns its outputs.
  std::vector<ValueId> emit_multi(OpKind op, const std::string& name, std::vector<ValueId> inputs,
                                  Attrs attrs = {});
  ValueId emit(OpKind op, const std::string& name, std::vector<ValueId> inputs, Attrs attrs = {});
  // The dtype input i's gradient is best given in: the source dtype of the
  // forward cast that produced the input when that source is wider (f32 for a
  // bf16 or f16 copy), else the input's own dtype. give() accepts either.
  DType grad_dtype(int i) const;
  // Hands over input i's gradient; ignored unless wants(i).
  void give(int i, ValueId grad);
  const std::vector<ValueId>& given() const { return given_; }

 private:
  Graph& g_;
  Node n_;
  std::vector<ValueId> dys_;
  std::vector<bool> wants_;
  std::vector<std::string> names_;
  std::vector<ValueId> given_;
};

struct OpDef {
  OpKind op = OpKind::matmul;
  std::string_view name;
  int min_inputs = 1;
  int max_inputs = 1;
  // Value-name suffixes of outputs after the first ("mean" -> "<node>.mean").
  std::vector<std::string> extra_output_names;
  // Leading outputs that carry gradients (e.g. layer_norm's y but not mean/rstd).
  int diff_outputs = 1;
  std::vector<ValueType> (*infer)(const InferContext&) = nullptr;
  // Floating-point operations of one execution (a multiply-add counts 2).
  double (*flops)(const Graph&, const Node&) = nullptr;
  // nullptr: not differentiable (backward-only operators, fill).
  void (*grad)(GradContext&) = nullptr;
  // Output 0 is input 0's memory under another shape (no copy, no bytes moved).
  bool view = false;
  // Cheap enough that the executor may recompute it in backward instead of
  // keeping its outputs alive (ExecOptions::recompute).
  bool recomputable = false;
};

// Throws InternalError for an OpKind without an entry.
const OpDef& op_def(OpKind op);
// Every registered OpKind, in enum order.
std::vector<OpKind> all_ops();

// An entry with the fields every family sets (the family files' helper).
OpDef make_op_def(OpKind op, std::string_view name, int min_inputs, int max_inputs,
                  std::vector<ValueType> (*infer)(const InferContext&),
                  double (*flops)(const Graph&, const Node&), void (*grad)(GradContext&));

// Family files; each appends its operators' entries.
void register_elementwise_ops(std::vector<OpDef>& table);
void register_linear_ops(std::vector<OpDef>& table);
void register_norm_ops(std::vector<OpDef>& table);
void register_conv_ops(std::vector<OpDef>& table);
void register_shape_ops(std::vector<OpDef>& table);
void register_collective_ops(std::vector<OpDef>& table);
void register_sparse_ops(std::vector<OpDef>& table);

// Shared helpers for rules.
double numel_of(const Graph& g, ValueId v);
// The dtype v's gradient may be carried in (see GradContext::grad_dtype).
DType wide_grad_dtype(const Graph& g, ValueId v);
// True if b broadcasts against a by the binary-op rule: equal shapes, b a
// suffix of a's shape, or b a scalar (rank 0 or one element).
bool broadcasts_to(const Shape& b, const Shape& a);
bool is_suffix(const Shape& s, const Shape& of);
Attrs shape_attrs(const Shape& s);
std::vector<int64_t> dims_of(const Shape& s);

}  // namespace mt
