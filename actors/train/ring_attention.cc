// Ring attention's forward and backward rings (see ring_attention.h). One of the three
// translation units of actors/train that include LibTorch.
#include "ring_attention.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <utility>

#include "troupe/collectives/communicator.h"

namespace troupe::actors::train {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr double kInf = std::numeric_limits<double>::infinity();
// Query rows per tile of a block: a block's scores and probabilities exist for one tile at a
// time, so memory grows with the tokens a rank holds, not their square.
constexpr int64_t kTileRows = 256;

// -inf (a row that has seen no key yet) read as 0, so that exp(x - it) never makes a NaN.
at::Tensor finite(const at::Tensor& lse) { return at::where(at::isinf(lse), at::zeros_like(lse), lse); }

// The part of a (query block, key block) pair that any query can see: query rows [row0, Tq),
// key columns [0, cols) (positions ascend in both), with the mask of that part (true: hidden),
// undefined when all of it is visible.
struct Visible {
  int64_t row0 = 0;
  int64_t cols = 0;
  at::Tensor mask;
};

Visible visible(const at::Tensor& queries, const at::Tensor& keys, bool causal) {
  Visible v;
  v.cols = keys.size(0);
  if (!causal) return v;
  const auto q = queries.accessor<int64_t, 1>();
  const auto k = keys.accessor<int64_t, 1>();
  const int64_t tq = queries.size(0);
  v.cols = 0;
  while (v.cols < keys.size(0) && k[v.cols] <= q[tq - 1]) ++v.cols;
  while (v.row0 < tq && (keys.size(0) == 0 || q[v.row0] < k[0])) ++v.row0;
  if (v.cols == 0 || v.row0 == tq) return v;
  at::Tensor mask = keys.narrow(0, 0, v.cols).unsqueeze(0) > queries.narrow(0, v.row0, tq - v.row0).unsqueeze(1);
  if (mask.any().item<bool>()) v.mask = mask;
  return v;
}

bool nothingVisible(const Visible& v, int64_t rows) { return v.cols == 0 || v.row0 >= rows; }

// One hop of the ring: `send` to the next member while `recv` fills from the previous one.
std::shared_ptr<collectives::Work> hop(const Ring& ring, const at::Tensor& send, at::Tensor& recv) {
  const int n = ring.size();
  const int next = ring.ranks[static_cast<size_t>((ring.index + 1) % n)];
  const int prev = ring.ranks[static_cast<size_t>((ring.index + n - 1) % n)];
  return ring.comm->sendRecvAsync(send.data_ptr<float>(), next, recv.data_ptr<float>(), prev,
                                  static_cast<size_t>(send.numel()), collectives::DataType::kFloat32);
}

void finish(std::shared_ptr<collectives::Work>& work) {
  if (!work) return;
  Status s = work->wait();
  work.reset();
  if (!s.isOk()) throw RingFailure(s);
}

std::vector<at::Tensor> memberPositions(int64_t tokens, int n, bool causal) {
  std::vector<at::Tensor> out;
  for (int i = 0; i < n; ++i) {
    out.push_back(causal ? zigzagPositions(tokens * n, n, i) : at::arange(tokens, at::kLong));
  }
  return out;
}

Ring ringOf(AutogradContext* ctx) {
  Ring ring;
  ring.comm = reinterpret_cast<collectives::Communicator*>(static_cast<intptr_t>(ctx->saved_data["comm"].toInt()));
  for (int64_t r : ctx->saved_data["ranks"].toIntVector()) ring.ranks.push_back(static_cast<int>(r));
  ring.index = static_cast<int>(ctx->saved_data["index"].toInt());
  return ring;
}

struct RingAttention : public torch::autograd::Function<RingAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                            bool causal, const Ring* ring_in) {
    const Ring& ring = *ring_in;
    const at::Tensor q = q_in.contiguous();
    const int n = ring.size();
    const int64_t tokens = q.size(2);
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    const auto positions = memberPositions(tokens, n, causal);
    at::Tensor kv = at::stack({k, v}).contiguous();
    at::Tensor incoming = n > 1 ? at::empty_like(kv) : at::Tensor();
    at::Tensor out = at::zeros_like(q);
    at::Tensor lse = at::full({q.size(0), q.size(1), tokens}, -kInf, q.options());
    for (int j = 0; j < n; ++j) {
      const int src = (ring.index - j + n) % n;
      std::shared_ptr<collectives::Work> work;
      if (j + 1 < n) work = hop(ring, kv, incoming);  // the next block arrives during this one
      const Visible vis = visible(positions[static_cast<size_t>(ring.index)], positions[static_cast<size_t>(src)], causal);
      if (!nothingVisible(vis, tokens)) {
        const at::Tensor kb = kv[0].narrow(2, 0, vis.cols);
        const at::Tensor vb = kv[1].narrow(2, 0, vis.cols);
        for (int64_t row = vis.row0; row < tokens; row += kTileRows) {
          const int64_t rows = std::min(kTileRows, tokens - row);
          at::Tensor s = at::matmul(q.narrow(2, row, rows), kb.transpose(-2, -1)) * scale;
          if (vis.mask.defined()) s = s.masked_fill(vis.mask.narrow(0, row - vis.row0, rows), -kInf);
          const at::Tensor blk_lse = s.logsumexp(-1);
          const at::Tensor blk_out = at::matmul((s - finite(blk_lse).unsqueeze(-1)).exp(), vb);
          at::Tensor old_lse = lse.narrow(2, row, rows);
          at::Tensor old_out = out.narrow(2, row, rows);
          const at::Tensor m = finite(at::maximum(old_lse, blk_lse));
          const at::Tensor new_lse = m + ((old_lse - m).exp() + (blk_lse - m).exp()).log();
          const at::Tensor safe = finite(new_lse);
          old_out.copy_(old_out * (old_lse - safe).exp().unsqueeze(-1) + blk_out * (blk_lse - safe).exp().unsqueeze(-1));
          old_lse.copy_(new_lse);
        }
      }
      if (work) {
        finish(work);
        std::swap(kv, incoming);
      }
    }
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["comm"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(ring.comm));
    std::vector<int64_t> ranks(ring.ranks.begin(), ring.ranks.end());
    ctx->saved_data["ranks"] = ranks;
    ctx->saved_data["index"] = static_cast<int64_t>(ring.index);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& q = saved[0];
    const at::Tensor& out = saved[3];
    const at::Tensor lse = finite(saved[4]);
    const bool causal = ctx->saved_data["causal"].toBool();
    const Ring ring = ringOf(ctx);
    const at::Tensor dout = grads[0].contiguous();
    const int n = ring.size();
    const int64_t tokens = q.size(2);
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    const auto positions = memberPositions(tokens, n, causal);
    const at::Tensor delta = (dout * out).sum(-1);  // rowsum(dO * O)
    at::Tensor dq = at::zeros_like(q);
    at::Tensor kv = at::stack({saved[1], saved[2]}).contiguous();
    at::Tensor dkv = at::zeros_like(kv);
    at::Tensor incoming = n > 1 ? at::empty_like(kv) : at::Tensor();
    at::Tensor incoming_grad = n > 1 ? at::empty_like(kv) : at::Tensor();
    for (int j = 0; j < n; ++j) {
      const int src = (ring.index - j + n) % n;
      std::shared_ptr<collectives::Work> work;
      if (j + 1 < n) work = hop(ring, kv, incoming);
      const Visible vis = visible(positions[static_cast<size_t>(ring.index)], positions[static_cast<size_t>(src)], causal);
      if (!nothingVisible(vis, tokens)) {
        const at::Tensor kb = kv[0].narrow(2, 0, vis.cols);
        const at::Tensor vb = kv[1].narrow(2, 0, vis.cols);
        at::Tensor dk = dkv[0].narrow(2, 0, vis.cols);
        at::Tensor dv = dkv[1].narrow(2, 0, vis.cols);
        for (int64_t row = vis.row0; row < tokens; row += kTileRows) {
          const int64_t rows = std::min(kTileRows, tokens - row);
          const at::Tensor qs = q.narrow(2, row, rows);
          const at::Tensor dos = dout.narrow(2, row, rows);
          at::Tensor s = at::matmul(qs, kb.transpose(-2, -1)) * scale;
          if (vis.mask.defined()) s = s.masked_fill(vis.mask.narrow(0, row - vis.row0, rows), -kInf);
          const at::Tensor p = (s - lse.narrow(2, row, rows).unsqueeze(-1)).exp();
          const at::Tensor ds = p * (at::matmul(dos, vb.transpose(-2, -1)) - delta.narrow(2, row, rows).unsqueeze(-1));
          dq.narrow(2, row, rows).add_(at::matmul(ds, kb), scale);
          dk.add_(at::matmul(ds.transpose(-2, -1), qs), scale);
          dv.add_(at::matmul(p.transpose(-2, -1), dos));
        }
      }
      if (n > 1) {  // this block's gradient goes on with it; after the last hop each is home
        auto grad_work = hop(ring, dkv, incoming_grad);
        finish(grad_work);
        std::swap(dkv, incoming_grad);
      }
      if (work) {
        finish(work);
        std::swap(kv, incoming);
      }
    }
    return {dq, dkv[0], dkv[1], at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor zigzagPositions(int64_t length, int size, int index) {
  TORCH_CHECK(size >= 1 && index >= 0 && index < size, "zigzag: member ", index, " of a ring of ", size);
  TORCH_CHECK(length % (2 * size) == 0, "zigzag: ", length, " tokens do not split into ", 2 * size,
              " equal chunks (a multiple of 2 x the ring size is needed)");
  const int64_t chunk = length / (2 * size);
  return at::cat({at::arange(index * chunk, (index + 1) * chunk, at::kLong),
                  at::arange((2 * size - 1 - index) * chunk, (2 * size - index) * chunk, at::kLong)});
}

at::Tensor ringAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                         const Ring& ring) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.sizes() == q.sizes() && q.scalar_type() == at::kFloat,
              "ringAttention: q, k and v must be float32 [B, H, T, D] of one shape");
  TORCH_CHECK(ring.size() >= 1 && ring.index >= 0 && ring.index < ring.size() && (ring.size() == 1 || ring.comm),
              "ringAttention: member ", ring.index, " of a ring of ", ring.size(), " without a communicator");
  return RingAttention::apply(q, k, v, causal, &ring);
}

}  // namespace troupe::actors::train
