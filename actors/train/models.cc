// The built-in models and the TorchScript wrapper. One of the two translation units of
// actors/train that include LibTorch's C++ API (each costs ~30 s to compile).
#include "models.h"

#include <torch/script.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>

#include <fmt/format.h>

namespace troupe::actors::train {
namespace {

namespace nn = torch::nn;

NamedTensors namedOf(const torch::OrderedDict<std::string, at::Tensor>& dict) {
  NamedTensors out;
  for (const auto& item : dict) out.emplace_back(item.key(), item.value());
  return out;
}

// ---- tinylm: pre-LayerNorm GPT blocks ----

struct BlockImpl : nn::Module {
  BlockImpl(int64_t d, int64_t heads) : heads_(heads) {
    ln1 = register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({d})));
    qkv = register_module("qkv", nn::Linear(d, 3 * d));
    proj = register_module("proj", nn::Linear(d, d));
    ln2 = register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({d})));
    fc1 = register_module("fc1", nn::Linear(d, 4 * d));
    fc2 = register_module("fc2", nn::Linear(4 * d, d));
  }

  // ring: causal attention over the ring's whole sequence (ring_attention.h), else over x's.
  at::Tensor forward(at::Tensor x, const at::Tensor& mask, const Ring* ring) {
    const int64_t b = x.size(0), t = x.size(1), c = x.size(2), dh = c / heads_;
    // [B, T, 3, H, dh] -> [3, B, H, T, dh]
    auto parts = qkv(ln1(x)).view({b, t, 3, heads_, dh}).permute({2, 0, 3, 1, 4});
    const auto q = parts[0], k = parts[1], v = parts[2];
    at::Tensor y;
    if (ring != nullptr) {
      y = ringAttention(q, k, v, /*causal=*/true, *ring).transpose(1, 2).reshape({b, t, c});
    } else {
      auto att = at::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(dh)));
      att = att.masked_fill(mask, -std::numeric_limits<float>::infinity()).softmax(-1);
      y = at::matmul(att, v).transpose(1, 2).reshape({b, t, c});
    }
    x = x + proj(y);
    return x + fc2(at::gelu(fc1(ln2(x))));
  }

  int64_t heads_;
  nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

struct TinyLmImpl : nn::Module {
  explicit TinyLmImpl(const TinyLmOptions& o) : options(o) {
    tok_emb = register_module("tok_emb", nn::Embedding(o.vocab, o.d_model));
    pos_emb = register_parameter("pos_emb", at::zeros({o.context, o.d_model}));
    blocks = register_module("blocks", nn::ModuleList());
    for (int64_t i = 0; i < o.layers; ++i) blocks->push_back(Block(o.d_model, o.heads));
    ln_f = register_module("ln_f", nn::LayerNorm(nn::LayerNormOptions({o.d_model})));
    head = register_module("head", nn::Linear(o.d_model, o.vocab));
    // True above the diagonal: position i attends to positions <= i.
    causal = at::ones({o.context, o.context}, at::kBool).triu(1);
  }

  at::Tensor forward(const at::Tensor& tokens) {
    const int64_t t = tokens.size(1);
    if (ring != nullptr) {  // tokens at `positions` of a sequence spread over the ring
      TORCH_CHECK(positions.numel() == t, "tinylm: ", t, " tokens per row but ", positions.numel(), " positions");
      TORCH_CHECK(t * ring->size() <= options.context, "tinylm: ", t * ring->size(),
                  " tokens per sample but the context is ", options.context);
      auto x = tok_emb(tokens) + pos_emb.index_select(0, positions);
      for (const auto& block : *blocks) x = block->as<Block>()->forward(x, at::Tensor(), ring);
      return head(ln_f(x));
    }
    TORCH_CHECK(t <= options.context, "tinylm: ", t, " tokens per sample but the context is ",
                options.context);
    auto x = tok_emb(tokens) + pos_emb.slice(0, 0, t);
    const auto mask = causal.slice(0, 0, t).slice(1, 0, t);
    for (const auto& block : *blocks) x = block->as<Block>()->forward(x, mask, nullptr);
    return head(ln_f(x));
  }

  // GPT-2's scheme from our own generator: N(0, 0.02) weights and embeddings, residual
  // projections scaled by 1/sqrt(2 * layers), zero biases, unit LayerNorm gains.
  void initialize(at::Generator& generator) {
    torch::NoGradGuard no_grad;
    const double residual = 0.02 / std::sqrt(2.0 * static_cast<double>(options.layers));
    for (auto& item : named_parameters()) {
      const std::string& name = item.key();
      at::Tensor& p = item.value();
      const bool norm = name.find("ln") != std::string::npos;
      if (name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0) {
        p.zero_();
      } else if (norm) {
        p.fill_(1.0);
      } else if (name.find("proj.weight") != std::string::npos ||
                 name.find("fc2.weight") != std::string::npos) {
        p.normal_(0.0, residual, generator);
      } else {
        p.normal_(0.0, 0.02, generator);
      }
    }
  }

  TinyLmOptions options;
  nn::Embedding tok_emb{nullptr};
  at::Tensor pos_emb;
  nn::ModuleList blocks{nullptr};
  nn::LayerNorm ln_f{nullptr};
  nn::Linear head{nullptr};
  at::Tensor causal;
  const Ring* ring = nullptr;  // sequence parallelism: see TrainModel::setSequenceParallel
  at::Tensor positions;
};
TORCH_MODULE(TinyLm);

