// The output head on int8 codes with float32 logits: out[m, n] = sum over groups g of
// scale[n, g] * (x[m, g*32 : g*32+32] . codes[n, g*32 : g*32+32]), accumulated and written in float32.
//
// torch's own int8 kernel (_weight_int8pack_mm) takes one scale per row and writes the input's
// dtype: fed bf16 (its fast path) it rounds the logits to bf16, a step of 0.125 at SmolLM2's
// magnitudes, which made greedy ties (and a wrong answer) common. Groups of 32 with their own scale
// are GGUF's Q8_0 layout, so a Q8_0 head is served as the file holds it.
//
// A row's result depends on that row and the weights only (one fixed reduction order per K), not on
// how many rows come with it. Rows share each weight group while it is in L1 (decode is memory-bound).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

namespace {

constexpr int64_t kGroup = 32;

#if defined(__AVX512F__)
// Lanes of 16: a group is two vectors; a row keeps one accumulator vector, summed across lanes at the end.
void head_column(const float* x, int64_t rows, int64_t k, const int8_t* q, const float* s, float* out, int64_t n) {
  constexpr int64_t kRowBlock = 8;
  for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
    const int64_t rb = std::min(kRowBlock, rows - r0);
    __m512 acc[kRowBlock];
    for (int64_t r = 0; r < rb; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < k / kGroup; ++g) {
      const int8_t* qg = q + g * kGroup;
      const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg))));
      const __m512 w1 =
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + 16))));
      const __m512 scale = _mm512_set1_ps(s[g]);
      for (int64_t r = 0; r < rb; ++r) {
        const float* xg = x + (r0 + r) * k + g * kGroup;
        const __m512 dot = _mm512_fmadd_ps(_mm512_loadu_ps(xg + 16), w1, _mm512_mul_ps(_mm512_loadu_ps(xg), w0));
        acc[r] = _mm512_fmadd_ps(dot, scale, acc[r]);
      }
    }
    for (int64_t r = 0; r < rb; ++r) out[(r0 + r) * n] = _mm512_reduce_add_ps(acc[r]);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// Lanes of 8: a group is four vectors.
float sum_lanes(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

void head_column(const float* x, int64_t rows, int64_t k, const int8_t* q, const float* s, float* out, int64_t n) {
  constexpr int64_t kRowBlock = 8;
  for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
    const int64_t rb = std::min(kRowBlock, rows - r0);
    __m256 acc[kRowBlock];
    for (int64_t r = 0; r < rb; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < k / kGroup; ++g) {
      __m256 w[4];
      for (int i = 0; i < 4; ++i)
        w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + g * kGroup + 8 * i))));
      const __m256 scale = _mm256_set1_ps(s[g]);
      for (int64_t r = 0; r < rb; ++r) {
        const float* xg = x + (r0 + r) * k + g * kGroup;
        __m256 dot = _mm256_mul_ps(_mm256_loadu_ps(xg), w[0]);
        for (int i = 1; i < 4; ++i) dot = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 8 * i), w[i], dot);
        acc[r] = _mm256_fmadd_ps(dot, scale, acc[r]);
      }
    }
    for (int64_t r = 0; r < rb; ++r) out[(r0 + r) * n] = sum_lanes(acc[r]);
  }
}
#else
void head_column(const float* x, int64_t rows, int64_t k, const int8_t* q, const float* s, float* out, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    float acc = 0.f;
    for (int64_t g = 0; g < k / kGroup; ++g) {
      float dot = 0.f;
      for (int64_t i = 0; i < kGroup; ++i) dot += x[r * k + g * kGroup + i] * static_cast<float>(q[g * kGroup + i]);
      acc += dot * s[g];
    }
    out[r * n] = acc;
  }
}
#endif

void int8_head_rows(const float* x, const int8_t* codes, const float* scales, float* out, int64_t rows, int64_t n,
                    int64_t k) {
  const int64_t groups = k / kGroup;
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) head_column(x, rows, k, codes + j * k, scales + j * groups, out + j, n);
  });
}

}  // namespace

at::Tensor int8_head(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous() &&
                  codes.size(1) == x.size(1) && x.size(1) % kGroup == 0,
              "codes must be contiguous int8 [N, K], K a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) / kGroup,
              "scales must be contiguous float32 [N, K / 32]");
  auto out = at::empty({x.size(0), codes.size(0)}, x.options());
  int8_head_rows(x.data_ptr<float>(), codes.data_ptr<int8_t>(), scales.data_ptr<float>(), out.data_ptr<float>(),
                 x.size(0), codes.size(0), x.size(1));
  return out;
}
