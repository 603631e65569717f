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

#include "kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "amx.h"

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

#if defined(PDSERVE_AMX)
// The head on AMX tiles, as the transposed product out.T = W . x.T: 16 of W's rows (output columns),
// a group's 32 codes each converted to bf16 (exact: |q| <= 127), are an A tile as they lie (no
// transpose), and x.T over the group is the B tile. x is float32 and the logits must stay float32,
// so x is split into three bf16 parts, x = hi + mid + lo (24 bits of significand: x exactly), each
// product exact in float32; the three tile products add into one float32 tile, scaled per output
// column and group as above. A row's logits depend on its own x row only, whatever comes with it.
constexpr int64_t kTileRows = 16;
// Fewer rows than this stay on AVX-512 (SmolLM2's 49152 x 576 head on a Xeon with AMX: 1 / 2 / 4 / 8
// rows 3.1 / 3.4 / 4.8 / 9.7 ms there, 4.0 / 3.9 / 4.0 / 4.0 on tiles).
constexpr int64_t kAmxMinRows = 4;

// Tiles: 0 / 5 = A (16 columns' codes over a group, bf16), 1 / 2 / 3 = B (x.T's hi / mid / lo parts
// over the group: 16 k pairs x 16 rows x 2, zero past the rows given), 4 / 6 = C (16 columns x 16
// rows, float32). Full 64-byte tile rows at any row count: narrower ones ran ~10x slower here.
void configure_head_tiles() {
  TileConfig config;
  for (int t = 0; t <= 6; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// x's three bf16 parts, per group and part as B tiles: [group][part][16 k pairs][16 rows][2].
std::vector<uint16_t> split_rows(const float* x, int64_t rows, int64_t k) {
  const int64_t groups = k / kGroup;
  std::vector<uint16_t> parts(groups * 3 * 16 * kTileRows * 2, 0);
  auto bf16 = [](float v) {  // round to nearest even, as vcvtneps2bf16 (x holds no NaN here)
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
  };
  auto widen = [](uint16_t b) {
    const uint32_t bits = static_cast<uint32_t>(b) << 16;
    float v;
    std::memcpy(&v, &bits, sizeof(v));
    return v;
  };
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < k; ++i) {
      const float v = x[r * k + i];
      const uint16_t hi = bf16(v);
      const float rest = v - widen(hi);
      const uint16_t mid = bf16(rest);
      const uint16_t lo = bf16(rest - widen(mid));
      const int64_t g = i / kGroup, pair = (i % kGroup) / 2, p = i % 2;
      const uint16_t part[3] = {hi, mid, lo};
      for (int t = 0; t < 3; ++t) parts[((g * 3 + t) * 16 + pair) * kTileRows * 2 + r * 2 + p] = part[t];
    }
  return parts;
}

constexpr int64_t kChunkBlocks = 8;  // blocks of 16 columns sharing each group's x tiles

// Output columns [n0, n0 + 16 * blocks) for all rows (<= 16), group by group: each group's x tiles
// are loaded once for the chunk's blocks, whose sums wait in L1.
void head_chunk_amx(const uint16_t* parts, int64_t rows, int64_t k, const int8_t* q, const float* s, float* out,
                    int64_t n, int64_t n0, int64_t blocks) {
  const int64_t groups = k / kGroup, part_stride = 16 * kTileRows * 2;
  alignas(64) uint16_t a[2][16 * 32];
  alignas(64) float c[2][16 * 16];
  alignas(64) float acc[kChunkBlocks][16][16] = {};
  // Block blk's codes over group g, converted to bf16, into a.
  auto convert = [&](int64_t blk, int64_t g, uint16_t* dst) {
    for (int j = 0; j < 16; ++j) {
      const __m256i codes =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (n0 + blk * 16 + j) * k + g * kGroup));
      const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(codes)));
      const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(codes, 1)));
      _mm512_store_si512(dst + j * 32, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low)));
    }
  };
  // acc[blk] += the product in c, scaled per column for group g.
  auto scale_into = [&](int64_t blk, int64_t g, const float* product) {
    for (int j = 0; j < 16; ++j) {
      const int64_t column = n0 + blk * 16 + j;
      _mm512_store_ps(acc[blk][j], _mm512_fmadd_ps(_mm512_load_ps(product + j * 16),
                                                   _mm512_set1_ps(s[column * groups + g]), _mm512_load_ps(acc[blk][j])));
    }
  };
  // The tile intrinsics take tile numbers as literal tokens: A and C alternate between two pairs, so
  // one block's products run while the previous block's are scaled.
