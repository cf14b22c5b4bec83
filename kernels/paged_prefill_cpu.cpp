// Prefill (and chunked-prefill) attention over the paged KV cache, fp32, CPU.
//
// q: [T, Hq, D], the query rows of n sequences one after another (q_lens[b] rows each);
// k_cache, v_cache: [num_blocks, block_size, Hkv, D] (contiguous); block_tables: [n, W]
// int64; q_lens, offsets, ctx: [n] int64. Query i of sequence b is at position
// offsets[b] + i and sees keys j < min(offsets[b] + i + 1, ctx[b]) (causal, and never past
// what is cached) -> out [T, Hq, D], lse [T, Hq] (natural log; -inf and a zero row where a
// query sees no key).
//
// Query head h is served by KV head h / (Hq / Hkv). Work item: one (sequence, KV head). Its
// visible keys are copied once out of their blocks, K transposed ([D, keys], so 16 keys fill
// one vector) and V as rows ([keys, D]); every query row of the item's heads then reads them
// from there. Rows are taken 8 at a time (query i, group member g -> row i * G + g): scores
// of 8 rows against 16 keys per pass over D (8 accumulators, one K vector per step), an
// exact softmax per row over its own visible keys (the keys a row must not see are never
// exponentiated; they are 0 for the value pass), then the values: an output tile of a few
// rows x D stays in registers across all keys. Keys above a row tile's diagonal are skipped.
// head_dim 64 and 128 are compiled as constants (AVX-512 where the CPU has it); any other
// head_dim takes scalar loops.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_math.h"

namespace {

constexpr int64_t kRows = 8;   // query rows per score tile
constexpr int64_t kKeys = 16;  // keys per score vector

struct Scratch {
  std::vector<float> kt;      // [D, keys_padded]
  std::vector<float> v;       // [keys, D]
  std::vector<float> scores;  // [kRows, keys_padded]
  std::vector<float> rows;    // [2, kRows, D]: a tile's queries and outputs
};

// Copies the item's first ``keys`` K and V rows out of their blocks.
void gather(const float* k_cache, const float* v_cache, const int64_t* table, int64_t keys,
            int64_t padded, int64_t kv_head, int64_t head_dim, int64_t block_size,
            int64_t row_stride, Scratch& w) {
  w.kt.resize(head_dim * padded);
  w.v.resize(std::max<int64_t>(keys, 1) * head_dim);
  const int64_t block_floats = block_size * row_stride;
  for (int64_t t0 = 0, j = 0; t0 < keys; t0 += block_size, ++j) {
    const int64_t m = std::min(block_size, keys - t0);
    const float* kb = k_cache + table[j] * block_floats + kv_head * head_dim;
    const float* vb = v_cache + table[j] * block_floats + kv_head * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) {  // the block's rows are in L1: read across them
      float* kt_row = w.kt.data() + d * padded + t0;
      for (int64_t i = 0; i < m; ++i) kt_row[i] = kb[i * row_stride + d];
    }
    for (int64_t i = 0; i < m; ++i) {
      std::copy(vb + i * row_stride, vb + i * row_stride + head_dim, w.v.data() + (t0 + i) * head_dim);
    }
  }
  for (int64_t d = 0; d < head_dim; ++d) {  // keys past the last are scored as 0, then dropped
    std::fill(w.kt.data() + d * padded + keys, w.kt.data() + (d + 1) * padded, 0.0f);
  }
}

// scores[r, t] = scale * q[r] . k_t for r < kRows, t < tiles * kKeys; q: [kRows, D].
template <int64_t kD>
inline void score_tile(const float* q, const float* kt, int64_t padded, int64_t tiles,
                       int64_t head_dim, float scale, float* scores) {
#ifdef __AVX512F__
  if constexpr (kD > 0) {
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t c = 0; c < tiles; ++c) {
      __m512 acc[kRows];
      for (int64_t r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
      const float* col = kt + c * kKeys;
      for (int64_t d = 0; d < kD; ++d) {
        const __m512 k = _mm512_loadu_ps(col + d * padded);
        for (int64_t r = 0; r < kRows; ++r) {
          acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * kD + d]), k, acc[r]);
        }
      }
      for (int64_t r = 0; r < kRows; ++r) {
        _mm512_storeu_ps(scores + r * padded + c * kKeys, _mm512_mul_ps(acc[r], s));
      }
    }
    return;
  }