class TinyLmModel final : public TrainModel {
 public:
  TinyLmModel(const TinyLmOptions& options, at::Generator& generator) : net_(options) {
    net_->initialize(generator);
  }
  at::Tensor forward(const at::Tensor& inputs) override { return net_->forward(inputs); }
  NamedTensors parameters() override { return namedOf(net_->named_parameters()); }
  NamedTensors buffers() override { return namedOf(net_->named_buffers()); }
  std::string inputDtype() const override { return "int64"; }
  int64_t vocab() const override { return net_->options.vocab; }
  void train(bool on) override { net_->train(on); }
  Status setSequenceParallel(const Ring* ring, const at::Tensor& positions) override {
    net_->ring = ring;
    net_->positions = ring != nullptr ? positions : at::Tensor();
    return Status::ok();
  }

 private:
  TinyLm net_;
};

// ---- mlp ----

struct MlpImpl : nn::Module {
  explicit MlpImpl(const std::vector<int64_t>& sizes) {
    layers = register_module("layers", nn::ModuleList());
    for (size_t i = 0; i + 1 < sizes.size(); ++i) layers->push_back(nn::Linear(sizes[i], sizes[i + 1]));
  }
  at::Tensor forward(at::Tensor x) {
    for (size_t i = 0; i < layers->size(); ++i) {
      x = layers->at<nn::LinearImpl>(i).forward(x);
      if (i + 1 < layers->size()) x = at::relu(x);
    }
    return x;
  }
  // He-normal weights (N(0, 2/fan_in); 1/fan_in for the output layer), zero biases.
  void initialize(at::Generator& generator) {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < layers->size(); ++i) {
      auto& linear = layers->at<nn::LinearImpl>(i);
      const double fan_in = static_cast<double>(linear.weight.size(1));
      const double gain = i + 1 < layers->size() ? 2.0 : 1.0;
      linear.weight.normal_(0.0, std::sqrt(gain / fan_in), generator);
      linear.bias.zero_();
    }
  }
  nn::ModuleList layers{nullptr};
};
TORCH_MODULE(Mlp);

class MlpModel final : public TrainModel {
 public:
  MlpModel(const std::vector<int64_t>& sizes, at::Generator& generator) : net_(sizes) {
    net_->initialize(generator);
  }
  at::Tensor forward(const at::Tensor& inputs) override { return net_->forward(inputs); }
  NamedTensors parameters() override { return namedOf(net_->named_parameters()); }
  NamedTensors buffers() override { return namedOf(net_->named_buffers()); }
  std::string inputDtype() const override { return "float32"; }
  void train(bool on) override { net_->train(on); }

 private:
  Mlp net_;
};

// ---- TorchScript ----

class ScriptModel final : public TrainModel {
 public:
  explicit ScriptModel(torch::jit::Module module) : module_(std::move(module)) {}
  at::Tensor forward(const at::Tensor& inputs) override {
    auto out = module_.forward({inputs});
    TORCH_CHECK(out.isTensor(), "the TorchScript model's forward returned ", out.tagKind(),
                ", not a tensor of logits");
    return out.toTensor();
  }
  NamedTensors parameters() override {
    NamedTensors out;
    for (const auto& p : module_.named_parameters(true)) {
      if (p.value.requires_grad()) out.emplace_back(p.name, p.value);
    }
    return out;
  }
  NamedTensors buffers() override {
    NamedTensors out;
    for (const auto& b : module_.named_buffers(true)) out.emplace_back(b.name, b.value);
    return out;
  }
  std::string inputDtype() const override { return ""; }
  void train(bool on) override { module_.train(on); }

 private:
  torch::jit::Module module_;
};

Status invalid(const std::string& message) {
  return Status(StatusCode::kInvalidArgument, message);
}

}  // namespace

Result<std::unique_ptr<TrainModel>> makeModel(const TrainerEngineOptions& options,
                                              at::Generator& generator) {
  std::unique_ptr<TrainModel> model;
  if (options.model == "tinylm") {
    const auto& o = options.tinylm;
    if (o.vocab < 1 || o.context < 1 || o.d_model < 1 || o.layers < 1 || o.heads < 1 ||
        o.d_model % o.heads != 0) {
      return invalid(fmt::format("tinylm: vocab, context, d_model, layers and heads must be >= 1 "
                                 "and d_model a multiple of heads; got vocab {} context {} "
                                 "d_model {} layers {} heads {}",
                                 o.vocab, o.context, o.d_model, o.layers, o.heads));
    }
    model = std::make_unique<TinyLmModel>(o, generator);
  } else if (options.model == "mlp") {
    if (options.mlp_sizes.size() < 2) {
      return invalid(fmt::format("mlp: mlp_sizes needs at least the input and output widths, got "
                                 "{} values",
                                 options.mlp_sizes.size()));
    }
    for (int64_t s : options.mlp_sizes) {
      if (s < 1) return invalid(fmt::format("mlp: every width must be >= 1, got {}", s));
    }
    model = std::make_unique<MlpModel>(options.mlp_sizes, generator);
  } else {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(options.model, ec)) {
      return Status(StatusCode::kNotFound,
                    fmt::format("model '{}' is neither a built-in model (tinylm, mlp) nor a "
                                "TorchScript file",
                                options.model));
    }
    try {
      model = std::make_unique<ScriptModel>(torch::jit::load(options.model, at::kCPU));
    } catch (const c10::Error& e) {
      return invalid(fmt::format("cannot load the TorchScript model {}: {}", options.model,
                                 e.what_without_backtrace()));
    }
  }
  for (const auto& [name, p] : model->parameters()) {
    if (p.scalar_type() != at::kFloat || !p.is_contiguous() || !p.device().is_cpu()) {
      return invalid(fmt::format("model {}: parameter {} is {} (contiguous: {}); the engine "
                                 "trains contiguous float32 CPU parameters",
                                 options.model, name, c10::toString(p.scalar_type()),
                                 p.is_contiguous()));
    }
  }
  model->train(true);
  return model;
}

}  // namespace troupe::actors::train
