// The Python module of pdserve's C++ kernels (built by pdserve/models/native.py).

#include <torch/extension.h>

void paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, at::Tensor& out, double scale, int64_t partition_blocks,
                            int64_t window);
void add_rms_norm(at::Tensor& residual, const c10::optional<at::Tensor>& delta, const at::Tensor& weight,
                  at::Tensor& out, double eps);
void rotary_embedding(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
at::Tensor int8_head(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales);
#if defined(__AVX512BF16__)
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_zeros);
void bind_decode_stack(pybind11::module& m);
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Decode attention over a paged KV cache (CPU)",
        py::arg("query"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("out"),
        py::arg("scale"), py::arg("partition_blocks"), py::arg("window") = 0);
  m.def("add_rms_norm", &add_rms_norm, "residual += delta (in place), then RMSNorm of residual into out");
  m.def("rotary_embedding", &rotary_embedding, "Rotate-half rotary embedding, in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("int8_head", &int8_head, "x @ (int8 codes * group scales).T in float32: the output head's logits");
#if defined(__AVX512BF16__)  // only where the CPU has bf16 dot products; elsewhere torch's int4 kernel runs
  m.def("int4_linear", &int4_linear, "x @ (int4 codes * group scale + zero).T on bf16 dot products");
  bind_decode_stack(m);  // DecodeStack: a decode step through a Llama-family model's layers (its projections int4)
#endif
}
