// The models meshtrain ships, written once against the graph Builder.
//
// build_model() returns the forward graph of one model for a given batch
// size: the inputs the trainer feeds (x, y), the logits and the scalar loss.
// Training differentiates it (graph/autodiff.h); evaluation runs it forward.
// Mixed precision: with compute = bf16 or f16 every matmul reads its operands
// in that dtype (parameters stay f32 masters and are cast) and accumulates in
// f32. Under bf16, activations that flow from one matmul to the next -- hidden
// layers with their bias and activation function, attention's q, k, v and
// output -- stay in bf16; logits, the residual stream, layer norm, softmax,
// the loss and convolutions are f32 (and under f16 every activation is).
// Parameter gradients are f32.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/graph/graph.h"
#include "meshtrain/tensor/tensor.h"

namespace mt {

struct ModelSpec {
  std::string kind = "mlp";  // "mlp", "cnn" or "gpt"
  DType compute = DType::f32;
  // Images (mlp, cnn): channels x height x width, classes.
  int64_t image_channels = 1, image_size = 28, classes = 10;
  std::vector<int64_t> hidden = {512, 512};       // mlp hidden widths
  std::vector<int64_t> conv_channels = {32, 64};  // cnn: one conv-relu-pool block each
  int64_t fc = 128;                               // cnn classifier hidden width
  // gpt
  int64_t layers = 4, d_model = 256, heads = 4, seq_len = 128, vocab = 256;
};

struct ModelGraph {
  Graph graph;
  ValueId x = kNoValue;       // f32 images [B, C, H, W] / [B, C*H*W], or i32 tokens [B, T]
  ValueId y = kNoValue;       // i32 labels [B] or next tokens [B*T]
  ValueId logits = kNoValue;  // f32 [B, classes] or [B*T, vocab]
  ValueId loss = kNoValue;    // f32 scalar, mean cross-entropy
  // Inputs with fixed contents (e.g. GPT position ids) the trainer binds once.
  std::vector<std::pair<ValueId, Tensor>> constants;
  int64_t batch = 0;
  int64_t samples_per_batch() const { return batch; }
};

// Throws ConfigError for an unknown kind or an impossible spec (e.g. d_model
// not divisible by heads), naming the field.
ModelGraph build_model(const ModelSpec& spec, int64_t batch);

ModelGraph build_mlp(const ModelSpec& spec, int64_t batch);
ModelGraph build_cnn(const ModelSpec& spec, int64_t batch);
ModelGraph build_gpt(const ModelSpec& spec, int64_t batch);

}  // namespace mt