#endif
  const int64_t dim = kD > 0 ? kD : head_dim;
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t t = 0; t < tiles * kKeys; ++t) {
      float sum = 0.0f;
      for (int64_t d = 0; d < dim; ++d) sum += q[r * dim + d] * kt[d * padded + t];
      scores[r * padded + t] = sum * scale;
    }
  }
}

// out[r, 0:D] = sum_{t < keys} p[r, t] * v[t] for r < kRows (p is 0 past a row's keys).
template <int64_t kD>
inline void value_tile(const float* p, int64_t padded, int64_t keys, const float* v,
                       float* out, int64_t head_dim) {
#ifdef __AVX512F__
  if constexpr (kD > 0) {
    constexpr int64_t kVecs = kD / 16;
    constexpr int64_t kSub = 16 / kVecs;  // rows whose output tiles fit in 16 registers
    for (int64_t r0 = 0; r0 < kRows; r0 += kSub) {
      __m512 acc[kSub][kVecs];
      for (int64_t r = 0; r < kSub; ++r)
        for (int64_t c = 0; c < kVecs; ++c) acc[r][c] = _mm512_setzero_ps();
      const float* pr = p + r0 * padded;
      for (int64_t t = 0; t < keys; ++t) {
        __m512 vv[kVecs];
        for (int64_t c = 0; c < kVecs; ++c) vv[c] = _mm512_loadu_ps(v + t * kD + 16 * c);
        for (int64_t r = 0; r < kSub; ++r) {
          const __m512 w = _mm512_set1_ps(pr[r * padded + t]);
          for (int64_t c = 0; c < kVecs; ++c) acc[r][c] = _mm512_fmadd_ps(w, vv[c], acc[r][c]);
        }
      }
      for (int64_t r = 0; r < kSub; ++r)
        for (int64_t c = 0; c < kVecs; ++c) _mm512_storeu_ps(out + (r0 + r) * kD + 16 * c, acc[r][c]);
    }
    return;
  }
#endif
  const int64_t dim = kD > 0 ? kD : head_dim;
  std::fill(out, out + kRows * dim, 0.0f);
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t t = 0; t < keys; ++t) {
      const float w = p[r * padded + t];
      for (int64_t d = 0; d < dim; ++d) out[r * dim + d] += w * v[t * dim + d];
    }
  }
}

// One (sequence, KV head): its q_len * G query rows.
template <int64_t kD>
void attend_item(const float* q, const float* k_cache, const float* v_cache,
                 const int64_t* table, int64_t q_len, int64_t offset, int64_t ctx,
                 int64_t kv_head, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                 int64_t block_size, float scale, Scratch& w, float* out, float* lse) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t keys = std::max<int64_t>(std::min(offset + q_len, ctx), 0);
  const int64_t padded = std::max<int64_t>((keys + kKeys - 1) / kKeys, 1) * kKeys;
  if (keys > 0) {
    gather(k_cache, v_cache, table, keys, padded, kv_head, head_dim, block_size,
           num_kv_heads * head_dim, w);
  }
  w.scores.resize(kRows * padded);
  w.rows.resize(2 * kRows * head_dim);
  float* q_tile = w.rows.data();  // [kRows, D]: the tile's query rows, zero past its last
  float* o_tile = q_tile + kRows * head_dim;  // [kRows, D]: their unnormalised outputs
  const int64_t rows = q_len * group;
  float inv[kRows];
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t n = std::min(kRows, rows - r0);
    int64_t most = 0;  // the most keys a row of this tile sees
    for (int64_t r = 0; r < kRows; ++r) {
      float* dst = q_tile + r * head_dim;
      if (r >= n) {
        std::fill(dst, dst + head_dim, 0.0f);
        continue;
      }
      const int64_t i = (r0 + r) / group, h = kv_head * group + (r0 + r) % group;
      const float* src = q + (i * num_heads + h) * head_dim;
      std::copy(src, src + head_dim, dst);
      most = std::max(most, std::min(offset + i + 1, ctx));
    }
    const int64_t tiles = (most + kKeys - 1) / kKeys;
    if (tiles > 0) score_tile<kD>(q_tile, w.kt.data(), padded, tiles, head_dim, scale, w.scores.data());
    for (int64_t r = 0; r < kRows; ++r) {
      float* s = w.scores.data() + r * padded;
      if (r >= n) {
        std::fill(s, s + tiles * kKeys, 0.0f);
        continue;
      }
      const int64_t i = (r0 + r) / group, h = kv_head * group + (r0 + r) % group;
      const int64_t seen = std::max<int64_t>(std::min(offset + i + 1, ctx), 0);
      if (seen == 0) {
        lse[i * num_heads + h] = -std::numeric_limits<float>::infinity();
        inv[r] = 0.0f;
      } else {
        const float top = max_of(s, seen);
        const float sum = exp_shifted(s, seen, top);
        lse[i * num_heads + h] = top + std::log(sum);
        inv[r] = 1.0f / sum;
      }
      std::fill(s + seen, s + tiles * kKeys, 0.0f);
    }
    value_tile<kD>(w.scores.data(), padded, most, w.v.data(), o_tile, head_dim);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t i = (r0 + r) / group, h = kv_head * group + (r0 + r) % group;
      float* dst = out + (i * num_heads + h) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = o_tile[r * head_dim + d] * inv[r];
    }
  }
}

