// A sparse matrix's structure in CSR form and the edge values graph neural
// networks derive from it (degree normalisation, mean aggregation). Plain
// data and pure functions; the kernels that compute with it are in
// backend.h's "sparse" section, and the graph IR carries row_ptr / col_idx as
// i32 inputs (graph/ops_sparse.cpp).
//
// In a graph, row i lists vertex i's in-neighbours (the sources of messages
// into i), so spmm(A, X)[i] aggregates over them. Undirected graphs store
// both directions.
#pragma once

#include <cstdint>
#include <vector>

#include "meshtrain/tensor/tensor.h"

namespace mt {

struct Csr {
  int64_t rows = 0, cols = 0;
  std::vector<int32_t> row_ptr = {0};  // rows + 1 entries
  std::vector<int32_t> col_idx;        // row_ptr.back() entries, each in [0, cols)

  int64_t nnz() const { return static_cast<int64_t>(col_idx.size()); }
  // Throws ShapeError naming `what` and the first bad field (check_csr's rules).
  void validate(const char* what) const;
  // Builds a CSR [rows, cols] from entries (row[k], col[k]); entries keep
  // their order within a row; duplicates are kept.
  static Csr from_entries(int64_t rows, int64_t cols, const std::vector<int32_t>& row,
                          const std::vector<int32_t>& col);
};

// The matrix with a self-loop (i, i) added to every row i that lacks one
// (square matrices only; ShapeError otherwise), rows kept sorted by column
// when they were.
Csr with_self_loops(const Csr& a);
// GCN's symmetric normalisation D^-1/2 A D^-1/2 as one value per entry:
// w[e] = 1 / sqrt(deg(row) deg(col)), deg(v) the number of entries in row v
// (its in-degree, self-loop included), as PyTorch Geometric's gcn_norm.
// Apply it to with_self_loops(A) for GCN's D^-1/2 (A + I) D^-1/2.
std::vector<float> gcn_norm_values(const Csr& a);
// 1 / deg(row) per entry: spmm with these values is the neighbour mean.
std::vector<float> mean_values(const Csr& a);
// The row of every entry (COO rows), for gathering per-destination values onto edges.
std::vector<int32_t> entry_rows(const Csr& a);

// An i32 / f32 tensor holding a copy of `v` (shape [v.size()]).
Tensor tensor_from(const std::vector<int32_t>& v);
Tensor tensor_from(const std::vector<float>& v);

}  // namespace mt
