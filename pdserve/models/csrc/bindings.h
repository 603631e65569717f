// What the two translation units that bind Python share (bindings.cpp, decode_stack.cpp).
#pragma once

#include <torch/extension.h>

#include "kernels.h"

// Every kernel is bound without the GIL, as torch's own ops are: a node's engine steps on one
// thread while its HTTP event loop and KV side channels run on others, and a step held under the
// GIL (DecodeStack: the whole decode step) would stop them all until it ends.
using without_gil = pybind11::call_guard<pybind11::gil_scoped_release>;

#if defined(__AVX512BF16__)
void bind_decode_stack(pybind11::module& m);
#endif