void check_inputs(const torch::Tensor& q, const torch::Tensor& k_cache,
                  const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                  const torch::Tensor& q_lens, const torch::Tensor& offsets,
                  const torch::Tensor& ctx) {
  check_attention_inputs("paged_prefill_attention", q, k_cache, v_cache, block_tables);
  const int64_t n = block_tables.size(0);
  for (const torch::Tensor* t : {&q_lens, &offsets, &ctx}) {
    TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->dim() == 1 && t->is_contiguous() &&
                    t->size(0) == n,
                "q_lens, offsets and ctx must be contiguous int64 [n]");
  }
}

}  // namespace

std::vector<torch::Tensor> paged_prefill_attention(
    const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
    const torch::Tensor& block_tables, const torch::Tensor& q_lens,
    const torch::Tensor& offsets, const torch::Tensor& ctx, double scale) {
  check_inputs(q, k_cache, v_cache, block_tables, q_lens, offsets, ctx);
  const int64_t n = block_tables.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  const int64_t num_kv_heads = k_cache.size(2), width = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = q_lens.data_ptr<int64_t>();
  const int64_t* offs = offsets.data_ptr<int64_t>();
  const int64_t* ctxs = ctx.data_ptr<int64_t>();
  std::vector<int64_t> first_row(n + 1, 0);
  for (int64_t b = 0; b < n; ++b) {
    TORCH_CHECK(lens[b] >= 0, "q_lens[", b, "] is negative");
    const int64_t keys = std::max<int64_t>(std::min(offs[b] + lens[b], ctxs[b]), 0);
    TORCH_CHECK(keys <= width * block_size, "sequence ", b, " sees ", keys,
                " keys, more than its block table holds");
    check_block_ids(tables + b * width, (keys + block_size - 1) / block_size, num_blocks);
    first_row[b + 1] = first_row[b] + lens[b];
  }
  TORCH_CHECK(first_row[n] == q.size(0), "q has ", q.size(0), " rows but q_lens sum to ",
              first_row[n]);
  auto out = torch::empty_like(q);
  auto lse = torch::empty({q.size(0), num_heads}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  auto run = [&](auto head_dim_constant) {
    constexpr int64_t kD = decltype(head_dim_constant)::value;
    at::parallel_for(0, n * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
      Scratch w;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / num_kv_heads, kv_head = item % num_kv_heads;
        const int64_t row = first_row[b];
        attend_item<kD>(qp + row * num_heads * head_dim, kp, vp, tables + b * width, lens[b],
                        offs[b], ctxs[b], kv_head, num_heads, num_kv_heads, head_dim,
                        block_size, fscale, w, op + row * num_heads * head_dim,
                        lp + row * num_heads);
      }
    });
  };
  with_head_dim(head_dim, run);
  return {out, lse};
}
