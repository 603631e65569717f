// The elementwise chains of a decoder layer, one pass over memory each: residual add + RMSNorm,
// rotary embedding in place, SiLU(gate) * up. At decode batch sizes each torch op is a few
// microseconds of dispatch for a few hundred floats of work, and a layer ran about twenty of them.
//
// Math is float32. Norm results are rounded once to the output's dtype, as the torch path (which
// normalizes in float32) does. Rotary embedding and SiLU * up round like the torch expressions they
// replace, op by op (a bf16 product is rounded to bf16): computed in float32 instead, a bf16 model's
// greedy answer moved away from transformers' at a near-tie.

#include "kernels.h"
#include "vec_math.h"

#include <ATen/Parallel.h>

namespace {

using pdserve::from_float;
using pdserve::rounded;
using pdserve::to_float;

template <typename in_t, typename out_t>
void add_rms_norm_rows(float* residual, const in_t* delta, const float* weight, out_t* out, int64_t rows,
                       int64_t dim, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* x = residual + r * dim;
      if (delta != nullptr) {
        const in_t* d = delta + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) x[i] += to_float(d[i]);
      }
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < dim; ++i) squares += x[i] * x[i];
      const float inv_rms = 1.f / std::sqrt(squares / static_cast<float>(dim) + eps);
      out_t* o = out + r * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) from_float(x[i] * inv_rms * weight[i], o + i);
    }
  });
}

template <typename in_t>
void add_rms_norm_to(at::Tensor& residual, const in_t* delta, const at::Tensor& weight, at::Tensor& out, float eps) {
  const int64_t dim = residual.size(-1), rows = residual.numel() / dim;
  float* r = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  switch (out.scalar_type()) {
    case at::kFloat: add_rms_norm_rows(r, delta, w, out.data_ptr<float>(), rows, dim, eps); break;
    case at::kBFloat16: add_rms_norm_rows(r, delta, w, out.data_ptr<c10::BFloat16>(), rows, dim, eps); break;
    case at::kHalf: add_rms_norm_rows(r, delta, w, out.data_ptr<c10::Half>(), rows, dim, eps); break;
    default: TORCH_CHECK(false, "add_rms_norm: out must be float32, bfloat16 or float16");
  }
}

template <typename scalar_t>
void rotate_rows(scalar_t* data, int64_t tokens, int64_t heads, int64_t token_stride, int64_t head_stride,
                 int64_t head_dim, const int64_t* positions, const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + positions[t] * head_dim;  // the table's halves are equal: read the first
      const float* s = sin + positions[t] * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* x = data + t * token_stride + h * head_stride;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          // x * cos + rotate_half(x) * sin, with the torch expression's roundings (the tables too).
          const float ci = rounded<scalar_t>(c[i]), si = rounded<scalar_t>(s[i]);
          const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
          from_float(rounded<scalar_t>(x1 * ci) - rounded<scalar_t>(x2 * si), x + i);
          from_float(rounded<scalar_t>(x2 * ci) + rounded<scalar_t>(x1 * si), x + i + half);
        }
      }
    }
  });
}

template <typename scalar_t>
void silu_and_mul_rows(const scalar_t* gate_up, scalar_t* out, int64_t rows, int64_t dim) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = gate_up + r * 2 * dim;
      const scalar_t* u = g + dim;
      scalar_t* o = out + r * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) {
        from_float(rounded<scalar_t>(pdserve::silu(to_float(g[i]))) * to_float(u[i]), o + i);  // silu(g), then * u
      }
    }
  });
}

}  // namespace

// residual [rows, dim] float32, updated in place: residual += delta (if given); then
// out = residual / rms(residual) * weight, out [rows, dim] in float32, bfloat16 or float16.
void add_rms_norm(at::Tensor& residual, const c10::optional<at::Tensor>& delta, const at::Tensor& weight,
                  at::Tensor& out, double eps) {
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous(), "residual must be contiguous float32");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == residual.size(-1),
              "weight must be contiguous float32 of the rows' size");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == residual.sizes(), "out must be contiguous, of residual's shape");
  if (!delta.has_value()) {
    add_rms_norm_to<float>(residual, nullptr, weight, out, static_cast<float>(eps));
    return;
  }
  const at::Tensor& d = *delta;
  TORCH_CHECK(d.is_contiguous() && d.sizes() == residual.sizes(), "delta must be contiguous, of residual's shape");
  switch (d.scalar_type()) {
    case at::kFloat: add_rms_norm_to(residual, d.data_ptr<float>(), weight, out, static_cast<float>(eps)); break;
    case at::kBFloat16: add_rms_norm_to(residual, d.data_ptr<c10::BFloat16>(), weight, out, static_cast<float>(eps)); break;
    case at::kHalf: add_rms_norm_to(residual, d.data_ptr<c10::Half>(), weight, out, static_cast<float>(eps)); break;
    default: TORCH_CHECK(false, "add_rms_norm: delta must be float32, bfloat16 or float16");
  }
}

// x [tokens, heads, head_dim] (any token and head strides, head_dim contiguous), rotated in place by
// the rotate-half (GPT-NeoX) rule at positions [tokens] int64; cos, sin [max_positions, head_dim] float32.
void rotary_embedding(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "x must be [tokens, heads, even head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == x.size(0),
              "positions must be contiguous int64, one per token");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.size(1) == x.size(2) && sin.sizes() == cos.sizes(),
              "cos and sin must be contiguous float32 [max_positions, head_dim]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < x.size(0); ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " is outside the rotary table");
  }
  switch (x.scalar_type()) {
    case at::kFloat:
      rotate_rows(x.data_ptr<float>(), x.size(0), x.size(1), x.stride(0), x.stride(1), x.size(2), pos,
                  cos.data_ptr<float>(), sin.data_ptr<float>());
      break;
    case at::kBFloat16:
      rotate_rows(x.data_ptr<c10::BFloat16>(), x.size(0), x.size(1), x.stride(0), x.stride(1), x.size(2), pos,
                  cos.data_ptr<float>(), sin.data_ptr<float>());
      break;
    default: TORCH_CHECK(false, "rotary_embedding: x must be float32 or bfloat16");
  }
}

// gate_up [rows, 2 * dim] (gate then up) -> silu(gate) * up, [rows, dim] of the same dtype.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be contiguous [rows, 2 * dim]");
  const int64_t rows = gate_up.size(0), dim = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, dim}, gate_up.options());
  switch (gate_up.scalar_type()) {
    case at::kFloat: silu_and_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, dim); break;
    case at::kBFloat16:
      silu_and_mul_rows(gate_up.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows, dim);
      break;
    default: TORCH_CHECK(false, "silu_and_mul: gate_up must be float32 or bfloat16");
  }
  return out;
}
