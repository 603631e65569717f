// The kernels of pdserve's C++ extension, for the module's bindings and for each other.
#pragma once

// ATen's tensor and the ops the kernels call, not torch/extension.h: that header (autograd, the
// C++ frontend, pybind11) took ~20 s of compiling per translation unit; only the two that bind
// Python (bindings.cpp, decode_stack.cpp) include it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

void paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, at::Tensor& out, double scale, int64_t partition_blocks,
                            int64_t window);
extern int64_t prefetch_tokens;  // decode attention's prefetch distance (paged_decode_attention.cpp)
void prefill_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, at::Tensor& out,
                       double scale);
void add_rms_norm(at::Tensor& residual, const c10::optional<at::Tensor>& delta, const at::Tensor& weight,
                  at::Tensor& out, double eps);
void rotary_embedding(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
// rows_alone: every row takes the same kernel path whatever the row count (batch-invariant mode).
at::Tensor int8_head(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, bool rows_alone = false);
#if defined(__AVX512BF16__)
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_zeros,
                       bool rows_alone = false);
#endif
