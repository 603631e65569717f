// Decode attention over the paged KV cache, reading each block where it lies (no gather copy).
//
// One query token per sequence. Work units are (sequence, context partition), each KV head of it in
// turn on the AVX-512 path (a block's heads lie together), else (sequence, KV head, partition): a
// unit reads each K and V row of its partition once for all the query heads that share that KV
// head (GQA), and keeps an online softmax (running max, sum, weighted V) per head. Long contexts are
// split into partitions so that a batch of one still feeds every thread; a second pass merges the
// partitions' softmax states (flash-decoding).
//
// Built for the machine it runs on (-march=native, cached per CPU in pdserve/models/native.py);
// the SDPA path in attention.py stays the portable one.

#include "kernels.h"
#include "vec_math.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using pdserve::exp_nonpositive;
#if defined(__AVX512F__)
using pdserve::exp_nonpositive16;
#endif
using pdserve::to_float;

constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxGroup = 16;  // query heads per KV head
constexpr int64_t kMaxKvHeads = 64;
constexpr int64_t kMaxBlockSize = 128;
}  // namespace

// How far ahead, in tokens, the prefetches ask: a block size's run ahead is then the same bytes
// (measured on blocks of 16: 2 blocks ahead beat 1 and 4); 0: no prefetch. Set by set_prefetch_tokens.
int64_t prefetch_tokens = 32;

namespace {

inline int64_t prefetch_blocks(int64_t block_size) {
  return prefetch_tokens > 0 ? std::max<int64_t>(1, prefetch_tokens / block_size) : 0;
}

// The softmax state of one (sequence, KV head, partition): per query head, max, sum and sum(p * V).
struct Partial {
  float* max;  // [group]
  float* sum;  // [group]
  float* acc;  // [group, head_dim]
};

// Asks for the next block's K and V rows of this head while the current block is computed: blocks
// lie anywhere in the pool and the rows of one head are strided, so the hardware prefetcher does
// not run ahead, and a cold cache (every layer's KV, every step) left compute waiting on memory.
template <typename scalar_t>
inline void prefetch_block(const scalar_t* k_cache, const scalar_t* v_cache, int64_t offset, int64_t rows,
                           int64_t row_stride, int64_t dim) {
  constexpr int64_t kLine = 64 / sizeof(scalar_t);  // elements per cache line
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < dim; d += kLine) {
      __builtin_prefetch(k_cache + offset + r * row_stride + d);
      __builtin_prefetch(v_cache + offset + r * row_stride + d);
    }
  }
}

// One K or V row of one head (dim elements: 1 to 4 cache lines).
template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t dim) {
  constexpr int64_t kLine = 64 / sizeof(scalar_t);
  for (int64_t d = 0; d < dim; d += kLine) __builtin_prefetch(row + d);
}

