// Shared by the CPU kernels (paged_decode_cpu.cpp, paged_prefill_cpu.cpp, layer_ops_cpu.cpp):
// vector exponentials, the softmax's max, cache prefetch, and the attention input checks.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#ifndef MERIDIAN_PREFETCH_AHEAD
#define MERIDIAN_PREFETCH_AHEAD 1
#endif
inline constexpr int64_t kAhead = MERIDIAN_PREFETCH_AHEAD;  // blocks fetched ahead of their use

// Asks for part ``part`` of ``parts`` of the floats [begin, begin + count) ahead of their use,
// one cache line at a time. A block is fetched in parts between the work on the one before,
// so the requests never queue up behind each other.
inline void prefetch(const float* begin, int64_t count, int64_t part = 0, int64_t parts = 1) {
  const int64_t lines = (count + 15) / 16;
  const int64_t first = lines * part / parts, last = lines * (part + 1) / parts;
  for (int64_t i = first; i < last; ++i) __builtin_prefetch(begin + 16 * i);
}

// max(s[0:count]), count >= 1.
inline float max_of(const float* s, int64_t count) {
  float top = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
#ifdef __AVX512F__
  __m512 tops = _mm512_set1_ps(top);
  for (; t + 16 <= count; t += 16) tops = _mm512_max_ps(tops, _mm512_loadu_ps(s + t));
  top = _mm512_reduce_max_ps(tops);
#endif
  for (; t < count; ++t) top = std::max(top, s[t]);
  return top;
}

#ifdef __AVX512F__
// exp(x) per lane, x >= -103 (exp of anything below is 0 in fp32; callers clamp): 2^n * exp(r),
// n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2] (ln 2 split in two for an exact
// product), exp(r) by its degree-6 Taylor polynomial: within 2 ulp.
inline __m512 exp_vec(__m512 x) {
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 poly = _mm512_set1_ps(1.0f / 720);
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f / 120));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f / 24));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f / 6));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(0.5f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(poly, n);  // poly * 2^n
}
#endif

// s[0:count] <- exp(s[0:count] - top); returns their sum.
inline float exp_shifted(float* s, int64_t count, float top) {
  float sum = 0.0f;
  int64_t t = 0;
#ifdef __AVX512F__
  const __m512 lowest = _mm512_set1_ps(-103.0f);
  const __m512 shift = _mm512_set1_ps(top);
  __m512 total = _mm512_setzero_ps();
  for (; t + 16 <= count; t += 16) {
    const __m512 e = exp_vec(_mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), shift), lowest));
    _mm512_storeu_ps(s + t, e);
    total = _mm512_add_ps(total, e);
  }
  sum = _mm512_reduce_add_ps(total);
#endif
  for (; t < count; ++t) {
    s[t] = std::exp(s[t] - top);
    sum += s[t];
  }
  return sum;
}

// The first ``blocks`` entries of one block-table row are blocks of a cache of ``num_blocks``.
inline void check_block_ids(const int64_t* row, int64_t blocks, int64_t num_blocks) {
  for (int64_t j = 0; j < blocks; ++j) {
    TORCH_CHECK(row[j] >= 0 && row[j] < num_blocks, "block id ", row[j], " out of range");
  }
}

// Calls run(std::integral_constant<int64_t, kD>()): kD = head_dim where that size is compiled
// as a constant (64 and 128, with AVX-512), else kD = 0 (any head_dim, scalar loops).
template <typename Run>
inline void with_head_dim(int64_t head_dim, Run&& run) {
#ifdef __AVX512F__
  if (head_dim == 64) return run(std::integral_constant<int64_t, 64>());
  if (head_dim == 128) return run(std::integral_constant<int64_t, 128>());
#endif
  run(std::integral_constant<int64_t, 0>());
}

// fp32 CPU q [T, Hq, D] and contiguous caches [num_blocks, block_size, Hkv, D] with matching
// head_dim, Hq a multiple of Hkv, and a contiguous int64 block table [n, W].
inline void check_attention_inputs(const char* op, const torch::Tensor& q,
                                   const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                   const torch::Tensor& block_tables) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              op, " runs on CPU tensors only");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
                  v_cache.scalar_type() == torch::kFloat32,
              op, " takes float32 q and caches");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q must be [T, Hq, D] and the caches [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q and the caches must be contiguous");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "q and the caches disagree on head_dim");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.dim() == 2 &&
                  block_tables.is_contiguous(),
              "block_tables must be contiguous int64 [n, W]");
}
