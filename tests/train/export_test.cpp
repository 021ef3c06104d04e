// Weights in and out (train/export.h): export -> import gives bitwise the
// same parameters for the MLP, CNN and GPT; checkpoints of any layout
// (single file, sharded by several ranks) export alike; a file whose
// recorded layout is not PyTorch's is refused even when every matrix is
// square; a file without metadata loads with the assumption said; every
// mismatch is listed unless a partial load is asked for, which loads what
// matches and reports the rest; a Trainer starts from such a file.
#include <gtest/gtest.h>

#include <cstring>

#include "common/temp_dir.h"
#include "meshtrain/comm/backends/local/local_world.h"
#include "meshtrain/data/fashion_mnist.h"
#include "meshtrain/models/torch_names.h"
#include "meshtrain/train/checkpoint.h"
#include "meshtrain/train/export.h"
#include "meshtrain/train/param_store.h"
#include "meshtrain/train/safetensors.h"
#include "meshtrain/train/sharded_checkpoint.h"
#include "meshtrain/train/trainer.h"

namespace mt {
namespace {

using Tensors = std::map<std::string, Tensor>;
using mt::testing::TempDir;

ModelSpec spec_of(const std::string& kind) {
  ModelSpec s;
  s.kind = kind;
  s.hidden = {12, 7};
  s.image_size = 8;
  s.conv_channels = {3, 5};
  s.fc = 6;
  s.layers = 2;
  s.d_model = 8;  // every attention matrix is square
  s.heads = 2;
  s.seq_len = 5;
  s.vocab = 11;
  return s;
}

// A model's parameters, initialised from `seed`, owned by the returned store.
struct Params {
  Params(const ModelSpec& spec, uint64_t seed)
      : graph(build_model(spec, 1).graph), store(graph, seed) {
    for (auto& e : store.entries()) views[e.name] = e.value;
  }
  Graph graph;
  ParamStore store;
  Tensors views;
};

bool same(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

void expect_same_params(const Tensors& a, const Tensors& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) EXPECT_TRUE(same(t, b.at(name))) << name;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Export, RoundTripIsBitwiseForMlpCnnGpt) {
  TempDir dir;
  for (const char* kind : {"mlp", "cnn", "gpt"}) {
    const ModelSpec s = spec_of(kind);
    Params src(s, 1), dst(s, 2);
    const std::string path = dir.file(std::string(kind) + ".safetensors");
    save_torch_weights(path, s, src.views, {{"step", "7"}});
    const TorchLoadReport r = load_torch_weights(path, s, dst.views);
    EXPECT_TRUE(r.assumed.empty());
    EXPECT_TRUE(r.skipped.empty());
    EXPECT_TRUE(r.left_at_init.empty());
    EXPECT_EQ(r.loaded.size(), torch_name_map(s).tensors.size());
    EXPECT_EQ(r.elements, src.store.numel());
    expect_same_params(src.views, dst.views);

    const SafetensorsReader file(path);
    const auto& m = file.header().metadata;
    EXPECT_EQ(m.at("format"), "pt");
    EXPECT_EQ(m.at("layout"), "pytorch-v1");
    EXPECT_EQ(m.at("model"), kind);
    EXPECT_EQ(m.at("naming"), std::string(kind) == "gpt" ? "nanogpt" : "meshtrain");
    EXPECT_EQ(m.at("step"), "7");
    EXPECT_NE(m.at("model_config").find("\"kind\":\"" + std::string(kind) + "\""),
              std::string::npos);
  }
}

TEST(Export, CheckpointsOfAnyLayoutGiveTheSameParameters) {
  TempDir dir;
  const ModelSpec s = spec_of("cnn");
  Params src(s, 3);
  Tensors prefixed;
  for (const auto& [name, t] : src.views) prefixed["param/" + name] = t;
  prefixed["optim/fc1.w.momentum"] = Tensor::zeros({20, 6}, DType::f32);  // not exported

  const std::string file = dir.file("ckpt.safetensors");
  save_checkpoint(file, prefixed, {{"extra/model", "cnn"}, {"step", "4"}});
  // Three ranks, each writing a third of every tensor.
  const std::string sharded = dir.file("sharded");
  LocalWorldOptions lw;
  lw.size = 3;
  SaveShardedOptions so;
  so.mode = "zero3";
  LocalWorld::run(lw, [&](Communicator& c) {
    save_sharded(&c, sharded, even_pieces(prefixed, c.rank(), c.size()),
                 {{"model", "cnn"}, {"step", "4"}}, so);
  });
  for (const std::string& path : {file, sharded}) {
    const CheckpointParams cp = read_checkpoint_params(path, s);
    expect_same_params(src.views, cp.params);
    EXPECT_EQ(cp.metadata.at("step"), "4");
  }
  // Another model kind, or another size of the same model, is named.
  EXPECT_NE(error_of([&] {
              read_checkpoint_params(sharded, spec_of("mlp"));
            }).find("holds a cnn model, but the config describes a mlp"),
            std::string::npos);
  ModelSpec wider = s;
  wider.fc = 9;
  const std::string msg = error_of([&] { read_checkpoint_params(file, wider); });
  EXPECT_NE(msg.find("fc1.w: the checkpoint holds f32 [20, 6], the model has f32 [20, 9]"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("head.w"), std::string::npos) << msg;
}

TEST(Export, RecordedLayoutIsCheckedEvenWhenEveryMatrixIsSquare) {
  TempDir dir;
  ModelSpec s = spec_of("gpt");
  s.layers = 1;
  Params src(s, 4), dst(s, 5);
  const Tensors before = [&] {
    Tensors c;
    for (const auto& [n, t] : dst.views) c[n] = t.clone();
    return c;
  }();
  // The same tensors as an [in, out] (HF Conv1D-like) file would hold the
  // square ones: only the record can tell.
  const Tensors torch = to_torch(torch_name_map(s), src.views);
  const std::string path = dir.file("conv1d.safetensors");
  save_safetensors(path, torch, {{"format", "pt"}, {"layout", "conv1d-in-out"}});
  std::string msg = error_of([&] { load_torch_weights(path, s, dst.views); });
  EXPECT_NE(msg.find("records layout \"conv1d-in-out\", expected \"pytorch-v1\""),
            std::string::npos)
      << msg;
  // Refused even when a partial load is asked for; nothing was written.
  EXPECT_THROW(load_torch_weights(path, s, dst.views, {true}), CheckpointError);
  expect_same_params(before, dst.views);

  save_safetensors(path, torch, {{"format", "tf"}});
  msg = error_of([&] { load_torch_weights(path, s, dst.views); });
  EXPECT_NE(msg.find("records format \"tf\", expected \"pt\""), std::string::npos) << msg;
  save_safetensors(path, torch, {{"model", "mlp"}});
  msg = error_of([&] { load_torch_weights(path, s, dst.views); });
  EXPECT_NE(msg.find("records model \"mlp\", expected \"gpt\""), std::string::npos) << msg;
}

TEST(Export, FileWithoutMetadataLoadsWithTheAssumptionSaid) {
  TempDir dir;
  const ModelSpec s = spec_of("mlp");
  Params src(s, 6), dst(s, 7);
  const std::string path = dir.file("plain.safetensors");
  save_safetensors(path, to_torch(torch_name_map(s), src.views));
  const TorchLoadReport r = load_torch_weights(path, s, dst.views);
  EXPECT_NE(r.assumed.find("records no layout"), std::string::npos) << r.assumed;
  EXPECT_NE(r.assumed.find("assuming pytorch-v1"), std::string::npos) << r.assumed;
  expect_same_params(src.views, dst.views);
}

TEST(Export, MismatchesAreListedUnlessPartialWhichLoadsWhatMatches) {
  TempDir dir;
  const ModelSpec s = spec_of("mlp");  // 64 -> 12 -> 7 -> 10
  ModelSpec other = s;
  other.hidden = {12, 9};  // fc2 and head differ in shape
  Params src(other, 8), dst(s, 9);
  Tensors torch = to_torch(torch_name_map(other), src.views);
  torch.erase("fc1.bias");
  torch["extra.weight"] = Tensor::zeros({2, 2}, DType::f32);
  const std::string path = dir.file("other.safetensors");
  save_safetensors(path, torch);
  Tensors before;
  for (const auto& [n, t] : dst.views) before[n] = t.clone();

  const std::string msg = error_of([&] { load_torch_weights(path, s, dst.views); });
  for (const char* want :
       {"does not match the mlp model (5 differences; train.init_partial = true",
        "missing: fc1.bias [12]", "fc2.weight: the file holds [9, 12], the model has [7, 12]",
        "fc2.bias: the file holds [9], the model has [7]",
        "head.weight: the file holds [10, 9], the model has [10, 7]",
        "unexpected: extra.weight [2, 2]"}) {
    EXPECT_NE(msg.find(want), std::string::npos) << want << "\n" << msg;
  }
  expect_same_params(before, dst.views);  // all or nothing

  const TorchLoadReport r = load_torch_weights(path, s, dst.views, {true});
  EXPECT_EQ(r.loaded, (std::vector<std::string>{"fc1.weight", "head.bias"}));
  EXPECT_EQ(r.skipped.size(), 4u);
  EXPECT_EQ(r.left_at_init.size(), 4u);  // fc1.bias, fc2.weight, fc2.bias, head.weight
  EXPECT_NE(r.left_at_init[0].find("fc1.bias [12]: not in the file"), std::string::npos);
  // fc1.w holds the file's values (transposed back), fc1.b its initial ones.
  Tensors back = src.views;
  Tensor w = Tensor::empty({64, 12}, DType::f32);
  back["fc1.w"] = w;
  from_torch(*torch_name_map(s).find("fc1.weight"), torch.at("fc1.weight"), back);
  EXPECT_TRUE(same(dst.views.at("fc1.w"), w));
  EXPECT_TRUE(same(dst.views.at("fc1.b"), before.at("fc1.b")));
  EXPECT_TRUE(same(dst.views.at("fc2.w"), before.at("fc2.w")));
  EXPECT_TRUE(same(dst.views.at("head.b"), src.views.at("head.b")));
}

TEST(Export, TransposedMatrixIsNamedAsSuch) {
  TempDir dir;
  const ModelSpec s = spec_of("mlp");
  Params src(s, 10), dst(s, 11);
  Tensors torch = to_torch(torch_name_map(s), src.views);
  torch["fc1.weight"] = src.views.at("fc1.w");  // meshtrain's [in, out]
  const std::string path = dir.file("t.safetensors");
  save_safetensors(path, torch);
  const std::string msg = error_of([&] { load_torch_weights(path, s, dst.views); });
  EXPECT_NE(msg.find("fc1.weight: the file holds [64, 12], the model has [12, 64] (transposed"),
            std::string::npos)
      << msg;
}

TEST(Export, GptHeadLoadsFromNanoGptsTiedName) {
  TempDir dir;
  ModelSpec s = spec_of("gpt");
  s.layers = 1;
  Params src(s, 12), dst(s, 13);
  Tensors torch = to_torch(torch_name_map(s), src.views);
  const std::string path = dir.file("nanogpt.safetensors");
  // Both names with the same values (nanoGPT's state_dict): loads.
  torch["lm_head.weight"] = torch.at("transformer.wte.weight");
  save_safetensors(path, torch);
  TorchLoadReport r = load_torch_weights(path, s, dst.views);
  expect_same_params(src.views, dst.views);
  // Only the head's name (what a de-duplicating writer may keep): loads.
  Params dst2(s, 14);
  torch.erase("transformer.wte.weight");
  save_safetensors(path, torch);
  r = load_torch_weights(path, s, dst2.views);
  expect_same_params(src.views, dst2.views);
  // Both, differing: refused.
  torch["transformer.wte.weight"] = Tensor::zeros({11, 8}, DType::f32);
  save_safetensors(path, torch);
  const std::string msg = error_of([&] { load_torch_weights(path, s, dst.views); });
  EXPECT_NE(msg.find("lm_head.weight: differs from transformer.wte.weight (the model ties them)"),
            std::string::npos)
      << msg;
}

TEST(Export, WiderFloatsAreConvertedAndOtherFilesExplained) {
  TempDir dir;
  const ModelSpec s = spec_of("mlp");
  Params src(s, 15), dst(s, 16);
  Tensors torch = to_torch(torch_name_map(s), src.views);
  for (auto& [name, t] : torch) t = t.to(DType::f64);  // exact both ways
  const std::string path = dir.file("f64.safetensors");
  save_torch_weights(path, s, src.views);
  save_safetensors(path, torch, SafetensorsReader(path).header().metadata);
  load_torch_weights(path, s, dst.views);
  expect_same_params(src.views, dst.views);

  // A training checkpoint is not a weights file: the message says what to do.
  Tensors prefixed;
  for (const auto& [name, t] : src.views) prefixed["param/" + name] = t;
  save_checkpoint(dir.file("ckpt.safetensors"), prefixed);
  std::string msg =
      error_of([&] { load_torch_weights(dir.file("ckpt.safetensors"), s, dst.views); });
  EXPECT_NE(msg.find("is a meshtrain training checkpoint"), std::string::npos) << msg;
  EXPECT_NE(msg.find("train.resume"), std::string::npos) << msg;
  EXPECT_THROW(load_torch_weights(dir.file("missing.safetensors"), s, dst.views), FileError);
}

TEST(Export, TrainerStartsFromTheFile) {
  TempDir dir;
  ModelSpec s;
  s.kind = "mlp";
  s.hidden = {32};
  Params src(s, 17);
  const std::string path = dir.file("init.safetensors");
  save_torch_weights(path, s, src.views);
  FashionMnistOptions d;
  d.flatten = true;
  d.limit = 64;
  auto train = std::make_shared<FashionMnist>(d);
  TrainerOptions o;
  o.batch_size = 32;
  o.max_steps = 1;
  o.progress = false;
  o.eval = false;
  o.seed = 99;
  o.init_path = path;
  Trainer t(s, train, train, o);
  ASSERT_NE(t.init_report(), nullptr);
  EXPECT_EQ(t.init_report()->loaded.size(), 4u);
  Tensors got;
  for (auto& e : t.params().entries()) got[e.name] = e.value;
  expect_same_params(src.views, got);

  o.init_path.clear();
  Trainer fresh(s, train, train, o);
  EXPECT_EQ(fresh.init_report(), nullptr);
}

}  // namespace
}  // namespace mt
