// Sharded checkpoints with N-d box pieces (tensor parallelism): 1-D, 2-D
// and 3-D tensors written by 2-4 ranks under one layout (replicated, whole
// on one rank, flat 1-D ranges, split on dimension 0, 1 or the last, evenly
// or 2:1, column shards cut further by 1-D ZeRO ranges) read back by 1-4
// ranks under any other, bitwise; a column shard is one stored piece and a
// partitioned tensor is stored exactly once; format 1 indexes (no boxes)
// still load; a corrupt block of a box piece and uncovered elements are
// named; the element-run geometry and the trainer's helpers (box_piece,
// in_box, in_boxes) on their own.
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "meshtrain/comm/backends/local/local_world.h"
#include "meshtrain/spmd/sharding.h"
#include "meshtrain/train/sharded_checkpoint.h"

namespace mt {
namespace {

namespace fs = std::filesystem;
using Tensors = std::map<std::string, Tensor>;

LocalWorldOptions world(int size) {
  LocalWorldOptions o;
  o.size = size;
  o.comm.timeout = std::chrono::milliseconds(10'000);  // a hang fails instead of stalling
  return o;
}

// Random bit patterns (any misplaced byte shows); one tensor per rank of
// shape, two dtypes; no dimension that every world size divides.
Tensors make_model(uint32_t seed) {
  const std::vector<std::tuple<std::string, Shape, DType>> specs = {
      {"v", Shape({26}), DType::f32},
      {"m", Shape({12, 10}), DType::f32},
      {"t", Shape({6, 8, 5}), DType::bf16}};
  std::mt19937 rng(seed);
  Tensors out;
  for (const auto& [name, shape, dtype] : specs) {
    Tensor t = Tensor::empty(shape, dtype);
    auto* p = static_cast<unsigned char*>(t.raw());
    for (size_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<unsigned char>(rng());
    out.emplace(name, t);
  }
  return out;
}

// Elements [begin, end) of the row-major order of `box` of `t`, copied by
// walking the box's multi-indices (independently of piece_runs).
Tensor extract(const Tensor& t, const Box& box, int64_t begin, int64_t end) {
  const auto& dims = t.shape().dims();
  const size_t es = dtype_size(t.dtype());
  Tensor out = Tensor::empty(Shape{end - begin}, t.dtype());
  std::vector<int64_t> idx = box.begin;
  for (int64_t i = 0; i < end; ++i) {
    if (i >= begin) {
      int64_t flat = 0;
      for (size_t d = 0; d < dims.size(); ++d) flat = flat * dims[d] + idx[d];
      std::memcpy(static_cast<char*>(out.raw()) + static_cast<size_t>(i - begin) * es,
                  static_cast<const char*>(t.raw()) + static_cast<size_t>(flat) * es, es);
    }
    for (size_t d = dims.size(); d-- > 0;) {
      if (++idx[d] < box.end[d]) break;
      idx[d] = box.begin[d];
    }
  }
  return out;
}

enum class Layout { replicated, rank0, flat, dim0, dim0_ratio, dim1, dim1_ratio, dim1_zero, last };
constexpr Layout kLayouts[] = {Layout::replicated, Layout::rank0,      Layout::flat,
                               Layout::dim0,       Layout::dim0_ratio, Layout::dim1,
                               Layout::dim1_ratio, Layout::dim1_zero,  Layout::last};
const char* layout_name(Layout l) {
  switch (l) {
    case Layout::replicated:
      return "replicated";
    case Layout::rank0:
      return "rank0";
    case Layout::flat:
      return "flat";
    case Layout::dim0:
      return "dim0";
    case Layout::dim0_ratio:
      return "dim0_2:1";
    case Layout::dim1:
      return "dim1";
    case Layout::dim1_ratio:
      return "dim1_2:1";
    case Layout::dim1_zero:
      return "dim1+zero";
    case Layout::last:
      return "last";
  }
  return "?";
}

// Part `rank` of `parts` of [0, n): even (as even_range), or by the ratios
// 2, 1, 2, 1, ... (spmd's split_sizes, as a 2:1 sharding splits).
std::pair<int64_t, int64_t> part(int64_t n, int rank, int parts, bool ratio) {
  if (!ratio) return even_range(n, rank, parts);
  std::vector<int64_t> ratios;
  for (int r = 0; r < parts; ++r) ratios.push_back(r % 2 == 0 ? 2 : 1);
  const std::vector<int64_t> sizes = split_sizes(n, parts, ratios, 1);
  int64_t b = 0;
  for (int r = 0; r < rank; ++r) b += sizes[static_cast<size_t>(r)];
  return {b, b + sizes[static_cast<size_t>(rank)]};
}

Box split_box(const Shape& s, int dim, int rank, int parts, bool ratio) {
  Box b = Box::whole(s);
  const auto [lo, hi] = part(s.dims()[static_cast<size_t>(dim)], rank, parts, ratio);
  b.begin[static_cast<size_t>(dim)] = lo;
  b.end[static_cast<size_t>(dim)] = hi;
  return b;
}

// Rank `rank`'s pieces of tensor `name` under layout l (of `size` ranks),
// with data copied from the model. Dimension 1 means the last one for 1-D
// tensors.
std::vector<ShardPiece> pieces_of(Layout l, const std::string& name, const Tensor& t, int rank,
                                  int size) {
  const Shape& s = t.shape();
  const int d1 = std::min(1, s.rank() - 1);
  auto whole_box = [&](const Box& b) {
    return box_piece(name, s, b, extract(t, b, 0, b.elements()));
  };
  switch (l) {
    case Layout::replicated:
      return {whole_box(Box::whole(s))};
    case Layout::rank0:
      if (rank == 0) return {whole_box(Box::whole(s))};
      return {};
    case Layout::flat: {  // today's plain ranges, no box
      const auto [b, e] = even_range(t.numel(), rank, size);
      return {slice_piece(name, t, b, e)};
    }
    case Layout::dim0:
    case Layout::dim0_ratio:
      return {whole_box(split_box(s, 0, rank, size, l == Layout::dim0_ratio))};
    case Layout::dim1:
    case Layout::dim1_ratio:
      return {whole_box(split_box(s, d1, rank, size, l == Layout::dim1_ratio))};
    case Layout::last:
      return {whole_box(split_box(s, s.rank() - 1, rank, size, false))};
    case Layout::dim1_zero: {
      // Tensor parallel over 2 column shards (ranks of one parity share
      // one), each cut by ZeRO into 1-D ranges of the local tensor that
      // fall mid-row; the local pieces are anchored with in_box, as the
      // trainer maps DataParallel's pieces.
      const int tp = std::min(size, 2);
      const int shard = rank % tp;
      const int dp = (size - shard + tp - 1) / tp;  // ranks holding this shard
      const int at = rank / tp;
      const Box box = split_box(s, d1, shard, tp, false);
      const int64_t n = box.elements();
      auto cut = [&](int k) { return k == 0 || k == dp ? n * k / dp : n * k / dp + 1; };
      const int64_t b = cut(at), e = cut(at + 1);
      // DataParallel's piece of the local tensor (shape box.shape()).
      ShardPiece local{name, box.shape(), b, e, extract(t, box, b, e)};
      return {in_box(std::move(local), TensorPlace{s, box})};
    }
  }
  return {};
}

std::vector<ShardPiece> layout_pieces(Layout l, const Tensors& model, int rank, int size) {
  std::vector<ShardPiece> out;
  for (const auto& [name, t] : model) {
    for (ShardPiece& p : pieces_of(l, name, t, rank, size)) out.push_back(std::move(p));
  }
  return out;
}

// The same pieces with fresh destinations holding a sentinel pattern.
std::vector<ShardPiece> destinations(const std::vector<ShardPiece>& like) {
  std::vector<ShardPiece> out;
  for (const ShardPiece& p : like) {
    ShardPiece d = p;
    d.data = Tensor::empty(Shape{p.end - p.begin}, p.data.dtype());
    if (p.end > p.begin) std::memset(d.data.raw(), 0xA5, d.data.nbytes());
    out.push_back(std::move(d));
  }
  return out;
}

// "" when every destination holds exactly the model's bytes for its elements.
std::string compare(const Tensors& model, const std::vector<ShardPiece>& got) {
  for (const ShardPiece& p : got) {
    const Tensor& t = model.at(p.name);
    const Box box = p.box.begin.empty() ? Box::whole(t.shape()) : p.box;
    const Tensor want = extract(t, box, p.begin, p.end);
    if (p.end > p.begin && std::memcmp(p.data.raw(), want.raw(), p.data.nbytes()) != 0) {
      return fmt::format("'{}' box {} [{}, {}) differs", p.name, box.str(), p.begin, p.end);
    }
  }
  return "";
}

bool untouched(const std::vector<ShardPiece>& got) {
  for (const ShardPiece& p : got) {
    const auto* b = static_cast<const unsigned char*>(p.data.raw());
    for (size_t i = 0; i < p.data.nbytes(); ++i) {
      if (b[i] != 0xA5) return false;
    }
  }
  return true;
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void spit(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Rewrites index.json after `edit`, with a valid checksum.
template <class F>
void edit_index(const std::string& dir, F&& edit) {
  nlohmann::json j = nlohmann::json::parse(slurp(sharded_index_path(dir)));
  j.erase("index_crc32");
  edit(j);
  const std::string text = j.dump();
  j["index_crc32"] =
      fmt::format("{:08x}", crc32_z(0, reinterpret_cast<const Bytef*>(text.data()), text.size()));
  spit(sharded_index_path(dir), j.dump(1));
}

void expect_has(const std::string& msg, std::initializer_list<std::string> parts) {
  for (const std::string& p : parts) {
    EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' in: " << msg;
  }
}

template <class E, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected an exception";
  return "";
}

class ShardedCheckpointBoxes : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           fmt::format("mt-sharded-box-{}-{}", ::getpid(),
                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string dir(const std::string& sub = "ckpt") const { return (dir_ / sub).string(); }

  // Small blocks, so row runs start and end inside blocks.
  static SaveShardedOptions opts(const std::string& mode = "test") {
    SaveShardedOptions o;
    o.mode = mode;
    o.block_bytes = 12;
    return o;
  }

  void save(int n, Layout l, const Tensors& model, const std::string& sub = "ckpt") {
    LocalWorld::run(world(n), [&](Communicator& c) {
      save_sharded(&c, dir(sub), layout_pieces(l, model, c.rank(), c.size()), {{"step", "3"}},
                   opts(layout_name(l)));
    });
  }

  // Loads into m ranks under layout l; returns per-rank comparison failures.
  std::string load_and_compare(int m, Layout l, const Tensors& model,
                               const std::string& sub = "ckpt") {
    return load_path_and_compare(m, l, model, dir(sub));
  }
  static std::string load_path_and_compare(int m, Layout l, const Tensors& model,
                                           const std::string& path) {
    std::vector<std::string> bad(static_cast<size_t>(m));
    LocalWorld::run(world(m), [&](Communicator& c) {
      auto want = destinations(layout_pieces(l, model, c.rank(), c.size()));
      load_sharded(&c, path, want);
      bad[static_cast<size_t>(c.rank())] = compare(model, want);
    });
    std::string all;
    for (size_t r = 0; r < bad.size(); ++r) {
      if (!bad[r].empty()) all += fmt::format("rank {}: {}; ", r, bad[r]);
    }
    return all;
  }

  fs::path dir_;
};

// Elements stored per tensor, summed over the index's pieces.
std::map<std::string, int64_t> stored_elements(const ShardedIndex& index) {
  std::map<std::string, int64_t> out;
  for (const auto& [name, info] : index.tensors) {
    for (const ShardedPieceRef& p : info.pieces) out[name] += p.end - p.begin;
  }
  return out;
}

TEST(PieceRuns, RowsOfABoxAreContiguousRunsOfTheWholeTensor) {
  const Shape s{4, 6, 5};
  // No box, a whole box, a block of rows: one run each.
  EXPECT_EQ(piece_runs(s, Box{}, 7, 100), (std::vector<ElementRun>{{7, 100, 0}}));
  EXPECT_EQ(piece_runs(s, Box::whole(s), 7, 100), (std::vector<ElementRun>{{7, 100, 0}}));
  EXPECT_EQ(piece_runs(s, Box{{1, 0, 0}, {3, 6, 5}}, 0, 60),
            (std::vector<ElementRun>{{30, 90, 0}}));
  // Dimension 1 cut to [2, 4): rows of 2 * 5 elements, one per index of dim 0.
  EXPECT_EQ(piece_runs(s, Box{{0, 2, 0}, {4, 4, 5}}, 0, 40),
            (std::vector<ElementRun>{{10, 20, 0}, {40, 50, 10}, {70, 80, 20}, {100, 110, 30}}));
  // A range cut mid-row of the same box.
  EXPECT_EQ(piece_runs(s, Box{{0, 2, 0}, {4, 4, 5}}, 13, 27),
            (std::vector<ElementRun>{{43, 50, 0}, {70, 77, 7}}));
  // Last dimension cut, two outer dimensions cut: rows of 2.
  EXPECT_EQ(piece_runs(s, Box{{1, 4, 3}, {3, 6, 5}}, 1, 8),
            (std::vector<ElementRun>{{54, 55, 0}, {58, 60, 1}, {83, 85, 3}, {88, 90, 5}}));
  EXPECT_TRUE(piece_runs(s, Box{{0, 2, 0}, {4, 2, 5}}, 0, 0).empty());
  EXPECT_THROW(piece_runs(s, Box{{0, 0}, {4, 6}}, 0, 1), ConfigError);         // rank
  EXPECT_THROW(piece_runs(s, Box{{0, 0, 0}, {4, 7, 5}}, 0, 1), ConfigError);   // outside
  EXPECT_THROW(piece_runs(s, Box{{0, 2, 0}, {4, 4, 5}}, 0, 41), ConfigError);  // range
  EXPECT_THROW(piece_runs(s, Box{{0, 2, 0}, {4, 4, 5}}, 5, 4), ConfigError);   // reversed
  expect_has(error_of<ConfigError>([&] {
               piece_runs(s, Box{{0, 3, 0}, {4, 2, 5}}, 0, 0);
             }),
             {"[0:4, 3:2, 0:5]", "[4, 6, 5]"});
}

TEST_F(ShardedCheckpointBoxes, AnyWriterLayoutLoadsUnderAnyReaderLayout) {
  const Tensors model = make_model(1);
  for (int n = 2; n <= 4; ++n) {
    for (Layout wl : kLayouts) {
      const std::string sub = fmt::format("w{}-{}", n, static_cast<int>(wl));
      save(n, wl, model, sub);
      // Writers that partition a tensor store each element once; replicas
      // store it once per rank.
      const ShardedIndex index = read_index(dir(sub));
      EXPECT_EQ(index.world_size, n);
      for (const auto& [name, count] : stored_elements(index)) {
        const int64_t numel = model.at(name).numel();
        EXPECT_EQ(count, wl == Layout::replicated ? n * numel : numel)
            << name << " written by " << n << " ranks " << layout_name(wl);
      }
      for (int m = 1; m <= 4; ++m) {
        for (Layout rl : kLayouts) {
          EXPECT_EQ(load_and_compare(m, rl, model, sub), "")
              << "written by " << n << " ranks " << layout_name(wl) << ", read by " << m
              << " ranks " << layout_name(rl);
        }
      }
      const CheckpointContents whole = load_sharded_full(dir(sub));
      for (const auto& [name, t] : model) {
        const Tensor& got = whole.tensors.at(name);
        EXPECT_EQ(got.desc(), t.desc()) << name;
        EXPECT_EQ(std::memcmp(got.raw(), t.raw(), t.nbytes()), 0) << name << " from " << sub;
      }
    }
  }
}

TEST_F(ShardedCheckpointBoxes, AColumnShardIsOneStoredPieceAndRowBlocksHaveNoBox) {
  const Tensors model = make_model(2);
  save(3, Layout::dim1, model, "cols");
  const ShardedIndex cols = read_index(dir("cols"));
  const ShardedTensorInfo& m = cols.tensors.at("m");
  ASSERT_EQ(m.pieces.size(), 3u) << "one piece per rank, not one per row";
  for (int r = 0; r < 3; ++r) {
    const ShardedPieceRef& p = m.pieces[static_cast<size_t>(r)];  // sorted by first element
    const Box want = split_box(Shape{12, 10}, 1, r, 3, false);
    EXPECT_EQ(p.box, want) << r;
    EXPECT_EQ(p.begin, 0);
    EXPECT_EQ(p.end, want.elements());
    EXPECT_EQ(p.key, fmt::format("m@0:12,{}:{}@0-{}", want.begin[1], want.end[1], want.elements()));
    EXPECT_EQ(cols.shards[static_cast<size_t>(p.shard)].rank, r);
  }
  // 1-D tensors split on their only dimension are plain ranges.
  for (const ShardedPieceRef& p : cols.tensors.at("v").pieces) EXPECT_TRUE(p.box.begin.empty());
  const nlohmann::json c = nlohmann::json::parse(slurp(sharded_index_path(dir("cols"))));
  EXPECT_EQ(c["format"], "meshtrain-sharded-2");
  const Box b1 = split_box(Shape{12, 10}, 1, 1, 3, false);
  EXPECT_EQ(c["tensors"]["m"]["pieces"][1]["box"],
            nlohmann::json::parse(fmt::format("[[0, 12], [{}, {}]]", b1.begin[1], b1.end[1])));

  // Blocks of rows are contiguous: stored as ranges of the whole tensor,
  // as format 1 stored them.
  save(2, Layout::dim0_ratio, model, "rows");
  const ShardedIndex rows = read_index(dir("rows"));
  const auto& t = rows.tensors.at("t").pieces;
  ASSERT_EQ(t.size(), 2u);
  EXPECT_TRUE(t[0].box.begin.empty() && t[1].box.begin.empty());
  EXPECT_EQ(std::make_tuple(t[0].begin, t[0].end, t[1].begin, t[1].end),
            std::make_tuple(int64_t{0}, int64_t{4 * 40}, int64_t{4 * 40}, int64_t{6 * 40}));
  EXPECT_EQ(t[0].key, "t@0-160");
  const nlohmann::json j = nlohmann::json::parse(slurp(sharded_index_path(dir("rows"))));
  EXPECT_FALSE(j["tensors"]["t"]["pieces"][0].contains("box"));
}

TEST_F(ShardedCheckpointBoxes, FormatOneIndexesWithoutBoxesStillLoad) {
  // A checkpoint as the format-1 code wrote it: 1-D pieces, no boxes, the
  // format string "meshtrain-sharded-1".
  const Tensors model = make_model(3);
  save(3, Layout::flat, model);
  edit_index(dir(), [](nlohmann::json& j) {
    for (auto& [name, t] : j["tensors"].items()) {
      for (const auto& p : t["pieces"]) EXPECT_FALSE(p.contains("box")) << name;
    }
    j["format"] = "meshtrain-sharded-1";
  });
  EXPECT_EQ(nlohmann::json::parse(slurp(sharded_index_path(dir())))["format"],
            "meshtrain-sharded-1");
  for (int m = 1; m <= 4; ++m) {
    for (Layout rl : {Layout::dim1, Layout::dim1_zero, Layout::dim0_ratio, Layout::replicated}) {
      EXPECT_EQ(load_and_compare(m, rl, model), "") << m << " ranks " << layout_name(rl);
    }
  }
  // A box in a format-1 index is damage, not data.
  edit_index(dir(), [](nlohmann::json& j) {
    j["tensors"]["m"]["pieces"][0]["box"] = nlohmann::json::parse("[[0, 12], [0, 10]]");
  });
  expect_has(error_of<CheckpointError>([&] { read_index(dir()); }),
             {"'m'", "has a box", "meshtrain-sharded-1"});
  edit_index(dir(), [](nlohmann::json& j) { j["format"] = "meshtrain-sharded-9"; });
  expect_has(error_of<CheckpointError>([&] { read_index(dir()); }),
             {"meshtrain-sharded-9", "meshtrain-sharded-2", "meshtrain-sharded-1"});
}

// A checkpoint the format-1 code wrote (main at 50719ba: `meshtrain train
// --config configs/mlp_fashion.toml --set 'model.hidden=[2]' --set
// train.steps=2 --set dist.nproc=2 --set optim.name=adamw --set
// dist.zero_stage=1 --set train.checkpoint=DIR`): ZeRO-1 ranges cut
// fc1.w [784, 2] and its Adam state in two. Loaded whole (every block
// verified against the old writer's checksums) and under box layouts,
// which must agree with the whole tensors bitwise.
TEST_F(ShardedCheckpointBoxes, ACheckpointWrittenByTheFormatOneCodeLoadsUnderBoxLayouts) {
  const std::string path = std::string(MT_SOURCE_DIR) + "/tests/train/fixtures/sharded_format1";
  const ShardedIndex index = read_index(path);
  EXPECT_EQ(index.world_size, 2);
  EXPECT_EQ(index.mode, "zero1");
  EXPECT_EQ(nlohmann::json::parse(slurp(sharded_index_path(path)))["format"],
            "meshtrain-sharded-1");
  ASSERT_EQ(index.tensors.at("param/fc1.w").pieces.size(), 2u);
  for (const auto& [name, info] : index.tensors) {
    for (const ShardedPieceRef& p : info.pieces) EXPECT_TRUE(p.box.begin.empty()) << name;
  }
  const CheckpointContents whole = load_sharded_full(path);
  ASSERT_EQ(whole.tensors.size(), 12u);
  EXPECT_EQ(whole.tensors.at("param/fc1.w").shape(), Shape({784, 2}));
  EXPECT_EQ(whole.metadata.at("optimizer"), "adamw");
  for (int m = 1; m <= 3; ++m) {
    for (Layout rl : {Layout::dim1, Layout::dim1_ratio, Layout::dim1_zero, Layout::dim0_ratio}) {
      EXPECT_EQ(load_path_and_compare(m, rl, whole.tensors, path), "")
          << m << " ranks " << layout_name(rl);
    }
  }
}

TEST_F(ShardedCheckpointBoxes, CorruptBlockOfABoxPieceIsNamedAndNothingIsWritten) {
  const Tensors model = make_model(4);
  save(2, Layout::dim1, model);
  const ShardedIndex index = read_index(dir());
  const ShardedPieceRef& piece = index.tensors.at("m").pieces[1];  // rank 1's columns [5, 10)
  ASSERT_EQ(piece.box, (Box{{0, 5}, {12, 10}}));
  const std::string path =
      (fs::path(dir()) / index.shards[static_cast<size_t>(piece.shard)].file).string();
  uint64_t at = 0;
  {
    SafetensorsReader r(path);
    at = r.header().data_start + r.header().find(piece.key)->begin;
  }
  std::string bytes = slurp(path);
  bytes[at + 1] ^= 0x10;  // element [0, 5] of m, in block 0 of the piece (elements 0-2)
  spit(path, bytes);

  for (int m : {1, 3}) {
    std::vector<std::vector<ShardPiece>> dst(static_cast<size_t>(m));
    const auto errors = LocalWorld::run_collect(world(m), [&](Communicator& c) {
      dst[static_cast<size_t>(c.rank())] =
          destinations(layout_pieces(Layout::dim0, model, c.rank(), c.size()));
      load_sharded(&c, dir(), dst[static_cast<size_t>(c.rank())]);
    });
    for (int r = 0; r < m; ++r) {
      ASSERT_TRUE(errors[static_cast<size_t>(r)]) << "rank " << r << " of " << m;
      const std::string msg = error_of<CheckpointError>(
          [&] { std::rethrow_exception(errors[static_cast<size_t>(r)]); });
      expect_has(msg, {path, "'m'", piece.key, "checksum"});
      EXPECT_TRUE(untouched(dst[static_cast<size_t>(r)])) << "rank " << r << " was written";
    }
  }
  // Only the blocks a load touches are read: rows 1.. of those columns, and
  // row 0's columns past the damaged block, still load.
  const Shape ms{12, 10};
  auto rest = destinations(
      {box_piece("m", ms, Box{{1, 5}, {12, 10}}, Tensor::empty(Shape{11, 5}, DType::f32)),
       box_piece("m", ms, Box{{0, 8}, {1, 10}}, Tensor::empty(Shape{1, 2}, DType::f32))});
  load_sharded(nullptr, dir(), rest);
  EXPECT_EQ(compare(model, rest), "");
  auto hit = destinations(
      {box_piece("m", ms, Box{{0, 4}, {2, 6}}, Tensor::empty(Shape{2, 2}, DType::f32))});
  expect_has(error_of<CheckpointError>([&] { load_sharded(nullptr, dir(), hit); }),
             {path, "'m'", "checksum"});
  EXPECT_TRUE(untouched(hit));
}

TEST_F(ShardedCheckpointBoxes, UncoveredElementsAreNamed) {
  const Tensors model = make_model(5);
  const Shape ms{12, 10};
  // Saving: ranks whose boxes leave columns [8, 10) of m to no one.
  const auto errors = LocalWorld::run_collect(world(2), [&](Communicator& c) {
    const Box b = c.rank() == 0 ? Box{{0, 0}, {12, 5}} : Box{{0, 5}, {12, 8}};
    std::vector<ShardPiece> pieces = {
        box_piece("m", ms, b, extract(model.at("m"), b, 0, b.elements()))};
    save_sharded(&c, dir(), pieces, {}, opts());
  });
  for (const auto& e : errors) {
    ASSERT_TRUE(e);
    expect_has(error_of<ConfigError>([&] { std::rethrow_exception(e); }),
               {"'m'", "elements [8, 10)", "element [0, 8]", "held by no rank"});
  }
  EXPECT_FALSE(is_sharded_checkpoint(dir()));

  // Loading: an index that lost rank 1's column shard of m.
  save(2, Layout::dim1, model);
  edit_index(dir(), [](nlohmann::json& j) {
    auto& pieces = j["tensors"]["m"]["pieces"];
    pieces.erase(pieces.begin() + 1);  // columns [5, 10)
  });
  auto all = destinations(layout_pieces(Layout::replicated, model, 0, 1));
  expect_has(error_of<CheckpointError>([&] { load_sharded(nullptr, dir(), all); }),
             {"'m'", "elements [5, 10)", "from element [0, 5]", "no piece"});
  EXPECT_TRUE(untouched(all));
  auto box = destinations(
      {box_piece("m", ms, Box{{3, 2}, {5, 7}}, Tensor::empty(Shape{2, 5}, DType::f32))});
  expect_has(error_of<CheckpointError>([&] { load_sharded(nullptr, dir(), box); }),
             {"'m'", "elements [35, 37)", "from element [3, 5]", "box [3:5, 2:7]", "no piece"});
  // The columns still there load.
  auto left = destinations(layout_pieces(Layout::dim1, model, 0, 2));
  load_sharded(nullptr, dir(), left);
  EXPECT_EQ(compare(model, left), "");
}

TEST_F(ShardedCheckpointBoxes, HelpersCheckTheirBoxes) {
  const Tensor local = Tensor::zeros(Shape{12, 5}, DType::f32);
  const TensorPlace place{Shape{12, 10}, Box{{0, 5}, {12, 10}}};
  const ShardPiece p = in_box(slice_piece("m", local, 7, 31), place);
  EXPECT_EQ(p.full_shape, Shape({12, 10}));
  EXPECT_EQ(p.box, place.box);
  EXPECT_EQ(std::pair(p.begin, p.end), std::pair(int64_t{7}, int64_t{31}));
  EXPECT_EQ(p.data.raw(), static_cast<const float*>(local.raw()) + 7) << "a view, not a copy";
  // A box inside the local tensor shifts by the place's origin.
  const ShardPiece inner = in_box(
      box_piece("m", Shape{12, 5}, Box{{2, 1}, {4, 3}}, Tensor::zeros(Shape{2, 2}, DType::f32)),
      place);
  EXPECT_EQ(inner.box, (Box{{2, 6}, {4, 8}}));
  // in_boxes: listed names only.
  const auto mapped =
      in_boxes({full_piece("m", local), full_piece("b", Tensor::zeros(Shape{3}, DType::f32))},
               {{"m", place}});
  EXPECT_EQ(mapped[0].box, place.box);
  EXPECT_TRUE(mapped[1].box.begin.empty());
  EXPECT_EQ(mapped[1].full_shape, Shape({3}));

  expect_has(error_of<ConfigError>([&] {
               in_box(full_piece("m", Tensor::zeros(Shape{12, 4}, DType::f32)), place);
             }),
             {"'m'", "[12, 4]", "[12, 5]"});
  expect_has(error_of<ConfigError>([&] {
               box_piece("m", Shape{12, 10}, Box{{0, 5}, {12, 11}},
                         Tensor::zeros(Shape{12, 6}, DType::f32));
             }),
             {"'m'", "[0:12, 5:11]", "[12, 10]"});
  EXPECT_THROW(box_piece("m", Shape{12, 10}, place.box, Tensor::zeros(Shape{12, 4}, DType::f32)),
               ShapeError);
  // save_sharded checks boxes as well.
  ShardPiece bad =
      box_piece("m", Shape{12, 10}, place.box, Tensor::zeros(Shape{12, 5}, DType::f32));
  bad.box.end[0] = 13;
  expect_has(error_of<ConfigError>(
                 [&] { save_sharded(nullptr, dir(), std::vector<ShardPiece>{bad}, {}, opts()); }),
             {"'m'", "[0:13, 5:10]", "does not fit"});
  bad.box.end[0] = 12;
  bad.end = 61;
  bad.data = Tensor::zeros(Shape{61}, DType::f32);
  expect_has(error_of<ConfigError>(
                 [&] { save_sharded(nullptr, dir(), std::vector<ShardPiece>{bad}, {}, opts()); }),
             {"'m'", "[0, 61)", "60 elements"});
}

}  // namespace
}  // namespace mt
