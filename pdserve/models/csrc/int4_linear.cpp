// Decode rows on int4 weights with bf16 dot products (AVX512-BF16): out = x @ w.T, where each group
// of 32 weights along K is w = scale * q + zero - 8 * scale, q in 0..15 (torch's int4 kernel's
// centred codes, the same bf16 scale and zero per group).
//
// Why not torch's `_weight_int4pack_mm_for_cpu`: it converts every code to float for every row; at
// batch 1 it read SmolLM2's weights at 14-17 GB/s of this machine's ~28, and at 8 rows it was
// compute-bound. Here codes are unpacked once for all rows straight into bf16 lanes: the bf16 bit
// pattern 0x4300 | q is the number 128 + q, so one shift and one ternary-logic op per 32 codes, no
// integer-to-float conversion, and `vdpbf16ps` multiplies and sums pairs along K. Per group and row:
//   x . w = scale * (x . (128 + q)) + (zero - 136 * scale) * sum(x)
// with the group's sum of the row's bf16 activations computed once per call.
//
// A lane of the output vectors is a column (16 per block), so no horizontal sums; a pass computes
// 4 blocks (a panel of 64 columns) for 1 or 2 rows, the panel's codes one contiguous stream.
// Activations are rounded to bf16 (as torch's kernel takes them), products and sums are float32, the
// output is float32, rounded once to the activations' dtype. Each row is computed alone in a fixed
// order. Where the CPU has AMX, 2 rows or more run on tiles (below), whose sums are ordered otherwise:
// a row's result then depends on whether it came alone, unless the caller asks for `rows_alone`.

#include "kernels.h"

#include <ATen/Parallel.h>

#include "amx.h"
#include <immintrin.h>

#include <array>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__)

namespace {

constexpr int64_t kGroup = 32;

inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

// x[k], x[k + 1] (bf16) in every 32-bit lane: the pair a dot product step takes for all 16 columns.
inline __m512bh pair(const uint16_t* x) {
  int32_t bits;
  std::memcpy(&bits, x, sizeof(bits));
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(bits));
}