// HEAD_DIM > 0: the head size known at compile time (64, 128), so that the inner loops unroll into
// registers; 0: any head size, read from head_dim.
template <typename scalar_t, int64_t HEAD_DIM>
void attend_partition(const float* q,  // [group, head_dim], already scaled
                      const scalar_t* k_cache, const scalar_t* v_cache,  // [num_blocks, block_size, kv_heads, head_dim]
                      const int64_t* blocks, int64_t first_block, int64_t last_block, int64_t start,
                      int64_t context_len, int64_t block_size, int64_t kv_heads, int64_t kv_head, int64_t head_dim, int64_t group,
                      Partial out) {
  const int64_t dim = HEAD_DIM > 0 ? HEAD_DIM : head_dim;
  const int64_t row_stride = kv_heads * dim;
  const int64_t block_stride = block_size * row_stride;
  float scores[kMaxGroup][kMaxBlockSize];
  float row[kMaxHeadDim];
  const int64_t ahead_blocks = prefetch_blocks(block_size);
  for (int64_t g = 0; g < group; ++g) {
    out.max[g] = -std::numeric_limits<float>::infinity();
    out.sum[g] = 0.f;
    std::fill(out.acc + g * dim, out.acc + (g + 1) * dim, 0.f);
  }
  for (int64_t b = first_block; b < last_block; ++b) {
    const int64_t rows = std::min(block_size, context_len - b * block_size);
    if (rows <= 0) break;
    const int64_t r0 = std::max<int64_t>(0, start - b * block_size);  // rows before the window: skipped
    const scalar_t* k_block = k_cache + blocks[b] * block_stride + kv_head * dim;
    const scalar_t* v_block = v_cache + blocks[b] * block_stride + kv_head * dim;
    if (ahead_blocks > 0 && b + ahead_blocks < last_block) {
      prefetch_block(k_cache, v_cache, blocks[b + ahead_blocks] * block_stride + kv_head * dim, block_size,
                     row_stride, dim);
    }
    // Scores of the block's rows for every query head of the group (each K row read once).
    for (int64_t r = r0; r < rows; ++r) {
      const scalar_t* k = k_block + r * row_stride;
      for (int64_t d = 0; d < dim; ++d) row[d] = to_float(k[d]);
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = q + g * dim;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < dim; ++d) dot += qg[d] * row[d];
        scores[g][r] = dot;
      }
    }
    // Online softmax: rescale each head's state to the new max once per block, then weights.
    for (int64_t g = 0; g < group; ++g) {
      float block_max = out.max[g];
#pragma omp simd reduction(max : block_max)
      for (int64_t r = r0; r < rows; ++r) block_max = scores[g][r] > block_max ? scores[g][r] : block_max;
      const float new_max = block_max;
      const float correction = std::exp(out.max[g] - new_max);  // 0 on the first block (max = -inf)
      out.max[g] = new_max;
      float* acc = out.acc + g * dim;
      for (int64_t d = 0; d < dim; ++d) acc[d] *= correction;
      float* probs = scores[g];
      float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
      for (int64_t r = r0; r < rows; ++r) {
        probs[r] = exp_nonpositive(probs[r] - new_max);
        block_sum += probs[r];
      }
      out.sum[g] = out.sum[g] * correction + block_sum;
    }
    // Weighted V rows (each V row read and converted once for the whole group).
    for (int64_t r = r0; r < rows; ++r) {
      const scalar_t* v = v_block + r * row_stride;
      for (int64_t d = 0; d < dim; ++d) row[d] = to_float(v[d]);
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g][r];
        float* acc = out.acc + g * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) acc[d] += p * row[d];
      }
    }
  }
}

#if defined(__AVX512F__)
// Vector c of a K or V row as float32, in "lane order": float32 and float16 rows in place (elements
// 16 c ..), a bf16 row by even and odd elements (vector 2 i: elements 32 i, 32 i + 2, ..; 2 i + 1: the
// odd ones), since a bf16 number is the high half of a float32: one shift or one mask converts it, no
// shuffle (the port that limited this loop). Queries and results are permuted alike (lane_element).
inline __m512 load_lanes(const float* p, int c) { return _mm512_loadu_ps(p + 16 * c); }
inline __m512 load_lanes(const c10::Half* p, int c) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * c)));
}
inline __m512 load_lanes(const c10::BFloat16* p, int c) {
  const __m512i pairs = _mm512_loadu_si512(p + 32 * (c / 2));
  return _mm512_castsi512_ps(c % 2 == 0 ? _mm512_slli_epi32(pairs, 16)
                                        : _mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
// The element of a row at lane i of vector c.
template <typename scalar_t>
inline int64_t lane_element(int c, int i) {
  return std::is_same_v<scalar_t, c10::BFloat16> ? 32 * (c / 2) + 2 * i + c % 2 : 16 * c + i;
}

// Lane j of the result: the sum of v[j]'s 16 lanes (16 dot products' horizontal sums in ~45 ops
// instead of ~8 a vector).
inline __m512 sum_each(__m512 v[16]) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // quads[i], 128-bit lane L: the sums over lane L of vectors 4i..4i+3; add the four 128-bit lanes.
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88), _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88), _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