#define PDSERVE_HEAD_PRODUCT(A, C, dst)  \
  _tile_loadd(A, a[(blk) & 1], 64);      \
  _tile_zero(C);                          \
  _tile_dpbf16ps(C, A, 1);                \
  _tile_dpbf16ps(C, A, 2);                \
  _tile_dpbf16ps(C, A, 3);                \
  _tile_stored(C, dst, 64);
  for (int64_t g = 0; g < groups; ++g) {
    const uint16_t* bg = parts + g * 3 * part_stride;
    _tile_loadd(1, bg, 64);
    _tile_loadd(2, bg + part_stride, 64);
    _tile_loadd(3, bg + 2 * part_stride, 64);
    for (int64_t blk = 0; blk < blocks; ++blk) {
      convert(blk, g, a[blk & 1]);
      if (blk & 1) {
        PDSERVE_HEAD_PRODUCT(5, 6, c[1])
      } else {
        PDSERVE_HEAD_PRODUCT(0, 4, c[0])
      }
      if (blk > 0) scale_into(blk - 1, g, c[(blk - 1) & 1]);
    }
    scale_into(blocks - 1, g, c[(blocks - 1) & 1]);
  }
#undef PDSERVE_HEAD_PRODUCT
  for (int64_t blk = 0; blk < blocks; ++blk)
    for (int64_t r = 0; r < rows; ++r)
      for (int j = 0; j < 16; ++j) out[r * n + n0 + blk * 16 + j] = acc[blk][j][r];
}

void int8_head_amx(const float* x, const int8_t* codes, const float* scales, float* out, int64_t rows, int64_t n,
                   int64_t k) {
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    const int64_t rb = std::min(kTileRows, rows - r0);
    const std::vector<uint16_t> parts = split_rows(x + r0 * k, rb, k);
    const int64_t blocks = n / 16;
    at::parallel_for(0, (blocks + kChunkBlocks - 1) / kChunkBlocks, 1, [&](int64_t begin, int64_t end) {
      configure_head_tiles();
      for (int64_t chunk = begin; chunk < end; ++chunk)
        head_chunk_amx(parts.data(), rb, k, codes, scales, out + r0 * n, n, chunk * kChunkBlocks * 16,
                       std::min(kChunkBlocks, blocks - chunk * kChunkBlocks));
      _tile_release();
    });
  }
}
#endif

void int8_head_rows(const float* x, const int8_t* codes, const float* scales, float* out, int64_t rows, int64_t n,
                    int64_t k, bool rows_alone) {
#if defined(PDSERVE_AMX)
  if (rows > 0 && n % 16 == 0 && amx_runs() && (rows_alone || rows >= kAmxMinRows)) {
    int8_head_amx(x, codes, scales, out, rows, n, k);
    return;
  }
#endif
  const int64_t groups = k / kGroup;
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) head_column(x, rows, k, codes + j * k, scales + j * groups, out + j, n);
  });
}

}  // namespace

at::Tensor int8_head(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, bool rows_alone) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous() &&
                  codes.size(1) == x.size(1) && x.size(1) % kGroup == 0,
              "codes must be contiguous int8 [N, K], K a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) / kGroup,
              "scales must be contiguous float32 [N, K / 32]");
  auto out = at::empty({x.size(0), codes.size(0)}, x.options());
  int8_head_rows(x.data_ptr<float>(), codes.data_ptr<int8_t>(), scales.data_ptr<float>(), out.data_ptr<float>(),
                 x.size(0), codes.size(0), x.size(1), rows_alone);
  return out;
}