// 16 bf16 values (bits) from p as float32.
inline __m512 bf16x16(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

constexpr int kBlocks = 4;  // blocks of 16 columns a pass computes: four FMA chains in flight
constexpr int64_t kPanel = kBlocks * 16;  // columns whose codes lie together

// RB rows x the kBlocks blocks of 16 columns of one panel. A lane is a column: no horizontal sums.
// Per group, a block's codes are 4 vectors of 32 u16 lanes, 4 nibbles each: lane 2j + p, nibble t of
// vector l holds column j's code at k = 32 g + 2 (4 l + t) + p, so (lane >> 4 t) & 15 | 0x4300 is a
// dot product step's weights (128 + q as bf16) for the k pair 2 (4 l + t). A panel's codes are
// [K / 32, 4 (l), 4 (blocks), 32 lanes] and its scales [K / 32, 4 (blocks), 2 (scale, zero), 16]: one
// stream the prefetcher follows.
template <int RB>
void tile(const uint16_t* xb, const float* sums, int64_t k, const uint16_t* codes, const uint16_t* sz, float* out,
          int64_t out_stride) {
  const int64_t groups = k / kGroup;
  const __m512i nibble = _mm512_set1_epi16(0x000F), bf16_128 = _mm512_set1_epi16(0x4300);
  __m512 acc[RB][kBlocks];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < kBlocks; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[RB][kBlocks];
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < kBlocks; ++c) part[r][c] = _mm512_setzero_ps();
    for (int l = 0; l < 4; ++l) {
      __m512i raw[kBlocks];
      for (int c = 0; c < kBlocks; ++c) raw[c] = _mm512_loadu_si512(codes + g * 512 + l * 128 + c * 32);
      for (int t = 0; t < 4; ++t) {
        __m512bh w[kBlocks];
        for (int c = 0; c < kBlocks; ++c)
          w[c] = reinterpret_cast<__m512bh>(
              _mm512_ternarylogic_epi32(_mm512_srli_epi16(raw[c], 4 * t), nibble, bf16_128, 0xEA));  // (a & b) | c
        const int64_t kk = g * kGroup + 2 * (4 * l + t);
        for (int r = 0; r < RB; ++r) {
          const __m512bh x = pair(xb + r * k + kk);
          for (int c = 0; c < kBlocks; ++c) part[r][c] = _mm512_dpbf16_ps(part[r][c], w[c], x);
        }
      }
    }
    for (int c = 0; c < kBlocks; ++c) {
      const uint16_t* s = sz + g * 128 + c * 32;  // the block's 16 scales, then its 16 zeros
      const __m512 scale = bf16x16(s);
      const __m512 bias = _mm512_fnmadd_ps(_mm512_set1_ps(136.f), scale, bf16x16(s + 16));
      for (int r = 0; r < RB; ++r) {
        acc[r][c] = _mm512_fmadd_ps(part[r][c], scale, acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(bias, _mm512_set1_ps(sums[r * groups + g]), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < kBlocks; ++c) _mm512_storeu_ps(out + r * out_stride + c * 16, acc[r][c]);
}

constexpr int64_t kPassRows = 2;  // rows a panel's pass computes (more spill registers or starve the prefetcher)

#if defined(PDSERVE_AMX)
// The same sums on AMX tiles (Sapphire Rapids and later): a group's 16 k pairs x 16 columns of 128 + q,
// unpacked as above, are one B tile in the VNNI layout `tdpbf16ps` takes (a row is a k pair, a column's
// two bf16 side by side: the very vectors the AVX-512 path feeds `vdpbf16ps`), and the rows of x over
// the group are one A tile. One tile product replaces 16 dot product steps for every row, so the
// codes are unpacked once for up to 16 rows and the kernel stays near the read bandwidth of the codes
// where the AVX-512 path becomes compute-bound at a few rows. The group's scale and zero apply to the
// product tile in float32 as above. A row's result depends on its own x row only: not on the batch.
constexpr int64_t kTileRows = 16;
// Fewer rows than this run on the AVX-512 path (SmolLM2's 30 gate/up projections on a Xeon with AMX:
// 1 row 2.0 ms there vs 2.7 on tiles, 2 rows 3.1 vs 3.1, 4 rows 6.7 vs 3.2, 16 rows 25.6 vs 5.8).
constexpr int64_t kAmxMinRows = 2;

// Tiles: 0 = A (R rows of x over a group's 32 k), 1 / 6 / 7 = B (a block's unpacked group: 16 k pairs x
// 16 columns x 2), 2..5 = C (a block's R x 16 float32 products).
void configure_tiles(int rows) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = static_cast<uint8_t>(t == 1 || t >= 6 ? 16 : rows);
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// Group g's products for the panel's 4 blocks into c[block][R x 16].
template <int R>
inline void group_products(const uint16_t* xb, int64_t k, const uint16_t* codes, int64_t g, uint16_t (*b)[16 * 32],
                           float (*c)[R * 16]) {
  const __m512i nibble = _mm512_set1_epi16(0x000F), bf16_128 = _mm512_set1_epi16(0x4300);
  for (int blk = 0; blk < kBlocks; ++blk)
    for (int l = 0; l < 4; ++l) {
      const __m512i raw = _mm512_loadu_si512(codes + g * 512 + l * 128 + blk * 32);
      for (int t = 0; t < 4; ++t)
        _mm512_store_si512(b[blk] + (4 * l + t) * 32,
                           _mm512_ternarylogic_epi32(_mm512_srli_epi16(raw, 4 * t), nibble, bf16_128, 0xEA));
    }
  _tile_loadd(0, xb + g * kGroup, k * 2);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  _tile_loadd(1, b[0], 64);
  _tile_dpbf16ps(2, 0, 1);
  _tile_loadd(6, b[1], 64);
  _tile_dpbf16ps(3, 0, 6);
  _tile_loadd(7, b[2], 64);
  _tile_dpbf16ps(4, 0, 7);
  _tile_loadd(1, b[3], 64);
  _tile_dpbf16ps(5, 0, 1);
  _tile_stored(2, c[0], 64);
  _tile_stored(3, c[1], 64);
  _tile_stored(4, c[2], 64);
  _tile_stored(5, c[3], 64);
}

// One panel (64 columns) for R rows of xb; the first `valid` are stored. Group g + 1's tile products
// run before group g's are scaled (two buffers), so the scaling never waits for a tile store.
template <int R>
void amx_panel(const uint16_t* xb, int64_t valid, const float* sums, int64_t k, const uint16_t* codes,
               const uint16_t* sz, float* out, int64_t out_stride) {
  const int64_t groups = k / kGroup;
  alignas(64) uint16_t b[kBlocks][16 * 32];
  alignas(64) float c[2][kBlocks][R * 16];
  __m512 acc[R][kBlocks];  // in registers while R is small
  for (int r = 0; r < R; ++r)
    for (int blk = 0; blk < kBlocks; ++blk) acc[r][blk] = _mm512_setzero_ps();
  group_products<R>(xb, k, codes, 0, b, c[0]);
  for (int64_t g = 0; g < groups; ++g) {
    if (g + 1 < groups) group_products<R>(xb, k, codes, g + 1, b, c[(g + 1) & 1]);
    const float(*cg)[R * 16] = c[g & 1];
    for (int blk = 0; blk < kBlocks; ++blk) {
      const uint16_t* s = sz + g * 128 + blk * 32;
      const __m512 scale = bf16x16(s);
      const __m512 bias = _mm512_fnmadd_ps(_mm512_set1_ps(136.f), scale, bf16x16(s + 16));
      for (int r = 0; r < R; ++r) {
        acc[r][blk] = _mm512_fmadd_ps(_mm512_load_ps(cg[blk] + r * 16), scale, acc[r][blk]);
        acc[r][blk] = _mm512_fmadd_ps(bias, _mm512_set1_ps(sums[r * groups + g]), acc[r][blk]);
      }
    }
  }
  for (int r = 0; r < valid; ++r)
    for (int blk = 0; blk < kBlocks; ++blk) _mm512_storeu_ps(out + r * out_stride + blk * 16, acc[r][blk]);
}

using AmxPanel = void (*)(const uint16_t*, int64_t, const float*, int64_t, const uint16_t*, const uint16_t*, float*,
                          int64_t);

template <int... R>
constexpr std::array<AmxPanel, sizeof...(R)> amx_panels(std::integer_sequence<int, R...>) {
  return {amx_panel<R + 1>...};
}
constexpr auto kAmxPanels = amx_panels(std::make_integer_sequence<int, kTileRows>{});  // [R - 1]
#endif

}  // namespace

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_zeros, bool rows_alone) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be contiguous float32 or bfloat16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1), groups = k / kGroup, panels = codes.size(0), n = panels * kPanel;
  TORCH_CHECK(k % kGroup == 0, "K must be a multiple of 32");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kShort && codes.is_contiguous() &&
                  codes.size(1) == groups * 512,
              "codes must be contiguous int16 [N / 64, K / 32 * 512]");
  TORCH_CHECK(scales_zeros.dim() == 2 && scales_zeros.scalar_type() == at::kBFloat16 && scales_zeros.is_contiguous() &&
                  scales_zeros.size(0) == panels && scales_zeros.size(1) == groups * 128,
              "scales_zeros must be contiguous bfloat16 [N / 64, K / 32 * 128]");
  // The activations in bf16 (rounded as torch's kernel takes them) and each group's sum of them.
  const at::Tensor xb = x.scalar_type() == at::kBFloat16 ? x : x.to(at::kBFloat16);
  const uint16_t* xbits = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  std::vector<float> sums(m * groups);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.f;
      for (int64_t i = 0; i < kGroup; ++i) sum += bf16_bits_to_float(xbits[r * k + g * kGroup + i]);
      sums[r * groups + g] = sum;
    }
  auto out = at::empty({m, n}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const uint16_t* q = reinterpret_cast<const uint16_t*>(codes.data_ptr<int16_t>());
  const uint16_t* sz = reinterpret_cast<const uint16_t*>(scales_zeros.data_ptr<at::BFloat16>());
#if defined(PDSERVE_AMX)
  // Where AMX runs, batch-invariant callers (rows_alone) take it at any row count: every row one path.
  if (m > 0 && amx_runs() && (rows_alone || m >= kAmxMinRows)) {
    // Rows in even chunks of at most 16 (an A tile), zero-padded to the chunk size.
    const int64_t chunks = (m + kTileRows - 1) / kTileRows, rows = (m + chunks - 1) / chunks;
    std::vector<uint16_t> padded(chunks * rows * k, 0);
    std::memcpy(padded.data(), xbits, m * k * sizeof(uint16_t));
    sums.resize(chunks * rows * groups, 0.f);
    const AmxPanel panel = kAmxPanels[rows - 1];
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      configure_tiles(static_cast<int>(rows));
      for (int64_t p = begin; p < end; ++p)
        for (int64_t r0 = 0; r0 < m; r0 += rows)
          panel(padded.data() + r0 * k, std::min(rows, m - r0), sums.data() + r0 * groups, k, q + p * groups * 512,
                sz + p * groups * 128, o + r0 * n + p * kPanel, n);
      _tile_release();
    });
    return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
  }
#endif
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t r0 = 0; r0 < m; r0 += kPassRows) {  // the panel's codes stay in L1 for the next rows
        const auto tile_fn = m - r0 == 1 ? tile<1> : tile<2>;
        tile_fn(xbits + r0 * k, sums.data() + r0 * groups, k, q + p * groups * 512, sz + p * groups * 128,
                o + r0 * n + p * kPanel, n);
      }
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

#endif  // __AVX512BF16__