#if defined(__AVX512BF16__)
// One key's dot product with a query as 16 partial sums: VECTORS x 32 bf16 of each, q = hi (+ lo).
template <int VECTORS>
inline __m512 bf16_dots(const c10::BFloat16* q_hi, const c10::BFloat16* q_lo, const c10::BFloat16* k) {
  __m512 dot = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int v = 0; v < VECTORS; ++v) {
    const __m512bh key = (__m512bh)_mm512_loadu_si512(k + 32 * v);
    dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(q_hi + 32 * v), key);
    if (q_lo != nullptr) dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(q_lo + 32 * v), key);
  }
  return dot;
}
#else
template <int VECTORS>
inline __m512 bf16_dots(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*) {
  return _mm512_setzero_ps();  // never called: BF16_DOTS needs AVX512-BF16
}
#endif

// One partition of one sequence for every KV head (a block's heads lie together), with AVX-512, for
// head sizes of CHUNKS x 16. Keys 16 at a time: a lane per key for the scores (16 dot products'
// sums in one tree) and the softmax (vector exp); each V row converted once for the query heads of
// its group; a head's weighted sums in registers over a block. Same math as the portable loop
// (float32, online softmax), summed in another order. Measured on SmolLM2's shape (AMD EPYC, one
// thread, bf16 KV, 30 layers): 1 x 2048 keys 5.8 -> 4.8 ms, 8 x 2048 43.9 -> 37.8 ms, 8 x 128
// 2.9 -> 2.6 ms; still ~10 GB/s of the ~27 a plain read reaches (the next thing to find).
//
// BF16_DOTS (bf16 KV on a CPU with AVX512-BF16): the scores on bf16 dot products instead, the query
// as bf16 (a bf16 model's query exactly; a float32 one's as the sum of two bf16 parts, hi and lo),
// scaled after the dot. A K row then needs no conversion: 2 vdpbf16ps per 64 elements where the
// float32 path spends 4 conversions and 4 FMAs per query head.
//
// GROUP > 0: the query heads per KV head known at compile time, so that a head's weighted sums
// (GROUP x CHUNKS vectors) stay in registers across a block's V rows; 0: any group, read from `group`
// (its sums then live in memory: a load and a store per FMA).
template <typename scalar_t, int CHUNKS, bool BF16_DOTS, int GROUP>
void attend_partition_avx512(const float* q,  // [kv_heads * group, dim] of this sequence, scaled (BF16_DOTS: null)
                             const c10::BFloat16* q_hi, const c10::BFloat16* q_lo,  // BF16_DOTS: unscaled; lo or null
                             float scale, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* blocks,
                             int64_t first_block, int64_t last_block, int64_t start, int64_t context_len,
                             int64_t block_size, int64_t kv_heads, int64_t group, Partial* parts /* [kv_heads] */) {
  constexpr int64_t dim = CHUNKS * 16;
  if constexpr (GROUP > 0) group = GROUP;
  const int64_t row_stride = kv_heads * dim, block_stride = block_size * row_stride;
  std::vector<float> lanes;  // the float32 queries in lane order (the bf16 dots read q_hi / q_lo instead)
  if constexpr (!BF16_DOTS) {
    lanes.resize(kv_heads * group * dim);
    for (int64_t head = 0; head < kv_heads * group; ++head)
      for (int c = 0; c < CHUNKS; ++c)
        for (int i = 0; i < 16; ++i) lanes[head * dim + 16 * c + i] = q[head * dim + lane_element<scalar_t>(c, i)];
  }
  for (int64_t h = 0; h < kv_heads; ++h)
    for (int64_t g = 0; g < group; ++g) {
      parts[h].max[g] = -std::numeric_limits<float>::infinity();
      parts[h].sum[g] = 0.f;
      std::fill(parts[h].acc + g * dim, parts[h].acc + (g + 1) * dim, 0.f);
    }
  alignas(64) float probs[kMaxGroup][16];
  float corrections[kMaxGroup];
  const int64_t ahead_blocks = prefetch_blocks(block_size);
  for (int64_t b = first_block; b < last_block; ++b) {
    const int64_t rows = std::min(block_size, context_len - b * block_size);
    if (rows <= 0) break;
    const int64_t r0 = std::max<int64_t>(0, start - b * block_size);  // rows before the window: skipped
    // The block ahead_blocks ahead is asked for a row at a time as this one's rows are computed:
    // a burst of a whole block's lines stalled the loop once the core's fill buffers were taken.
    const int64_t ahead = ahead_blocks > 0 && b + ahead_blocks < last_block ? blocks[b + ahead_blocks] * block_stride : -1;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const scalar_t* k_block = k_cache + blocks[b] * block_stride + h * dim;
      const scalar_t* v_block = v_cache + blocks[b] * block_stride + h * dim;
      // Head h's share of that block, in address order (the pool's lines one after another, so that
      // the L2 streamer sees a stream), not head h's rows, which are strided.
      const scalar_t* k_ahead = ahead >= 0 ? k_cache + ahead + h * block_size * dim : nullptr;
      const scalar_t* v_ahead = ahead >= 0 ? v_cache + ahead + h * block_size * dim : nullptr;
      const float* qh = BF16_DOTS ? nullptr : lanes.data() + h * group * dim;
      Partial& out = parts[h];
      __m512 acc[GROUP > 0 ? GROUP : kMaxGroup][CHUNKS];
      for (int64_t g = 0; g < group; ++g)
        for (int c = 0; c < CHUNKS; ++c) acc[g][c] = _mm512_loadu_ps(out.acc + g * dim + 16 * c);
      for (int64_t j0 = 0; j0 < rows; j0 += 16) {
        const int64_t lo = std::max(r0, j0), hi = std::min(rows, j0 + 16);  // the keys [lo, hi) of these 16
        if (lo >= hi) continue;
        const __mmask16 valid = static_cast<__mmask16>(((1u << (hi - j0)) - 1) & ~((1u << (lo - j0)) - 1));
        for (int64_t g = 0; g < group; ++g) {
          __m512 dots[16];
#pragma GCC unroll 16
          for (int64_t j = 0; j < 16; ++j) {
            if (g == 0 && k_ahead != nullptr && j0 + j < block_size) prefetch_row(k_ahead + (j0 + j) * dim, dim);
            // A key outside [lo, hi) may be unwritten: its lane computes a valid key's, then is masked.
            const scalar_t* k = k_block + std::min(std::max(j0 + j, lo), hi - 1) * row_stride;
            if constexpr (BF16_DOTS) {
              dots[j] = bf16_dots<CHUNKS / 2>(q_hi + (h * group + g) * dim, q_lo ? q_lo + (h * group + g) * dim : nullptr,
                                              reinterpret_cast<const c10::BFloat16*>(k));
            } else {
              dots[j] = _mm512_mul_ps(_mm512_loadu_ps(qh + g * dim), load_lanes(k, 0));
#pragma GCC unroll 16
              for (int c = 1; c < CHUNKS; ++c)
                dots[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qh + g * dim + 16 * c), load_lanes(k, c), dots[j]);
            }
          }
          __m512 sums = sum_each(dots);
          if constexpr (BF16_DOTS) sums = _mm512_mul_ps(sums, _mm512_set1_ps(scale));
          const __m512 scores = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), sums);
          const float new_max = std::max(out.max[g], _mm512_reduce_max_ps(scores));
          const float correction = std::exp(out.max[g] - new_max);  // 0 on the first keys (max = -inf)
          out.max[g] = new_max;
          const __m512 weights = _mm512_maskz_mov_ps(valid, exp_nonpositive16(_mm512_sub_ps(scores, _mm512_set1_ps(new_max))));
          _mm512_store_ps(probs[g], weights);
          out.sum[g] = out.sum[g] * correction + _mm512_reduce_add_ps(weights);
          corrections[g] = correction;
        }
        for (int64_t g = 0; g < group; ++g) {  // the sums rescaled to the new max, then the V rows added
          const __m512 rescale = _mm512_set1_ps(corrections[g]);
          for (int c = 0; c < CHUNKS; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], rescale);
        }
        for (int64_t j = lo - j0; j < hi - j0; ++j) {  // weighted V rows, each converted once for the group
          const scalar_t* v = v_block + (j0 + j) * row_stride;
          if (v_ahead != nullptr) prefetch_row(v_ahead + (j0 + j) * dim, dim);
          __m512 row[CHUNKS];
          for (int c = 0; c < CHUNKS; ++c) row[c] = load_lanes(v, c);
          for (int64_t g = 0; g < group; ++g) {
            const __m512 p = _mm512_set1_ps(probs[g][j]);
            for (int c = 0; c < CHUNKS; ++c) acc[g][c] = _mm512_fmadd_ps(p, row[c], acc[g][c]);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(out.acc + g * dim + 16 * c, acc[g][c]);
    }
  }
  for (int64_t h = 0; h < kv_heads; ++h)  // the weighted sums back in element order
    for (int64_t g = 0; g < group; ++g) {
      float* acc = parts[h].acc + g * dim;
      float natural[dim];
      for (int c = 0; c < CHUNKS; ++c)
        for (int i = 0; i < 16; ++i) natural[lane_element<scalar_t>(c, i)] = acc[16 * c + i];
      std::copy(natural, natural + dim, acc);
    }
}

