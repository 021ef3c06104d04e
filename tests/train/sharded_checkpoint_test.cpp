// Sharded checkpoints: written by N ranks in one piece layout, read by M
// ranks in another (N, M in 1..4; whole tensors on rank 0, even chunks,
// bucket chunks that cut tensors anywhere, sync's ZeRO shards, replicas,
// empty pieces) bitwise equal to the original; the index lists the pieces;
// tampered, truncated and missing files and uncovered or mismatching
// requests are named; a save that fails anywhere leaves the previous
// checkpoint loadable; single-process loads and conversion to one file.
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "meshtrain/comm/backends/local/local_world.h"
#include "meshtrain/sync/buckets.h"
#include "meshtrain/train/optimizer.h"
#include "meshtrain/train/sharded_checkpoint.h"
#include "meshtrain/train/train_state.h"

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

// Random bit patterns (so any misplaced byte shows), several dtypes, a
// zero-size tensor, sizes that no world size divides.
Tensors make_model(uint32_t seed) {
  const std::vector<std::tuple<std::string, Shape, DType>> specs = {
      {"param/a", Shape({5, 7}), DType::f32},         {"param/b", Shape({13}), DType::f32},
      {"param/empty", Shape({0, 4}), DType::f32},     {"param/h", Shape({3, 3}), DType::bf16},
      {"optim/a.exp_avg", Shape({5, 7}), DType::f32}, {"optim/b.exp_avg", Shape({13}), DType::f32},
      {"buf/count", Shape({3}), DType::i64},          {"param/one", Shape({1}), DType::f32}};
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

enum class Layout { rank0_full, even, buckets, zero, replicated };
const char* layout_name(Layout l) {
  switch (l) {
    case Layout::rank0_full:
      return "rank0_full";
    case Layout::even:
      return "even";
    case Layout::buckets:
      return "buckets";
    case Layout::zero:
      return "zero";
    case Layout::replicated:
      return "replicated";
  }
  return "?";
}

// ZeRO-like: all tensors, in name order, laid end to end in one flat element
// space, cut into buckets of 23 elements; each bucket is split among the
// ranks in chunks of ceil(len / size) (so the last ranks' chunks may be
// short or empty). Every rank also names every tensor with an empty piece
// (odd ranks without data, so without a dtype).
std::vector<ShardPiece> bucket_pieces(const Tensors& model, int rank, int size) {
  constexpr int64_t kBucket = 23;
  std::vector<ShardPiece> out;
  int64_t total = 0;
  for (const auto& [name, t] : model) {
    out.push_back(slice_piece(name, t, 0, 0));
    if (rank % 2 == 1) out.back().data = Tensor();
    total += t.numel();
  }
  for (int64_t b0 = 0; b0 < total; b0 += kBucket) {
    const int64_t len = std::min(kBucket, total - b0);
    const int64_t chunk = (len + size - 1) / size;
    const int64_t lo = b0 + std::min(len, rank * chunk);
    const int64_t hi = b0 + std::min(len, (rank + 1) * chunk);
    int64_t at = 0;  // flat start of the current tensor
    for (const auto& [name, t] : model) {
      const int64_t b = std::max(lo, at), e = std::min(hi, at + t.numel());
      if (b < e) out.push_back(slice_piece(name, t, b - at, e - at));
      at += t.numel();
    }
  }
  return out;
}

// sync's own ZeRO shards (sync/buckets.h) of the f32 tensors laid end to
// end, in buckets of 12 elements formed from the last tensor back; other
// dtypes in even chunks.
std::vector<ShardPiece> zero_pieces(const Tensors& model, int rank, int size) {
  ParamLayout layout;
  int64_t flat = 0;
  std::vector<ShardPiece> out;
  for (const auto& [name, t] : model) {
    if (t.dtype() != DType::f32) {
      const auto [b, e] = even_range(t.numel(), rank, size);
      out.push_back(slice_piece(name, t, b, e));
      continue;
    }
    layout.push_back({name, t.shape(), flat});
    flat += t.numel();
  }
  const BucketPlan plan(layout, flat, 12 * 4, size, rank);
  for (size_t i = 0; i < layout.size(); ++i) {
    const OwnedRange& o = plan.owned(static_cast<int>(i));
    out.push_back(slice_piece(layout[i].name, model.at(layout[i].name), o.begin, o.end));
  }
  return out;
}

std::vector<ShardPiece> layout_pieces(Layout l, const Tensors& model, int rank, int size) {
  std::vector<ShardPiece> out;
  switch (l) {
    case Layout::rank0_full:
      if (rank == 0) {
        for (const auto& [name, t] : model) out.push_back(full_piece(name, t));
      }
      return out;
    case Layout::even:
      return even_pieces(model, rank, size);
    case Layout::buckets:
      return bucket_pieces(model, rank, size);
    case Layout::zero:
      return zero_pieces(model, rank, size);
    case Layout::replicated:
      for (const auto& [name, t] : model) out.push_back(full_piece(name, t));
      return out;
  }
  return out;
}

// The same ranges as `like`, with fresh destination memory holding a
// sentinel pattern.
std::vector<ShardPiece> destinations(const std::vector<ShardPiece>& like) {
  std::vector<ShardPiece> out;
  for (const ShardPiece& p : like) {
    ShardPiece d = p;
    if (p.data.defined()) d.data = Tensor::empty(Shape{p.end - p.begin}, p.data.dtype());
    if (p.end > p.begin) std::memset(d.data.raw(), 0xA5, d.data.nbytes());
    out.push_back(std::move(d));
  }
  return out;
}

// "" when every destination holds exactly the model's bytes for its range.
std::string compare(const Tensors& model, const std::vector<ShardPiece>& got) {
  for (const ShardPiece& p : got) {
    const Tensor& t = model.at(p.name);
    const size_t es = dtype_size(t.dtype());
    const auto* want = static_cast<const char*>(t.raw()) + p.begin * static_cast<int64_t>(es);
    if (p.end > p.begin && std::memcmp(p.data.raw(), want, p.data.nbytes()) != 0) {
      return fmt::format("'{}' [{}, {}) differs", p.name, p.begin, p.end);
    }
  }
  return "";
}

bool untouched(const std::vector<ShardPiece>& got) {
  for (const ShardPiece& p : got) {
    if (p.end == p.begin) continue;
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

class ShardedCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           fmt::format("mt-sharded-{}-{}", ::getpid(),
                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string dir(const std::string& sub = "ckpt") const { return (dir_ / sub).string(); }
  std::vector<std::string> files(const std::string& sub = "ckpt") const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_ / sub)) out.push_back(e.path().filename());
    std::sort(out.begin(), out.end());
    return out;
  }

  // Small blocks, so reads of a few elements touch partial blocks.
  static SaveShardedOptions opts(const std::string& mode = "test") {
    SaveShardedOptions o;
    o.mode = mode;
    o.block_bytes = 12;
    return o;
  }

  void save(int n, Layout l, const Tensors& model, const std::string& sub = "ckpt",
            std::map<std::string, std::string> meta = {{"step", "7"}}) {
    LocalWorld::run(world(n), [&](Communicator& c) {
      save_sharded(&c, dir(sub), layout_pieces(l, model, c.rank(), c.size()), meta,
                   opts(layout_name(l)));
    });
  }

  // Loads into M ranks with layout l; returns per-rank comparison failures.
  std::string load_and_compare(int m, Layout l, const Tensors& model,
                               const std::string& sub = "ckpt") {
    std::vector<std::string> bad(static_cast<size_t>(m));
    LocalWorld::run(world(m), [&](Communicator& c) {
      auto want = destinations(layout_pieces(l, model, c.rank(), c.size()));
      load_sharded(&c, dir(sub), want);
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

// The shard file written by `rank`, per the index.
std::string shard_of(const ShardedIndex& index, int rank) {
  for (const auto& s : index.shards) {
    if (s.rank == rank) return s.file;
  }
  ADD_FAILURE() << "no shard of rank " << rank;
  return "";
}

// Rewrites index.json after `edit`, with a valid checksum (as a writer
// that lists other pieces would).
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

TEST_F(ShardedCheckpoint, AnyWriterLayoutLoadsIntoAnyReaderLayout) {
  const Tensors model = make_model(1);
  for (int n = 1; n <= 4; ++n) {
    for (Layout wl :
         {Layout::rank0_full, Layout::even, Layout::buckets, Layout::zero, Layout::replicated}) {
      const std::string sub = fmt::format("w{}-{}", n, layout_name(wl));
      save(n, wl, model, sub);
      for (int m = 1; m <= 4; ++m) {
        for (Layout rl : {Layout::even, Layout::buckets, Layout::zero, Layout::replicated}) {
          EXPECT_EQ(load_and_compare(m, rl, model, sub), "")
              << "written by " << n << " ranks " << layout_name(wl) << ", read by " << m
              << " ranks " << layout_name(rl);
        }
      }
      const CheckpointContents whole = load_sharded_full(dir(sub));
      ASSERT_EQ(whole.tensors.size(), model.size());
      for (const auto& [name, t] : model) {
        const Tensor& got = whole.tensors.at(name);
        EXPECT_EQ(got.desc(), t.desc()) << name;
        EXPECT_EQ(std::memcmp(got.raw(), t.raw(), t.nbytes()), 0) << name << " from " << sub;
      }
      EXPECT_EQ(whole.metadata.at("step"), "7");
    }
  }
}

TEST_F(ShardedCheckpoint, WithoutCommunicatorWritesAndReadsOneShard) {
  const Tensors model = make_model(2);
  save_sharded(nullptr, dir(), layout_pieces(Layout::buckets, model, 0, 1), {{"k", "v"}}, opts());
  auto want = destinations(layout_pieces(Layout::even, model, 1, 3));
  const ShardedIndex index = load_sharded(nullptr, dir(), want);
  EXPECT_EQ(compare(model, want), "");
  EXPECT_EQ(index.world_size, 1);
  EXPECT_EQ(index.metadata.at("k"), "v");
  ASSERT_EQ(index.shards.size(), 1u);
  EXPECT_EQ(files(), (std::vector<std::string>{"index.json", index.shards[0].file}));
}

TEST_F(ShardedCheckpoint, IndexListsEveryRanksPieces) {
  const Tensors model = make_model(3);
  save(3, Layout::buckets, model, "ckpt", {{"step", "12"}, {"optimizer", "adamw"}});
  const ShardedIndex index = read_index(dir());
  EXPECT_EQ(index.world_size, 3);
  EXPECT_EQ(index.mode, "buckets");
  EXPECT_EQ(index.metadata,
            (std::map<std::string, std::string>{{"step", "12"}, {"optimizer", "adamw"}}));
  ASSERT_EQ(index.shards.size(), 3u);
  std::vector<std::string> want_files = {"index.json"};
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(index.shards[static_cast<size_t>(r)].rank, r);
    EXPECT_EQ(index.shards[static_cast<size_t>(r)].bytes,
              fs::file_size(fs::path(dir()) / index.shards[static_cast<size_t>(r)].file));
    want_files.push_back(index.shards[static_cast<size_t>(r)].file);
  }
  std::sort(want_files.begin(), want_files.end());
  EXPECT_EQ(files(), want_files);
  ASSERT_EQ(index.tensors.size(), model.size());
  for (const auto& [name, t] : model) {
    const ShardedTensorInfo& info = index.tensors.at(name);
    EXPECT_EQ(info.dtype, t.dtype()) << name;
    EXPECT_EQ(info.shape, t.shape()) << name;
    // Exactly the non-empty pieces of the layout, each in its rank's shard.
    std::vector<std::tuple<int64_t, int64_t, int>> want, got;
    for (int r = 0; r < 3; ++r) {
      for (const ShardPiece& p : bucket_pieces(model, r, 3)) {
        if (p.name == name && p.end > p.begin) want.emplace_back(p.begin, p.end, r);
      }
    }
    for (const ShardedPieceRef& p : info.pieces) {
      got.emplace_back(p.begin, p.end, index.shards[static_cast<size_t>(p.shard)].rank);
      EXPECT_EQ(p.key, fmt::format("{}@{}-{}", name, p.begin, p.end));
    }
    std::sort(want.begin(), want.end());
    EXPECT_EQ(got, want) << name;
  }
  EXPECT_TRUE(index.tensors.at("param/empty").pieces.empty());
  EXPECT_GT(index.tensors.at("param/a").pieces.size(), 1u) << "buckets split it";
}

TEST_F(ShardedCheckpoint, TamperedShardIsNamedOnEveryRankAndNothingIsWritten) {
  const Tensors model = make_model(4);
  save(2, Layout::even, model);
  const ShardedIndex index = read_index(dir());
  const std::string file = shard_of(index, 1);
  const std::string path = (fs::path(dir()) / file).string();
  // Flip the first byte of rank 1's piece of param/a ([18, 35)).
  const auto [b, e] = even_range(35, 1, 2);
  const std::string key = fmt::format("param/a@{}-{}", b, e);
  uint64_t at = 0;
  {
    SafetensorsReader r(path);
    at = r.header().data_start + r.header().find(key)->begin;
  }
  std::string bytes = slurp(path);
  bytes[at] ^= 0x01;
  spit(path, bytes);

  for (int m : {1, 3}) {
    std::vector<std::vector<ShardPiece>> dst(static_cast<size_t>(m));
    const auto errors = LocalWorld::run_collect(world(m), [&](Communicator& c) {
      dst[static_cast<size_t>(c.rank())] =
          destinations(layout_pieces(Layout::even, model, c.rank(), c.size()));
      load_sharded(&c, dir(), dst[static_cast<size_t>(c.rank())]);
    });
    for (int r = 0; r < m; ++r) {
      ASSERT_TRUE(errors[static_cast<size_t>(r)]) << "rank " << r << " of " << m;
      const std::string msg = error_of<CheckpointError>(
          [&] { std::rethrow_exception(errors[static_cast<size_t>(r)]); });
      expect_has(msg, {file, "'param/a'", key, "checksum"});
      EXPECT_TRUE(untouched(dst[static_cast<size_t>(r)])) << "rank " << r << " was written";
    }
  }

  // Ranges outside the damaged block still load: only touched blocks are read.
  auto tail = destinations({slice_piece("param/a", model.at("param/a"), b + 3, e),
                            full_piece("param/b", model.at("param/b"))});
  load_sharded(nullptr, dir(), tail);
  EXPECT_EQ(compare(model, tail), "");
  auto head = destinations({slice_piece("param/a", model.at("param/a"), b, b + 1)});
  expect_has(error_of<CheckpointError>([&] { load_sharded(nullptr, dir(), head); }),
             {path, "'param/a'"});
}

TEST_F(ShardedCheckpoint, TruncatedMissingAndDamagedFilesAreNamed) {
  const Tensors model = make_model(5);
  save(2, Layout::even, model);
  const ShardedIndex index = read_index(dir());
  const std::string f1 = (fs::path(dir()) / shard_of(index, 1)).string();
  const uint64_t size = fs::file_size(f1);
  auto all = destinations(layout_pieces(Layout::replicated, model, 0, 1));

  fs::resize_file(f1, size - 10);
  expect_has(error_of<CheckpointError>([&] { load_sharded(nullptr, dir(), all); }),
             {f1, "truncated", std::to_string(size - 10), std::to_string(size)});
  // Rank 0's shard alone still serves what it holds.
  auto first = destinations(layout_pieces(Layout::even, model, 0, 2));
  load_sharded(nullptr, dir(), first);
  EXPECT_EQ(compare(model, first), "");

  fs::remove(f1);
  expect_has(error_of<FileError>([&] { load_sharded(nullptr, dir(), all); }), {f1, "rank 1"});

  const std::string idx = slurp(sharded_index_path(dir()));
  std::string damaged = idx;
  damaged[damaged.find("\"step\"") + 2] = 'X';
  spit(sharded_index_path(dir()), damaged);
  expect_has(error_of<CheckpointError>([&] { read_index(dir()); }),
             {sharded_index_path(dir()), "checksum mismatch"});
  spit(sharded_index_path(dir()), idx.substr(0, idx.size() / 2));
  expect_has(error_of<CheckpointError>([&] { read_index(dir()); }),
             {sharded_index_path(dir()), "JSON"});

  fs::remove(sharded_index_path(dir()));
  EXPECT_FALSE(is_sharded_checkpoint(dir()));
  const auto errors = LocalWorld::run_collect(world(2), [&](Communicator& c) {
    auto want = destinations(layout_pieces(Layout::even, model, c.rank(), c.size()));
    load_sharded(&c, dir(), want);
  });
  for (const auto& e : errors) {
    ASSERT_TRUE(e);
    // Says in words that the save stopped part-way, and which shards are there.
    expect_has(error_of<FileError>([&] { std::rethrow_exception(e); }),
               {dir(), "no index.json -- the save did not complete", "rank shards present",
                shard_of(index, 0)});
  }
  fs::remove(fs::path(dir()) / shard_of(index, 0));
  expect_has(error_of<FileError>([&] { read_index(dir()); }),
             {dir(), "no index.json and no shard files"});
  expect_has(error_of<FileError>([&] { read_index(dir() + "/nope"); }), {"nope", "does not exist"});
}

TEST_F(ShardedCheckpoint, UncoveredOrMismatchingRequestsAreNamed) {
  const Tensors model = make_model(6);
  save(2, Layout::even, model);
  auto want = [&](const std::string& name) {
    return destinations({full_piece(name, model.at(name))});
  };
  // A shape or dtype other than the checkpoint's.
  ShardPiece flat = full_piece("param/a", model.at("param/a").reshape(Shape{35}));
  expect_has(error_of<CheckpointError>([&] { load_sharded(nullptr, dir(), destinations({flat})); }),
             {"'param/a'", "f32[5, 7]", "f32[35]"});
  ShardPiece as_f64 = full_piece("param/b", Tensor::zeros(Shape{13}, DType::f64));
  expect_has(
      error_of<CheckpointError>([&] { load_sharded(nullptr, dir(), destinations({as_f64})); }),
      {"'param/b'", "f64"});
  ShardPiece unknown = full_piece("param/zzz", Tensor::zeros(Shape{2}, DType::f32));
  expect_has(
      error_of<CheckpointError>([&] { load_sharded(nullptr, dir(), destinations({unknown})); }),
      {"'param/zzz'", "not in the checkpoint"});
  ShardPiece outside = slice_piece("param/b", model.at("param/b"), 0, 13);
  outside.end = 14;
  outside.data = Tensor::zeros(Shape{14}, DType::f32);
  EXPECT_THROW(load_sharded(nullptr, dir(), std::vector<ShardPiece>{outside}), ConfigError);

  // An index whose pieces leave elements of param/b uncovered.
  edit_index(dir(), [](nlohmann::json& j) {
    auto& pieces = j["tensors"]["param/b"]["pieces"];
    pieces.erase(pieces.begin() + 1);  // [7, 13)
  });
  expect_has(error_of<CheckpointError>([&] { load_sharded(nullptr, dir(), want("param/b")); }),
             {"'param/b'", "[7, 13)", "no piece"});
  auto head = destinations({slice_piece("param/b", model.at("param/b"), 0, 7)});
  load_sharded(nullptr, dir(), head);
  EXPECT_EQ(compare(model, head), "");
}

TEST_F(ShardedCheckpoint, BadPiecesFailTheSaveOnEveryRank) {
  const Tensors model = make_model(7);
  // Elements of param/b that no rank holds.
  auto errors = LocalWorld::run_collect(world(3), [&](Communicator& c) {
    auto pieces = layout_pieces(Layout::even, model, c.rank(), c.size());
    if (c.rank() == 2) {
      std::erase_if(pieces, [](const ShardPiece& p) { return p.name == "param/b"; });
    }
    save_sharded(&c, dir(), pieces, {}, opts());
  });
  for (const auto& e : errors) {
    expect_has(error_of<ConfigError>([&] { std::rethrow_exception(e); }),
               {"'param/b'", "[9, 13)", "held by no rank"});
  }
  EXPECT_FALSE(fs::exists(dir()) && is_sharded_checkpoint(dir()));

  // Ranks that disagree on a tensor's shape; data that does not fit its range.
  errors = LocalWorld::run_collect(world(2), [&](Communicator& c) {
    auto pieces = layout_pieces(Layout::even, model, c.rank(), c.size());
    if (c.rank() == 1) pieces[0].full_shape = Shape{999};
    save_sharded(&c, dir(), pieces, {}, opts());
  });
  for (const auto& e : errors) EXPECT_THROW(std::rethrow_exception(e), ConfigError);
  errors = LocalWorld::run_collect(world(2), [&](Communicator& c) {
    auto pieces = layout_pieces(Layout::even, model, c.rank(), c.size());
    if (c.rank() == 1) pieces[1].data = Tensor::zeros(Shape{1}, DType::f32);
    save_sharded(&c, dir(), pieces, {}, opts());
  });
  for (const auto& e : errors) {
    expect_has(error_of<ShapeError>([&] { std::rethrow_exception(e); }), {"rank 1 of 2"});
  }
  EXPECT_THROW(save_sharded(nullptr, dir(), {}, {{"crc32/x", "1"}}), ConfigError);
}

TEST_F(ShardedCheckpoint, FailedOverwriteKeepsThePreviousCheckpoint) {
  const Tensors old_model = make_model(8);
  const Tensors new_model = make_model(9);
  save(3, Layout::buckets, old_model);
  const std::vector<std::string> old_files = files();

  for (const char* stage : {"shard", "index"}) {
    const int victim = std::string(stage) == "shard" ? 1 : 0;
    const auto errors = LocalWorld::run_collect(world(2), [&](Communicator& c) {
      SaveShardedOptions o = opts();
      o.fault_injection = [&](std::string_view s, int rank) {
        if (s == stage && rank == victim) throw FileError(fmt::format("injected at {}", s));
      };
      save_sharded(&c, dir(), layout_pieces(Layout::even, new_model, c.rank(), c.size()), {}, o);
    });
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(errors[static_cast<size_t>(r)]) << stage << " rank " << r;
      expect_has(
          error_of<FileError>([&] { std::rethrow_exception(errors[static_cast<size_t>(r)]); }),
          {fmt::format("injected at {}", stage), fmt::format("rank {} of 2", victim)});
    }
    EXPECT_EQ(files(), old_files) << "new shards were removed after failing at " << stage;
    EXPECT_EQ(load_and_compare(2, Layout::even, old_model), "") << stage;
  }

  // A rank whose thread dies instead of saving: the others fail, and the
  // old checkpoint still loads.
  const auto errors = LocalWorld::run_collect(world(2), [&](Communicator& c) {
    if (c.rank() == 1) throw std::runtime_error("rank 1 crashed");
    save_sharded(&c, dir(), layout_pieces(Layout::even, new_model, c.rank(), c.size()), {}, opts());
  });
  EXPECT_THROW(std::rethrow_exception(errors[0]), CommError);
  EXPECT_EQ(load_and_compare(3, Layout::even, old_model), "");

  // What a process killed mid-save leaves: a shard the index never named
  // and a temporary. The next good save removes them with the old shards.
  spit((fs::path(dir()) / "shard-1-of-2-00000000deadbeef.safetensors").string(), "orphan");
  spit((fs::path(dir()) / ".shard-0-of-2-00000000deadbeef.safetensors.tmp-1-2").string(), "x");

  save(2, Layout::even, new_model);
  EXPECT_EQ(load_and_compare(3, Layout::buckets, new_model), "");
  const ShardedIndex index = read_index(dir());
  EXPECT_EQ(index.world_size, 2);
  std::vector<std::string> want = {"index.json", index.shards[0].file, index.shards[1].file};
  std::sort(want.begin(), want.end());
  EXPECT_EQ(files(), want) << "old and orphaned shards deleted";
}

// Resume across modes: AdamW for 2 steps on 4 ranks holding 1/4 of every
// parameter and its state (ZeRO-3), saved; 2 steps on 2 plain data-parallel
// replicas loaded from it, saved as halves; 2 steps in one process loaded
// from that. Parameters and optimizer state equal the uninterrupted run's
// bitwise (AdamW is element-wise, so slices step exactly like wholes).
struct AdamRun {
  std::map<std::string, Shape> shapes = {{"w", Shape({6, 5})}, {"b", Shape({7})}};

  static float init(int64_t i) { return 0.05f * static_cast<float>(i % 11) - 0.2f; }
  static float grad(const std::string& name, int64_t i, int step) {
    return std::sin(0.37f * static_cast<float>(i) + 1.3f * static_cast<float>(step)) +
           (name == "b" ? 0.5f : 0.0f);
  }
  // Steps [from, to) on elements [begin, end) of each parameter.
  static void steps(Optimizer& opt, std::map<std::string, Tensor>& slices,
                    const std::map<std::string, std::pair<int64_t, int64_t>>& ranges,
                    const std::map<std::string, Shape>& shapes, int from, int to) {
    for (int s = from; s < to; ++s) {
      std::vector<ParamRef> refs;
      for (auto& [name, t] : slices) {
        const auto [b, e] = ranges.at(name);
        Tensor g = Tensor::empty(Shape{e - b}, DType::f32);
        for (int64_t i = b; i < e; ++i) g.data<float>()[i - b] = grad(name, i, s);
        refs.push_back({name, t, g, shapes.at(name).rank()});
      }
      opt.step(refs, 0.01);
    }
  }
  // The parameters' and state's pieces for the given ranges.
  static std::vector<ShardPiece> pieces(
      const std::map<std::string, Tensor>& slices, const OptimizerState& state,
      const std::map<std::string, std::pair<int64_t, int64_t>>& ranges,
      const std::map<std::string, Shape>& shapes) {
    std::vector<ShardPiece> params, optim;
    for (const auto& [name, t] : slices) {
      const auto [b, e] = ranges.at(name);
      params.push_back({name, shapes.at(name), b, e, t});
    }
    for (const auto& [key, t] : state.tensors) {
      const std::string param = key.substr(0, key.find('.'));
      const auto [b, e] = ranges.at(param);
      optim.push_back({key, shapes.at(param), b, e, t});
    }
    auto out = with_prefix(std::move(params), "param/");
    for (ShardPiece& p : with_prefix(std::move(optim), "optim/")) out.push_back(std::move(p));
    return out;
  }
  std::map<std::string, std::string> meta(const OptimizerState& state, int step) const {
    std::map<std::string, std::string> m = {{"optimizer", "adamw"}, {"step", std::to_string(step)}};
    for (const auto& [name, n] : state.steps) m["optim_step/" + name] = std::to_string(n);
    return m;
  }
  // Whole parameters and zeroed whole state, as a replica allocates them.
  std::pair<std::map<std::string, Tensor>, OptimizerState> fresh() const {
    std::map<std::string, Tensor> params;
    OptimizerState state;
    for (const auto& [name, shape] : shapes) {
      params.emplace(name, Tensor::zeros(Shape{shape.numel()}, DType::f32));
      for (const char* kind : {"exp_avg", "exp_avg_sq"}) {
        state.tensors.emplace(name + "." + kind, Tensor::zeros(Shape{shape.numel()}, DType::f32));
      }
    }
    return {params, state};
  }
  std::map<std::string, std::pair<int64_t, int64_t>> ranges(int rank, int size) const {
    std::map<std::string, std::pair<int64_t, int64_t>> r;
    for (const auto& [name, shape] : shapes) r[name] = even_range(shape.numel(), rank, size);
    return r;
  }
};

TEST_F(ShardedCheckpoint, ResumeAcrossModesContinuesExactly) {
  AdamRun run;
  AdamWOptions ao;
  ao.weight_decay = 0.1;

  // The uninterrupted reference: one process, 6 steps.
  auto [ref_params, unused] = run.fresh();
  for (auto& [name, t] : ref_params) {
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = AdamRun::init(i);
  }
  auto ref_opt = make_adamw(ao);
  AdamRun::steps(*ref_opt, ref_params, run.ranges(0, 1), run.shapes, 0, 6);

  // 4 ranks, ZeRO-3: steps 0-1.
  LocalWorld::run(world(4), [&](Communicator& c) {
    const auto ranges = run.ranges(c.rank(), c.size());
    std::map<std::string, Tensor> slices;
    for (const auto& [name, r] : ranges) {
      Tensor t = Tensor::empty(Shape{r.second - r.first}, DType::f32);
      for (int64_t i = r.first; i < r.second; ++i) t.data<float>()[i - r.first] = AdamRun::init(i);
      slices.emplace(name, t);
    }
    auto opt = make_adamw(ao);
    AdamRun::steps(*opt, slices, ranges, run.shapes, 0, 2);
    save_sharded(&c, dir("a"), AdamRun::pieces(slices, opt->state(), ranges, run.shapes),
                 run.meta(opt->state(), 2), opts("zero3"));
  });

  // 2 replicas, plain DP: load everything, steps 2-3, each saves half.
  LocalWorld::run(world(2), [&](Communicator& c) {
    auto [params, state] = run.fresh();
    const auto whole = run.ranges(0, 1);
    const ShardedIndex index =
        load_sharded(&c, dir("a"), AdamRun::pieces(params, state, whole, run.shapes));
    for (const auto& [name, shape] : run.shapes) {
      state.steps[name] = std::stoll(index.metadata.at("optim_step/" + name));
    }
    auto opt = make_adamw(ao);
    opt->load_state(state);
    AdamRun::steps(*opt, params, whole, run.shapes, 2, 4);
    // Each replica writes its half: views of its whole tensors.
    std::vector<ShardPiece> half;
    for (ShardPiece& p : AdamRun::pieces(params, opt->state(), whole, run.shapes)) {
      const auto [b, e] = even_range(p.end, c.rank(), c.size());
      half.push_back(slice_piece(p.name, p.data, b, e));
      half.back().full_shape = p.full_shape;
    }
    save_sharded(&c, dir("b"), half, run.meta(opt->state(), 4), opts("dp"));
  });

  // One process: steps 4-5.
  const CheckpointContents c = load_sharded_full(dir("b"));
  EXPECT_EQ(c.metadata.at("step"), "4");
  std::map<std::string, Tensor> params;
  OptimizerState state;
  for (const auto& [name, t] : c.tensors) {
    if (name.starts_with("param/")) params.emplace(name.substr(6), t.reshape(Shape{t.numel()}));
    if (name.starts_with("optim/")) {
      state.tensors.emplace(name.substr(6), t.reshape(Shape{t.numel()}));
    }
  }
  for (const auto& [name, shape] : run.shapes) {
    state.steps[name] = std::stoll(c.metadata.at("optim_step/" + name));
  }
  auto opt = make_adamw(ao);
  opt->load_state(state);
  AdamRun::steps(*opt, params, run.ranges(0, 1), run.shapes, 4, 6);

  for (const auto& [name, t] : ref_params) {
    EXPECT_EQ(std::memcmp(params.at(name).raw(), t.raw(), t.nbytes()), 0) << name;
  }
  const OptimizerState ref_state = ref_opt->state();
  EXPECT_EQ(opt->state().steps, ref_state.steps);
  for (const auto& [key, t] : ref_state.tensors) {
    EXPECT_EQ(std::memcmp(opt->state().tensors.at(key).raw(), t.raw(), t.nbytes()), 0) << key;
  }
}

TEST_F(ShardedCheckpoint, ConvertsToASingleFileTrainState) {
  // A ZeRO-3 style state of 4 ranks -> one file that load_train_state reads.
  const Tensors model = make_model(10);
  Tensors state;
  for (const auto& [name, t] : model) {
    if (t.dtype() == DType::f32 && (name.starts_with("param/") || name.starts_with("optim/"))) {
      state.emplace(name, t);
    }
  }
  const std::map<std::string, std::string> meta = {
      {"optimizer", "adamw"},          {"step", "40"},         {"epoch", "2"},
      {"rng_position", "1234"},        {"lr_step", "40"},      {"loss_scale", "1024"},
      {"loss_scale_good_steps", "17"}, {"optim_step/a", "40"}, {"optim_step/b", "39"}};
  LocalWorld::run(world(4), [&](Communicator& c) {
    save_sharded(&c, dir(), bucket_pieces(state, c.rank(), c.size()), meta, opts("zero3"));
  });
  const std::string file = (dir_ / "single.ckpt").string();
  convert_sharded_to_checkpoint(dir(), file);

  TrainState ts;
  ts.optimizer = "adamw";
  for (const auto& [name, t] : state) {
    if (name.starts_with("param/"))
      ts.params.emplace(name.substr(6), Tensor::zeros(t.shape(), t.dtype()));
  }
  load_train_state(file, ts);
  EXPECT_EQ(ts.step, 40);
  EXPECT_EQ(ts.epoch, 2);
  EXPECT_EQ(ts.rng_position, 1234u);
  EXPECT_EQ(ts.loss_scaler.scale, 1024.0);
  EXPECT_EQ(ts.optimizer_state.steps.at("b"), 39);
  for (const auto& [name, t] : state) {
    const Tensor& got = name.starts_with("param/") ? ts.params.at(name.substr(6))
                                                   : ts.optimizer_state.tensors.at(name.substr(6));
    EXPECT_EQ(std::memcmp(got.raw(), t.raw(), t.nbytes()), 0) << name;
  }
  // Both forms load whole through one call.
  for (const std::string& p : {dir(), file}) {
    const CheckpointContents c = load_any_checkpoint(p);
    EXPECT_EQ(c.tensors.size(), state.size()) << p;
    EXPECT_EQ(c.metadata.at("step"), "40") << p;
  }
}

}  // namespace
}  // namespace mt
