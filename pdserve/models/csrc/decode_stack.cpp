// A decode step through a Llama-family model's layers in one call: the kernels the Python layers
// call (RMSNorm, int4_linear, rotary_embedding, the KV write, paged_decode_attention, silu_and_mul),
// the same ones in the same order on the same tensors, so the results are the Python path's bit for
// bit; only the ~35 torch calls a layer make from Python (a few microseconds each: ~2.5 ms of a
// SmolLM2 step at batch 1) become C++ calls. models/decode_stack.py decides when it runs.
//
// Each kernel call is a profiler range (`native::...`), so the step profile still sees them.

#include "bindings.h"

#include <ATen/record_function.h>

#include <vector>

#if defined(__AVX512BF16__)

namespace {

// A projection on int4_linear's codes (quantization.NativeInt4Weight), with its bias if it has one.
struct Int4Projection {
  at::Tensor codes, scales_zeros;
  c10::optional<at::Tensor> bias;

  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor out;
    {
      RECORD_FUNCTION("native::int4_linear", std::vector<c10::IValue>());
      out = int4_linear(x.contiguous(), codes, scales_zeros);
    }
    return bias.has_value() ? out + *bias : out;  // as Linear.forward: decoded + bias
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;  // float32 weights
  Int4Projection qkv, o, gate_up, down;
  int64_t window;  // > 0: a sliding-window layer
};

class DecodeStack {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, double eps, at::ScalarType dtype)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), scale_(scale), eps_(eps), dtype_(dtype) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, at::Tensor qkv_codes, at::Tensor qkv_scales,
                 c10::optional<at::Tensor> qkv_bias, at::Tensor o_codes, at::Tensor o_scales,
                 c10::optional<at::Tensor> o_bias, at::Tensor gate_up_codes, at::Tensor gate_up_scales,
                 c10::optional<at::Tensor> gate_up_bias, at::Tensor down_codes, at::Tensor down_scales,
                 c10::optional<at::Tensor> down_bias, int64_t window) {
    layers_.push_back(Layer{std::move(input_norm), std::move(post_norm),
                            {std::move(qkv_codes), std::move(qkv_scales), std::move(qkv_bias)},
                            {std::move(o_codes), std::move(o_scales), std::move(o_bias)},
                            {std::move(gate_up_codes), std::move(gate_up_scales), std::move(gate_up_bias)},
                            {std::move(down_codes), std::move(down_scales), std::move(down_bias)},
                            window});
  }

  // residual [T, hidden] float32 (the embeddings; updated in place), T decode rows. Returns the last
  // layer's output, which the final norm adds into the residual (DecoderLM.forward).
  at::Tensor forward(at::Tensor residual, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t partition_blocks) {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one KV cache a layer");
    const int64_t tokens = residual.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    c10::optional<at::Tensor> delta;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      // DecoderLayer.forward: the input norm (the first layer's as RMSNorm.forward without a residual).
      at::Tensor h;
      if (!delta.has_value()) {
        h = at::rms_norm(residual.to(at::kFloat), {residual.size(-1)}, layer.input_norm.to(at::kFloat), eps_).to(dtype_);
      } else {
        h = at::empty(residual.sizes(), residual.options().dtype(dtype_));
        RECORD_FUNCTION("native::add_rms_norm", std::vector<c10::IValue>());
        add_rms_norm(residual, delta, layer.input_norm, h, eps_);
      }
      // QKVAttention.forward
      const at::Tensor qkv = layer.qkv(h);
      at::Tensor qk = qkv.slice(1, 0, q_size + kv_size).view({tokens, heads_ + kv_heads_, head_dim_});
      const at::Tensor v = qkv.slice(1, q_size + kv_size).view({tokens, kv_heads_, head_dim_});
      {
        RECORD_FUNCTION("native::rotary_embedding", std::vector<c10::IValue>());
        rotary_embedding(qk, positions, cos, sin);
      }
      const at::Tensor q = qk.slice(1, 0, heads_), k = qk.slice(1, heads_);
      // paged_attention: the new K and V into their slots, then the decode kernel (one group).
      const at::Tensor& kv_cache = kv_caches[i];
      kv_cache.select(0, 0).view({-1, kv_heads_, head_dim_}).index_copy_(0, slot_mapping, k.to(kv_cache.scalar_type()));
      kv_cache.select(0, 1).view({-1, kv_heads_, head_dim_}).index_copy_(0, slot_mapping, v.to(kv_cache.scalar_type()));
      at::Tensor attended = at::empty_like(q);
      {
        RECORD_FUNCTION("native::paged_decode_attention", std::vector<c10::IValue>());
        at::Tensor rows = attended.slice(0, 0, tokens);
        paged_decode_attention(q.slice(0, 0, tokens), kv_cache, block_tables, context_lens, rows, scale_,
                               partition_blocks, layer.window);
      }
      const at::Tensor attn_out = layer.o(attended.flatten(1));
      // MLP.forward on the post-attention norm.
      at::Tensor x = at::empty(residual.sizes(), residual.options().dtype(dtype_));
      {
        RECORD_FUNCTION("native::add_rms_norm", std::vector<c10::IValue>());
        add_rms_norm(residual, attn_out, layer.post_norm, x, eps_);
      }
      at::Tensor act;
      const at::Tensor gate_up = layer.gate_up(x);
      {
        RECORD_FUNCTION("native::silu_and_mul", std::vector<c10::IValue>());
        act = silu_and_mul(gate_up);
      }
      delta = layer.down(act);
    }
    return *delta;
  }

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double scale_, eps_;
  at::ScalarType dtype_;
  std::vector<Layer> layers_;
};

}  // namespace

void bind_decode_stack(pybind11::module& m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, at::ScalarType>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("forward", &DecodeStack::forward, without_gil());
}
#endif  // __AVX512BF16__
