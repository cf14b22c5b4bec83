// Decode attention over the paged KV cache, read in place (no gather), fp32, CPU.
//
// q: [n, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (contiguous);
// block_tables: [n, W] int64; visible: [n] int64, the number of keys query b sees (its
// first visible[b] positions) -> out [n, Hq, D], lse [n, Hq] (natural log; -inf and a zero
// row where visible[b] == 0).
//
// Query head h is served by KV head h / (Hq / Hkv) (Hugging Face's repeat_kv convention).
// Per sequence: one pass over its keys for the scores of all heads ([Hq, ctx] scratch), a
// softmax per head, one pass over its values. Both passes go block by block: a block's rows
// are contiguous ([block_size, Hkv, D]), so each K and V row is read once, where it lies in
// the cache, while the next block is prefetched (the hardware prefetcher stops at block
// edges). In the value pass each head's output row stays in registers for a whole block.
// head_dim 64 and 128 are compiled as constants (AVX-512 where the CPU has it); any other
// head_dim takes a scalar loop. Sequences are split across torch's intra-op threads.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_math.h"

namespace {

// q . k over D floats (kD: D known at compile time, a multiple of 32; 0: any D).
template <int64_t kD>
inline float dot(const float* q, const float* k, int64_t head_dim) {
#ifdef __AVX512F__
  if constexpr (kD > 0) {  // two accumulators, one tree reduction per dot
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    for (int64_t d = 0; d < kD; d += 32) {
      a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), a);
      b = _mm512_fmadd_ps(_mm512_loadu_ps(q + d + 16), _mm512_loadu_ps(k + d + 16), b);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  }
#endif
  const int64_t dim = kD > 0 ? kD : head_dim;
  float sum = 0.0f;
  for (int64_t d = 0; d < dim; ++d) sum += q[d] * k[d];
  return sum;
}

// acc[0:D] += sum_i p[i] * rows[i * stride : i * stride + D] for i < m: one block of one head.
template <int64_t kD>
inline void accumulate(float* acc, const float* p, const float* rows, int64_t m,
                       int64_t stride, int64_t head_dim) {
#ifdef __AVX512F__
  if constexpr (kD > 0) {  // the output row lives in registers for the whole block
    constexpr int64_t kVecs = kD / 16;
    __m512 a[kVecs];
    for (int64_t c = 0; c < kVecs; ++c) a[c] = _mm512_loadu_ps(acc + 16 * c);
    for (int64_t i = 0; i < m; ++i) {
      const __m512 w = _mm512_set1_ps(p[i]);
      const float* row = rows + i * stride;
      for (int64_t c = 0; c < kVecs; ++c) a[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(row + 16 * c), a[c]);
    }
    for (int64_t c = 0; c < kVecs; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
    return;
  }
#endif
  const int64_t dim = kD > 0 ? kD : head_dim;
  for (int64_t i = 0; i < m; ++i) {
    const float w = p[i];
    const float* row = rows + i * stride;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) acc[d] += w * row[d];
  }
}

void check_inputs(const torch::Tensor& q, const torch::Tensor& k_cache,
                  const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                  const torch::Tensor& visible) {
  check_attention_inputs("paged_decode_attention", q, k_cache, v_cache, block_tables);
  TORCH_CHECK(block_tables.size(0) == q.size(0), "block_tables must have one row per query");
  TORCH_CHECK(visible.scalar_type() == torch::kInt64 && visible.dim() == 1 &&
                  visible.is_contiguous() && visible.size(0) == q.size(0),
              "visible must be contiguous int64 [n]");
}

}  // namespace

