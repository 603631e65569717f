// Causal prefill attention of one sequence's chunk on bf16 dot products (AVX512-BF16), flash style:
// queries [n, heads, D], keys and values [m, kv_heads, D], the chunk's own tokens last, so query i
// sits at position m - n + i and sees keys 0 .. m - n + i.
//
// Why: torch's CPU flash attention ran a 2048-token prefill's attention at ~63 GFLOP/s on an AVX-512
// CPU whose bf16 GEMM runs ~440 (69 % of the prefill's time). Here K and V are packed once per KV
// head into dot-product pairs (K: two dims of a key per 32-bit lane, 64 keys a tile; V: two keys of
// a dim per lane), so that a query row's 64 scores and its weighted V sums are each D/2 x 4 or 32 x
// D/16 vdpbf16ps with the row's own pair broadcast: no horizontal sums. A unit is (KV head, 16
// queries): its rows (queries x the heads sharing that KV head) keep an online softmax in float32,
// probabilities rounded to bf16 for the V products as a bf16 flash attention does. Tiles of 64 keys
// and 6 rows a pass (head size 64) ran 1.75-1.8x tiles of 32 and 2 rows on an AMD EPYC (Zen 5):
// the per-tile softmax work (a horizontal max, the rescale) is spread over more dot products.

