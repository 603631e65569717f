// The Python module of pdserve's C++ kernels (built by pdserve/models/native.py).

#include "amx.h"
#include "bindings.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Decode attention over a paged KV cache (CPU)",
        py::arg("query"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("out"),
        py::arg("scale"), py::arg("partition_blocks"), py::arg("window") = 0, without_gil());
  m.def("add_rms_norm", &add_rms_norm, "residual += delta (in place), then RMSNorm of residual into out",
        without_gil());
  m.def("rotary_embedding", &rotary_embedding, "Rotate-half rotary embedding, in place", without_gil());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up", without_gil());
  m.def("int8_head", &int8_head, "x @ (int8 codes * group scales).T in float32: the output head's logits",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("rows_alone") = false, without_gil());
  m.def("set_prefetch_tokens", [](int64_t tokens) {
    TORCH_CHECK(tokens >= 0, "prefetch tokens must be >= 0");
    const int64_t previous = prefetch_tokens;
    prefetch_tokens = tokens;
    return previous;
  }, "how far ahead (tokens) decode attention prefetches KV (0: not at all); returns the previous setting");
  m.def("amx_available", &amx_available, "whether pdserve's kernels can run on AMX tiles here");
  m.def("amx", &amx_runs, "whether pdserve's kernels run on AMX tiles");
  m.def("set_amx", [](bool enabled) {
    const bool previous = amx_enabled;
    amx_enabled = enabled;
    return previous;
  }, "pdserve's kernels on AMX tiles where available (true) or on AVX-512 alone; returns the previous setting");
#if defined(__AVX512BF16__)  // only where the CPU has bf16 dot products; elsewhere torch's int4 kernel runs
  m.def("int4_linear", &int4_linear, "x @ (int4 codes * group scale + zero).T on bf16 dot products (AMX tiles "
        "where the CPU has them)", py::arg("x"), py::arg("codes"), py::arg("scales_zeros"), py::arg("rows_alone") = false, without_gil());
  bind_decode_stack(m);
  m.def("prefill_attention", &prefill_attention, "Causal prefill attention of one sequence on bf16 dot products",
        py::arg("query"), py::arg("key"), py::arg("value"), py::arg("out"), py::arg("scale"), without_gil());  // DecodeStack: a decode step through a Llama-family model's layers (its projections int4)
#endif
}
