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

#ifdef __AVX512F__
#include <immintrin.h>
#endif

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

#ifndef MERIDIAN_PREFETCH_AHEAD
#define MERIDIAN_PREFETCH_AHEAD 1
#endif
constexpr int64_t kAhead = MERIDIAN_PREFETCH_AHEAD;  // blocks fetched ahead of their use

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

// s[0:count] <- exp(s[0:count] - top); returns their sum.
inline float exp_shifted(float* s, int64_t count, float top) {
  float sum = 0.0f;
  int64_t t = 0;
#ifdef __AVX512F__
  // exp(x) = 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2] (ln 2 split
  // in two for an exact product), exp(r) by its degree-6 Taylor polynomial: within 2 ulp.
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  const __m512 lowest = _mm512_set1_ps(-103.0f);  // exp of anything below is 0 in fp32
  const __m512 shift = _mm512_set1_ps(top);
  __m512 total = _mm512_setzero_ps();
  for (; t + 16 <= count; t += 16) {
    const __m512 x = _mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), shift), lowest);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
    r = _mm512_fnmadd_ps(n, ln2_lo, r);
    __m512 poly = _mm512_set1_ps(1.0f / 720);
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f / 120));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f / 24));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f / 6));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(0.5f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f));
    const __m512 e = _mm512_scalef_ps(poly, n);  // poly * 2^n
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

void check_inputs(const torch::Tensor& q, const torch::Tensor& k_cache,
                  const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                  const torch::Tensor& visible) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_decode_attention runs on CPU tensors only");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
                  v_cache.scalar_type() == torch::kFloat32,
              "paged_decode_attention takes float32 q and caches");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q must be [n, Hq, D] and the caches [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q and the caches must be contiguous");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "q and the caches disagree on head_dim");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.dim() == 2 &&
                  block_tables.is_contiguous() && block_tables.size(0) == q.size(0),
              "block_tables must be contiguous int64 [n, W]");
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
    for (int64_t j = 0; j < (lens[b] + block_size - 1) / block_size; ++j) {
      const int64_t id = tables[b * width + j];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block id ", id, " out of range");
    }
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
#ifdef __AVX512F__
  if (head_dim == 64) {
    run(std::integral_constant<int64_t, 64>());
  } else if (head_dim == 128) {
    run(std::integral_constant<int64_t, 128>());
  } else {
    run(std::integral_constant<int64_t, 0>());
  }
#else
  run(std::integral_constant<int64_t, 0>());
#endif
  return {out, lse};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL, as torch's own operators run: a replica's event loop and Ray's threads
  // keep working while a step attends (about a millisecond a layer).
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over the paged KV cache, read in place (fp32, CPU)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