#include "kernels.h"
#include "vec_math.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512BF16__)
namespace {

using pdserve::exp_nonpositive16;

constexpr int64_t kQueryTile = 16;  // queries a unit takes (x the heads of its KV head: its rows)
constexpr int64_t kKeyTile = 64;    // keys a packed tile holds: four vectors of scores

inline __mmask16 first_lanes(int64_t count) {  // lanes 0 .. count - 1 (count clamped to 0 .. 16)
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : count <= 0 ? 0 : static_cast<__mmask16>((1u << count) - 1);
}

// One KV head's keys and values packed by tiles of T = kKeyTile keys (zeros past m):
//   K tile t: [D/2][T] 32-bit lanes, lane (p, j) = dims 2p, 2p + 1 of key T t + j;
//   V tile t: [T/2][D] 32-bit lanes, lane (q, d) = dim d of keys T t + 2q and T t + 2q + 1.
template <int D>
void pack(const uint16_t* k, const uint16_t* v, int64_t m, int64_t kv_heads, int64_t kv_head, uint32_t* kp,
          uint32_t* vp) {
  const int64_t tiles = (m + kKeyTile - 1) / kKeyTile, row = kv_heads * D;
  for (int64_t t = 0; t < tiles; ++t) {
    uint32_t* kt = kp + t * (D / 2) * kKeyTile;
    uint16_t* vt = reinterpret_cast<uint16_t*>(vp + t * (kKeyTile / 2) * D);
    for (int64_t j = 0; j < kKeyTile; ++j) {
      const int64_t key = t * kKeyTile + j;
      if (key < m) {
        uint32_t pairs[D / 2];
        std::memcpy(pairs, k + key * row + kv_head * D, sizeof(pairs));
        for (int p = 0; p < D / 2; ++p) kt[p * kKeyTile + j] = pairs[p];
        const uint16_t* vr = v + key * row + kv_head * D;
        for (int d = 0; d < D; ++d) vt[((j / 2) * D + d) * 2 + j % 2] = vr[d];
      } else {
        for (int p = 0; p < D / 2; ++p) kt[p * kKeyTile + j] = 0;
        for (int d = 0; d < D; ++d) vt[((j / 2) * D + d) * 2 + j % 2] = 0;
      }
    }
  }
}

// R rows (r0 .. r0 + R - 1) of a unit against one packed key tile (keys j0 ..): their scores share
// each K vector load, their weighted sums each V vector load. A row's softmax sum stays 16 lanes wide
// (summed across once, at the unit's end) and its rescale factor is a vector exp: the per-tile work
// outside the dot products is one horizontal max a row.
template <int D, int R>
inline void rows_on_tile(const uint16_t* q, const uint32_t* kt, const uint32_t* vt, int64_t heads, int64_t kv_head,
                         int64_t group, int64_t q0, int64_t offset, int64_t j0, int64_t r0, float scale, float* acc,
                         float* maxes, float* sums) {
  constexpr int C = D / 16, S = kKeyTile / 16;  // vectors of a row's weighted sums, of its scores
  const uint32_t* qrow[R];
  int64_t visible[R], most = 0;
  for (int i = 0; i < R; ++i) {
    const int64_t r = r0 + i, qi = q0 + r / group, head = kv_head * group + r % group;
    visible[i] = std::min<int64_t>(kKeyTile, offset + qi - j0 + 1);  // keys j0 .. j0 + visible - 1
    most = std::max(most, visible[i]);
    qrow[i] = reinterpret_cast<const uint32_t*>(q + (qi * heads + head) * D);
  }
  __m512 scores[R][S];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < S; ++j) scores[i][j] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int p = 0; p < D / 2; ++p) {
    __m512bh keys[S];
    for (int j = 0; j < S; ++j) keys[j] = (__m512bh)_mm512_load_si512(kt + p * kKeyTile + 16 * j);
    for (int i = 0; i < R; ++i) {
      const __m512bh pair = (__m512bh)_mm512_set1_epi32(static_cast<int>(qrow[i][p]));
      for (int j = 0; j < S; ++j) scores[i][j] = _mm512_dpbf16_ps(scores[i][j], pair, keys[j]);
    }
  }
  alignas(64) uint16_t probs[R][kKeyTile];
  __m512 rescale[R];
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), sc = _mm512_set1_ps(scale);
  for (int i = 0; i < R; ++i) {
    const int64_t r = r0 + i;
    __mmask16 masks[S];
    __m512 x[S], top = ninf;
    for (int j = 0; j < S; ++j) {  // scaled scores, -inf past the visible keys
      masks[j] = first_lanes(visible[i] - 16 * j);
      x[j] = _mm512_mask_mul_ps(ninf, masks[j], scores[i][j], sc);
      top = _mm512_max_ps(top, x[j]);
    }
    const float new_max = std::max(maxes[r], _mm512_reduce_max_ps(top));
    // exp(old - new): ~0 on a row's first keys (old = -inf is clamped to -87; its sums are 0 yet).
    rescale[i] = exp_nonpositive16(_mm512_set1_ps(maxes[r] - new_max));
    maxes[r] = new_max;
    top = _mm512_set1_ps(new_max);
    __m512 total = _mm512_setzero_ps();
    for (int j = 0; j < S; j += 2) {  // two vectors of probabilities make one of bf16 pairs
      const __m512 lo = _mm512_maskz_mov_ps(masks[j], exp_nonpositive16(_mm512_sub_ps(x[j], top)));
      const __m512 hi = _mm512_maskz_mov_ps(masks[j + 1], exp_nonpositive16(_mm512_sub_ps(x[j + 1], top)));
      total = _mm512_add_ps(total, _mm512_add_ps(lo, hi));
      _mm512_store_si512(probs[i] + 16 * j, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));  // keys 16 j.. low, then high
    }
    float* sum = sums + r * 16;
    _mm512_storeu_ps(sum, _mm512_fmadd_ps(_mm512_loadu_ps(sum), rescale[i], total));
  }
  __m512 sum_v[R][C];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) sum_v[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + i) * D + 16 * c), rescale[i]);
  // Pairs of keys past a row's visible ones have probability 0 (and V is zero-padded past the keys).
  for (int64_t pq = 0; pq < (most + 1) / 2; ++pq) {
    __m512bh pair[R];
    for (int i = 0; i < R; ++i)
      pair[i] = (__m512bh)_mm512_set1_epi32(static_cast<int>(reinterpret_cast<const uint32_t*>(probs[i])[pq]));
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m512bh values = (__m512bh)_mm512_load_si512(vt + pq * D + 16 * c);
      for (int i = 0; i < R; ++i) sum_v[i][c] = _mm512_dpbf16_ps(sum_v[i][c], pair[i], values);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (r0 + i) * D + 16 * c, sum_v[i][c]);
}