// One sequence: q [Hq, D] against its first ctx cached tokens -> out [Hq, D], lse [Hq].
template <int64_t kD>
void attend_one(const float* q, const float* k_cache, const float* v_cache,
                const int64_t* table, int64_t ctx, int64_t num_heads, int64_t num_kv_heads,
                int64_t head_dim, int64_t block_size, float scale, std::vector<float>& scores,
                std::vector<float>& acc, std::vector<float>& inv, float* out, float* lse) {
  if (ctx == 0) {
    std::fill(out, out + num_heads * head_dim, 0.0f);
    std::fill(lse, lse + num_heads, -std::numeric_limits<float>::infinity());
    return;
  }
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_stride = num_kv_heads * head_dim;  // floats per cached token
  const int64_t block_floats = block_size * row_stride;
  const int64_t num_blocks = (ctx + block_size - 1) / block_size;
  scores.resize(num_heads * ctx);
  float* s = scores.data();
  // The blocks are read as one stream: K blocks 0..nb-1, then V blocks 0..nb-1. While item i
  // is worked on, item i + kAhead is fetched, a part per head.
  const auto item = [&](int64_t i) {
    const int64_t j = i % num_blocks;
    return (i < num_blocks ? k_cache : v_cache) + table[j] * block_floats;
  };
  const auto item_floats = [&](int64_t i) {
    return i < 2 * num_blocks ? std::min(block_size, ctx - (i % num_blocks) * block_size) * row_stride
                              : int64_t{0};
  };
  for (int64_t i = 0; i < std::min(kAhead, 2 * num_blocks); ++i) prefetch(item(i), item_floats(i));
  // Scores: s[h, t] = scale * q[h] . k[t, h / group]
  for (int64_t j = 0; j < num_blocks; ++j) {
    const int64_t t0 = j * block_size, m = std::min(block_size, ctx - t0);
    const float* rows = k_cache + table[j] * block_floats;
    const int64_t ahead = j + kAhead, ahead_floats = item_floats(ahead);
    for (int64_t h = 0; h < num_heads; ++h) {
      if (ahead_floats > 0) prefetch(item(ahead), ahead_floats, h, num_heads);
      const float* qh = q + h * head_dim;
      const float* kh = rows + (h / group) * head_dim;
      float* sh = s + h * ctx + t0;
      for (int64_t i = 0; i < m; ++i) sh[i] = dot<kD>(qh, kh + i * row_stride, head_dim) * scale;
    }
  }
  // Softmax per head, unnormalised: s <- exp(s - max); the sum is kept for the end.
  for (int64_t h = 0; h < num_heads; ++h) {
    float* sh = s + h * ctx;
    const float top = max_of(sh, ctx);
    const float sum = exp_shifted(sh, ctx, top);
    lse[h] = top + std::log(sum);
    inv[h] = 1.0f / sum;
  }
  // Values: acc[h] = sum_t p[h, t] * v[t, h / group]
  std::fill(acc.begin(), acc.end(), 0.0f);
  for (int64_t j = 0; j < num_blocks; ++j) {
    const int64_t t0 = j * block_size, m = std::min(block_size, ctx - t0);
    const float* rows = v_cache + table[j] * block_floats;
    const int64_t ahead = num_blocks + j + kAhead, ahead_floats = item_floats(ahead);
    for (int64_t h = 0; h < num_heads; ++h) {
      if (ahead_floats > 0) prefetch(item(ahead), ahead_floats, h, num_heads);
      accumulate<kD>(acc.data() + h * head_dim, s + h * ctx + t0,
                     rows + (h / group) * head_dim, m, row_stride, head_dim);
    }
  }
  for (int64_t h = 0; h < num_heads; ++h) {
    for (int64_t d = 0; d < head_dim; ++d) out[h * head_dim + d] = acc[h * head_dim + d] * inv[h];
  }
}

std::vector<torch::Tensor> paged_decode_attention(const torch::Tensor& q,
                                                  const torch::Tensor& k_cache,
                                                  const torch::Tensor& v_cache,
                                                  const torch::Tensor& block_tables,
                                                  const torch::Tensor& visible, double scale) {
  check_inputs(q, k_cache, v_cache, block_tables, visible);
  const int64_t n = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  const int64_t num_kv_heads = k_cache.size(2), width = block_tables.size(1);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_stride = num_kv_heads * head_dim;  // floats per cached token
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = visible.data_ptr<int64_t>();
  for (int64_t b = 0; b < n; ++b) {
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= width * block_size,
                "visible[", b, "] = ", lens[b], " exceeds its block table");
    check_block_ids(tables + b * width, (lens[b] + block_size - 1) / block_size, num_blocks);
  }
  auto out = torch::empty_like(q);
  auto lse = torch::empty({n, num_heads}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  auto run = [&](auto head_dim_constant) {
    constexpr int64_t kD = decltype(head_dim_constant)::value;
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;  // [Hq, ctx]
      std::vector<float> acc(num_heads * head_dim), inv(num_heads);
      for (int64_t b = begin; b < end; ++b) {
        attend_one<kD>(qp + b * num_heads * head_dim, kp, vp, tables + b * width, lens[b],
                       num_heads, num_kv_heads, head_dim, block_size, fscale, scores, acc, inv,
                       op + b * num_heads * head_dim, lp + b * num_heads);
      }
    });
  };
  with_head_dim(head_dim, run);
  return {out, lse};
}