// The AVX-512 path for this many query heads per KV head: compiled for the common GQA groups (a
// register per weighted-sum vector), the generic one otherwise.
template <typename scalar_t, int CHUNKS, bool BF16_DOTS>
auto avx512_for_group(int64_t group) {
  switch (group) {
    case 1: return attend_partition_avx512<scalar_t, CHUNKS, BF16_DOTS, 1>;
    case 2: return attend_partition_avx512<scalar_t, CHUNKS, BF16_DOTS, 2>;
    case 3: return attend_partition_avx512<scalar_t, CHUNKS, BF16_DOTS, 3>;
    case 4: return attend_partition_avx512<scalar_t, CHUNKS, BF16_DOTS, 4>;
    default: return attend_partition_avx512<scalar_t, CHUNKS, BF16_DOTS, 0>;
  }
}
#endif

template <typename scalar_t>
void decode_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                      const at::Tensor& context_lens, at::Tensor& out, double scale, int64_t partition_blocks,
                      int64_t window) {
  const int64_t seqs = query.size(0), heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = kv_cache.size(2), kv_heads = kv_cache.size(3);
  const int64_t group = heads / kv_heads, max_blocks = block_tables.size(1);
  const int64_t partitions = (max_blocks + partition_blocks - 1) / partition_blocks;
  const int64_t num_blocks = kv_cache.size(1);

  const scalar_t* k_cache = kv_cache.data_ptr<scalar_t>();
  const scalar_t* v_cache = k_cache + num_blocks * block_size * kv_heads * head_dim;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();

  // Per unit: max[group], sum[group], acc[group * head_dim].
  const int64_t unit_floats = group * (2 + head_dim);
  std::vector<float> partials(seqs * kv_heads * partitions * unit_floats);
  auto partial = [&](int64_t s, int64_t h, int64_t p) {
    float* base = partials.data() + ((s * kv_heads + h) * partitions + p) * unit_floats;
    return Partial{base, base + group, base + 2 * group};
  };

  // The scores on bf16 dot products where the KV is bf16 and the CPU has them (attend_partition_avx512).
#if defined(__AVX512BF16__)
  constexpr bool kBf16Dots = std::is_same_v<scalar_t, c10::BFloat16>;
#else
  constexpr bool kBf16Dots = false;
#endif
#if defined(__AVX512F__)
  const auto fast = head_dim == 32    ? avx512_for_group<scalar_t, 2, kBf16Dots>(group)
                    : head_dim == 64  ? avx512_for_group<scalar_t, 4, kBf16Dots>(group)
                    : head_dim == 128 ? avx512_for_group<scalar_t, 8, kBf16Dots>(group)
                    : head_dim == 256 ? avx512_for_group<scalar_t, 16, kBf16Dots>(group)
                                      : nullptr;
#else
  constexpr void (*fast)(const float*, const c10::BFloat16*, const c10::BFloat16*, float, const scalar_t*,
                         const scalar_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                         int64_t, Partial*) = nullptr;
#endif
  // The query as each path reads it: unscaled bf16 (hi, and lo for a float32 query) for the bf16
  // dots, which scale after the dot; scaled float32 for the others.
  const bool bf16_dots = kBf16Dots && fast != nullptr;
  at::Tensor q, q_hi, q_lo;
  if (bf16_dots) {
    q_hi = query.to(at::kBFloat16).contiguous();
    if (query.scalar_type() != at::kBFloat16) q_lo = query.to(at::kFloat).sub(q_hi.to(at::kFloat)).to(at::kBFloat16).contiguous();
  } else {
    q = query.to(at::kFloat).mul(scale).contiguous();
  }
  const float* q_data = q.defined() ? q.data_ptr<float>() : nullptr;
  const c10::BFloat16* q_hi_data = q_hi.defined() ? q_hi.data_ptr<c10::BFloat16>() : nullptr;
  const c10::BFloat16* q_lo_data = q_lo.defined() ? q_lo.data_ptr<c10::BFloat16>() : nullptr;
  // Work units: (sequence, KV head, partition), or with the AVX-512 path (sequence, partition).
  const int64_t unit_heads = fast != nullptr ? 1 : kv_heads;
  at::parallel_for(0, seqs * unit_heads * partitions, 1, [&](int64_t begin, int64_t end) {
    Partial parts[kMaxKvHeads];
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t p = unit % partitions, s = unit / (partitions * unit_heads);
      // A sliding-window layer attends to the last `window` positions only: the blocks before hold
      // nothing it reads (they may be freed already).
      const int64_t start = window > 0 ? std::max<int64_t>(0, lens[s] - window) : 0;
      const int64_t first = std::max(p * partition_blocks, start / block_size);
      const int64_t last = std::min((p + 1) * partition_blocks, (lens[s] + block_size - 1) / block_size);
      const int64_t* table = tables + s * max_blocks;
      const int64_t h0 = fast != nullptr ? 0 : (unit / partitions) % kv_heads, h1 = fast != nullptr ? kv_heads : h0 + 1;
      if (first >= last) {  // nothing of this sequence in the partition (too short, or before the window)
        for (int64_t h = h0; h < h1; ++h) {
          Partial part = partial(s, h, p);
          for (int64_t g = 0; g < group; ++g) part.max[g] = -std::numeric_limits<float>::infinity(), part.sum[g] = 0.f;
          std::fill(part.acc, part.acc + group * head_dim, 0.f);
        }
        continue;
      }
      if (fast != nullptr) {
        for (int64_t h = 0; h < kv_heads; ++h) parts[h] = partial(s, h, p);
        const int64_t q_offset = s * heads * head_dim;
        fast(q_data ? q_data + q_offset : nullptr, q_hi_data ? q_hi_data + q_offset : nullptr, q_lo_data ? q_lo_data + q_offset : nullptr,
             static_cast<float>(scale), k_cache, v_cache, table, first, last, start, lens[s], block_size, kv_heads,
             group, parts);
        continue;
      }
      const int64_t h = h0;
      Partial part = partial(s, h, p);
      const float* q_group = q_data + (s * heads + h * group) * head_dim;
      if (head_dim == 64) {
        attend_partition<scalar_t, 64>(q_group, k_cache, v_cache, table, first, last, start, lens[s], block_size, kv_heads,
                                       h, head_dim, group, part);
      } else if (head_dim == 128) {
        attend_partition<scalar_t, 128>(q_group, k_cache, v_cache, table, first, last, start, lens[s], block_size, kv_heads,
                                        h, head_dim, group, part);
      } else {
        attend_partition<scalar_t, 0>(q_group, k_cache, v_cache, table, first, last, start, lens[s], block_size, kv_heads,
                                      h, head_dim, group, part);
      }
    }
  });

  // Merge the partitions of each (sequence, query head).
  at::Tensor merged = at::empty({seqs, heads, head_dim}, query.options().dtype(at::kFloat));
  float* m_data = merged.data_ptr<float>();
  at::parallel_for(0, seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t s = unit / kv_heads, h = unit % kv_heads;
      for (int64_t g = 0; g < group; ++g) {
        float best = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < partitions; ++p) best = std::max(best, partial(s, h, p).max[g]);
        float total = 0.f;
        float* dst = m_data + (s * heads + h * group + g) * head_dim;
        std::fill(dst, dst + head_dim, 0.f);
        for (int64_t p = 0; p < partitions; ++p) {
          Partial part = partial(s, h, p);
          if (part.sum[g] == 0.f) continue;
          const float w = std::exp(part.max[g] - best);
          total += part.sum[g] * w;
          const float* acc = part.acc + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] += w * acc[d];
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] *= inv;
      }
    }
  });
  out.copy_(merged);
}

}  // namespace

