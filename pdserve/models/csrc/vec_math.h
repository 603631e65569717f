// Helpers shared by pdserve's kernels: scalar ones written so that `#pragma omp simd` loops vectorize
// them, and exp_nonpositive on 16 AVX-512 lanes.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>

namespace pdserve {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// exp(x) for x in [-87, 0] (a score minus its running max), relative error ~1e-7 like expf, written
// so that a simd loop vectorizes it (libm's expf stays scalar without -ffast-math): Cody-Waite range
// reduction to r in [-ln2/2, ln2/2], Cephes' degree-6 polynomial, 2^n from the exponent bits.
// GCC 12 keeps a loop scalar for std::max (a reference), std::floor or memcpy: none is used.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const float n = (x * 1.44269504088896341f + kRound) - kRound;
  float r = x - n * 0.693359375f;
  r -= n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return y * __builtin_bit_cast(float, bits);  // memcpy would keep the loop scalar
}

inline void from_float(float x, float* out) { *out = x; }
inline void from_float(float x, c10::BFloat16* out) { *out = c10::BFloat16(x); }  // round to nearest even
inline void from_float(float x, c10::Half* out) { *out = c10::Half(x); }

// x as stored in scalar_t and read back: where a kernel must round like the torch expression it
// replaces (each bf16 op's result is rounded to bf16), it rounds its intermediates with this.
template <typename scalar_t>
inline float rounded(float x) {
  scalar_t stored;
  from_float(x, &stored);
  return to_float(stored);
}

// x * sigmoid(x): exp of -|x| only, so exp_nonpositive covers both signs.
inline float silu(float x) {
  const float e = exp_nonpositive(-std::abs(x));
  return x * (x >= 0.f ? 1.f : e) / (1.f + e);
}

#if defined(__AVX512F__)
// exp_nonpositive on 16 lanes: the same reduction and polynomial, 2^n by scalef.
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}
#endif

}  // namespace pdserve
