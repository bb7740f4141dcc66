// Models the TrainerEngine trains (internal; LibTorch): the built-in tinylm and mlp, and
// TorchScript modules loaded from a file, behind one small interface.
// Thread-safety: a model belongs to its engine's thread.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ring_attention.h"
#include "troupe/actors/trainer_engine.h"

namespace troupe::actors::train {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

class TrainModel {
 public:
  virtual ~TrainModel() = default;
  // inputs -> logits, recording autograd history unless a NoGradGuard is active.
  virtual at::Tensor forward(const at::Tensor& inputs) = 0;
  // Trainable parameters (requires_grad leaves) in registration order, and buffers.
  virtual NamedTensors parameters() = 0;
  virtual NamedTensors buffers() = 0;
  // The dtype inputs must have ("int64" or "float32"), or "" when the model does not say.
  virtual std::string inputDtype() const = 0;
  // Largest token id + 1 for token models (inputs are checked against it), 0 otherwise.
  virtual int64_t vocab() const { return 0; }
  virtual void train(bool on) = 0;
  // Sequence parallelism: from now on each input row holds the tokens at `positions` of a
  // longer sequence, and attention runs as a ring over `ring` (which must outlive its use);
  // nullptr: whole sequences, attention over the row alone. Only tinylm can.
  virtual Status setSequenceParallel(const Ring* ring, const at::Tensor& positions) {
    (void)positions;
    if (ring == nullptr) return Status::ok();
    return Status(StatusCode::kInvalidArgument, "only the built-in tinylm trains with sequence parallelism");
  }
};

// The model named by options.model, with built-in models' parameters drawn from `generator`.
// Errors as TrainerEngine::create.
Result<std::unique_ptr<TrainModel>> makeModel(const TrainerEngineOptions& options,
                                              at::Generator& generator);

}  // namespace troupe::actors::train