// Queries q0 .. q1 - 1 of the heads sharing KV head `kv_head`, over that head's packed keys.
template <int D>
void attend_unit(const uint16_t* q, uint16_t* out, const uint32_t* kp, const uint32_t* vp, int64_t n, int64_t m,
                 int64_t heads, int64_t kv_head, int64_t group, int64_t q0, int64_t q1, float scale) {
  // Rows a pass takes together: their scores (4 vectors each) and weighted sums (D/16) nearly fill
  // the 32 vector registers.
  constexpr int kRows = D == 64 ? 6 : 2;
  const int64_t rows = (q1 - q0) * group, offset = m - n;
  std::vector<float> acc(rows * D, 0.f), maxes(rows, -std::numeric_limits<float>::infinity()), sums(rows * 16, 0.f);
  const int64_t last_key = offset + q1 - 1;  // the unit's last query's own position
  for (int64_t j0 = 0; j0 <= last_key; j0 += kKeyTile) {
    const uint32_t* kt = kp + (j0 / kKeyTile) * (D / 2) * kKeyTile;
    const uint32_t* vt = vp + (j0 / kKeyTile) * (kKeyTile / 2) * D;
    // Rows whose query sees none of these keys (its position is before j0) are skipped: rows run by
    // query, so those are the first ones.
    int64_t r = 0;
    while (r < rows && offset + q0 + r / group < j0) ++r;
    for (; r + kRows <= rows; r += kRows)
      rows_on_tile<D, kRows>(q, kt, vt, heads, kv_head, group, q0, offset, j0, r, scale, acc.data(), maxes.data(),
                             sums.data());
    for (; r < rows; ++r)
      rows_on_tile<D, 1>(q, kt, vt, heads, kv_head, group, q0, offset, j0, r, scale, acc.data(), maxes.data(),
                         sums.data());
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t qi = q0 + r / group, head = kv_head * group + r % group;
    const float inv = 1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(sums.data() + r * 16));
    auto* o = reinterpret_cast<c10::BFloat16*>(out + (qi * heads + head) * D);
    for (int64_t d = 0; d < D; ++d) o[d] = c10::BFloat16(acc[r * D + d] * inv);
  }
}

template <int D>
void prefill(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int64_t n, int64_t m,
             int64_t heads, int64_t kv_heads, float scale) {
  const int64_t tiles = (m + kKeyTile - 1) / kKeyTile, group = heads / kv_heads;
  const int64_t k_words = tiles * (D / 2) * kKeyTile, v_words = tiles * (kKeyTile / 2) * D;
  // torch's allocation is 64-byte aligned, and every tile a multiple of 64 bytes: whole-vector loads.
  auto packed = at::empty({kv_heads, k_words + v_words}, at::kInt);
  auto* words = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
  at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) pack<D>(k, v, m, kv_heads, h, words + h * (k_words + v_words),
                                                  words + h * (k_words + v_words) + k_words);
  });
  const int64_t q_tiles = (n + kQueryTile - 1) / kQueryTile;
  at::parallel_for(0, kv_heads * q_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t h = unit / q_tiles, t = unit % q_tiles;
      const uint32_t* kp = words + h * (k_words + v_words);
      attend_unit<D>(q, out, kp, kp + k_words, n, m, heads, h, group, t * kQueryTile,
                     std::min(n, (t + 1) * kQueryTile), scale);
    }
  });
}

}  // namespace
#endif

// query [n, heads, D], key / value [m, kv_heads, D], all bf16 and contiguous; out like query.
void prefill_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, at::Tensor& out,
                       double scale) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
                  value.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "prefill_attention takes bf16 tensors");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.sizes() == key.sizes() && out.sizes() == query.sizes(),
              "prefill_attention: query / out [n, heads, D], key / value [m, kv_heads, D]");
  TORCH_CHECK(query.is_contiguous() && key.is_contiguous() && value.is_contiguous() && out.is_contiguous(),
              "prefill_attention takes contiguous tensors");
  const int64_t n = query.size(0), heads = query.size(1), dim = query.size(2), m = key.size(0), kv_heads = key.size(1);
  TORCH_CHECK(key.size(2) == dim && heads % kv_heads == 0 && m >= n, "prefill_attention: shapes do not match");
  const auto* q = reinterpret_cast<const uint16_t*>(query.data_ptr());
  const auto* k = reinterpret_cast<const uint16_t*>(key.data_ptr());
  const auto* v = reinterpret_cast<const uint16_t*>(value.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float s = static_cast<float>(scale);
  switch (dim) {
    case 64: prefill<64>(q, k, v, o, n, m, heads, kv_heads, s); break;
    case 128: prefill<128>(q, k, v, o, n, m, heads, kv_heads, s); break;
    default: TORCH_CHECK(false, "prefill_attention: head size 64 or 128, got ", dim);
  }
#else
  TORCH_CHECK(false, "prefill_attention needs a CPU with AVX512-BF16");
#endif
}
