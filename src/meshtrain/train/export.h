// Weights in and out: a model's parameters as a PyTorch-layout safetensors
// file (names and layout from models/torch_names.h, table in
// docs/export.md), written from any meshtrain checkpoint and read back to
// start training from.
//
// An exported file's __metadata__ records
//   "format": "pt"            (what PyTorch's safetensors writer records)
//   "layout": "pytorch-v1"    (kTorchLayout: nn.Linear [out, in], Conv2d
//                              [out, in, kh, kw], embeddings [num, dim])
//   "naming": "meshtrain" | "nanogpt"
//   "model":  "mlp" | "cnn" | "gpt"
//   "model_config": the model's sizes as JSON (kind, image_channels,
//                   image_size, classes, hidden, conv_channels, fc, layers,
//                   d_model, heads, seq_len, vocab), enough to build the
//                   equivalent PyTorch module
// plus the caller's entries (e.g. the checkpoint it came from and its step).
//
// Loading refuses a file whose recorded format, layout, naming or model is
// not the expected one: a square matrix stored [in, out] has the right shape
// and only the record tells it apart. A file with no "layout" (e.g. written
// by safetensors.torch.save_file without metadata) is assumed to be in
// pytorch-v1 layout, and the report says so.
//
// Blocking file I/O; no shared state.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "meshtrain/train/sharded_checkpoint.h"

#include "meshtrain/models/model.h"
#include "meshtrain/tensor/tensor.h"

namespace mt {

// The model's sizes as the JSON object recorded under "model_config".
std::string model_config_json(const ModelSpec& spec);

// The whole f32 parameters (meshtrain names, without the "param/" prefix) of
// the model `spec` describes, read from a meshtrain checkpoint: a single
// file, or a sharded directory written at any world size under any ZeRO
// stage (only the parameters are read, not the optimizer state). `metadata`
// is the checkpoint's. Throws CheckpointError naming the path for a
// checkpoint of another model kind, or listing every parameter that is
// missing, extra or shaped differently (another model size); FileError if
// it cannot be read.
struct CheckpointParams {
  std::map<std::string, Tensor> params;
  std::map<std::string, std::string> metadata;
};
CheckpointParams read_checkpoint_params(const std::string& path, const ModelSpec& spec);

// Writes `params` (whole, f32, meshtrain names) to `path` as a PyTorch-layout
// safetensors file, atomically, with the metadata above and `extra`. Throws
// ShapeError for a missing or mis-shaped parameter, FileError if the file
// cannot be written.
void save_torch_weights(const std::string& path, const ModelSpec& spec,
                        const std::map<std::string, Tensor>& params,
                        const std::map<std::string, std::string>& extra = {});

struct TorchLoadOptions {
  // false: every tensor of the model must be in the file with its shape, and
  // the file must hold nothing else. true: load what matches by name and
  // shape, leave the rest at its initial values, and report both.
  bool partial = false;
};

struct TorchLoadReport {
  std::string path;
  std::vector<std::string> loaded;        // PyTorch names
  std::vector<std::string> skipped;       // file tensors not loaded: "name: why"
  std::vector<std::string> left_at_init;  // model tensors not loaded: "name: why"
  // Non-empty when the file records no layout: what was assumed.
  std::string assumed;
  int64_t elements = 0;  // parameter values loaded
};

// Loads the PyTorch-layout file `path` into `params` (meshtrain names and
// shapes, f32, e.g. views into a ParamStore). Floating-point tensors of
// other widths (F16, BF16, F64) are converted to f32. All or nothing: on
// error nothing was written. Throws FileError for a missing or unreadable
// file; CheckpointError naming the path for a meshtrain training checkpoint
// (use train.resume or `meshtrain export`), a recorded format, layout,
// naming or model other than the expected one, a tied alias that differs,
// and -- unless options.partial -- every missing, unexpected or mis-shaped
// tensor, listed together.
TorchLoadReport load_torch_weights(const std::string& path, const ModelSpec& spec,
                                   std::map<std::string, Tensor>& params,
                                   const TorchLoadOptions& options = {});

// load_torch_weights for a rank that holds only some parameters, or boxes of
// them (tensor-parallel pieces, a pipeline stage's parameters): `held` maps
// a parameter name to this rank's tensor (a handle on its memory, written
// in place); `places` gives, for each split parameter, the box of the whole
// tensor that tensor is (others are whole). The file is matched against the
// whole model exactly as load_torch_weights does (the same errors, from its
// header; tied aliases are read whole to compare them), and each held
// tensor gets its box, reading only the box's elements (one range read per
// run contiguous in the file, converted to f32). All or nothing, as
// load_torch_weights; ShapeError for a held tensor whose size is not its
// box's or a name the model lacks.
TorchLoadReport load_torch_weights_into_boxes(const std::string& path, const ModelSpec& spec,
                                              std::map<std::string, Tensor>& held,
                                              const std::map<std::string, TensorPlace>& places,
                                              const TorchLoadOptions& options = {});

}  // namespace mt