// query [seqs, heads, head_dim]; kv_cache [2, num_blocks, block_size, kv_heads, head_dim];
// block_tables [seqs, max_blocks] int64 (padding ignored past each context); context_lens [seqs] int64.
// Writes softmax(q K^T * scale) V of each sequence's first context_lens tokens (with window > 0, the last
// `window` of them: a sliding-window layer) into out [seqs, heads, head_dim].
void paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, at::Tensor& out, double scale, int64_t partition_blocks,
                            int64_t window) {
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2, "bad query / kv_cache shapes");
  TORCH_CHECK(kv_cache.is_contiguous() && block_tables.is_contiguous() && context_lens.is_contiguous(),
              "kv_cache, block_tables and context_lens must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(query.size(2) == kv_cache.size(4) && query.size(2) <= kMaxHeadDim, "head_dim mismatch or > 256");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0 && query.size(1) / kv_cache.size(3) <= kMaxGroup,
              "query heads must be a multiple of KV heads, at most 16 per KV head");
  TORCH_CHECK(kv_cache.size(2) <= kMaxBlockSize, "block_size must be <= 128");
  TORCH_CHECK(kv_cache.size(3) <= kMaxKvHeads, "at most 64 KV heads");
  TORCH_CHECK(partition_blocks > 0, "partition_blocks must be > 0");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: every position)");
  TORCH_CHECK(out.sizes() == query.sizes(), "out must have the query's shape");
  switch (kv_cache.scalar_type()) {
    case at::kFloat: decode_attention<float>(query, kv_cache, block_tables, context_lens, out, scale, partition_blocks, window); break;
    case at::kBFloat16: decode_attention<c10::BFloat16>(query, kv_cache, block_tables, context_lens, out, scale, partition_blocks, window); break;
    case at::kHalf: decode_attention<c10::Half>(query, kv_cache, block_tables, context_lens, out, scale, partition_blocks, window); break;
    default: TORCH_CHECK(false, "kv_cache dtype must be float32, bfloat16 or float16");
  }
}
