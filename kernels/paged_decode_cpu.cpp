// Decode attention over the paged KV cache, read in place (no gather), fp32, CPU.
//
// q: [n, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (contiguous);
// block_tables: [n, W] int64; visible: [n] int64, the number of keys query b sees (its
// first visible[b] positions) -> out [n, Hq, D], lse [n, Hq] (natural log; -inf and a zero
// row where visible[b] == 0).
//
// Query head h is served by KV head h / (Hq / Hkv) (Hugging Face's repeat_kv convention).
// Per sequence: one pass over its keys for the scores of all heads ([ctx, Hq] scratch), a
// softmax per head, one pass over its values. Each K and V row [Hkv, D] is read once, where
// it lies in the cache. Sequences are split across torch's intra-op threads.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

// q . k over head_dim floats.
inline float dot(const float* q, const float* k, int64_t head_dim) {
#ifdef __AVX512F__
  if (head_dim % 32 == 0) {  // two accumulators, one tree reduction per dot
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 32) {
      a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), a);
      b = _mm512_fmadd_ps(_mm512_loadu_ps(q + d + 16), _mm512_loadu_ps(k + d + 16), b);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  }
#endif
  float sum = 0.0f;
  for (int64_t d = 0; d < head_dim; ++d) sum += q[d] * k[d];
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

// Asks for the cached row of token t (row_floats floats) ahead of its use: the rows of one
// sequence are scattered over blocks, so the hardware prefetcher stalls at every block edge.
inline void prefetch_row(const float* cache, const int64_t* table, int64_t t,
                         int64_t block_size, int64_t row_floats) {
  const float* row = cache + (table[t / block_size] * block_size + t % block_size) * row_floats;
  for (int64_t i = 0; i < row_floats; i += 16) __builtin_prefetch(row + i);
}

constexpr int64_t kPrefetchAhead = 16;  // tokens

}  // namespace

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

  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // [ctx, Hq]
    std::vector<float> acc(num_heads * head_dim);
    std::vector<float> denom(num_heads);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t ctx = lens[b];
      const float* qb = qp + b * num_heads * head_dim;
      float* ob = op + b * num_heads * head_dim;
      if (ctx == 0) {
        std::fill(ob, ob + num_heads * head_dim, 0.0f);
        std::fill(lp + b * num_heads, lp + (b + 1) * num_heads,
                  -std::numeric_limits<float>::infinity());
        continue;
      }
      scores.resize(num_heads * ctx);
      const int64_t* table = tables + b * width;
      // Scores: scores[t, h] = scale * q[h] . k[t, h / group]
      for (int64_t t = 0; t < ctx; ++t) {
        const float* krow = kp + (table[t / block_size] * block_size + t % block_size) * row_stride;
        if (t + kPrefetchAhead < ctx) prefetch_row(kp, table, t + kPrefetchAhead, block_size, row_stride);
        float* st = scores.data() + t * num_heads;
        for (int64_t h = 0; h < num_heads; ++h) {
          st[h] = dot(qb + h * head_dim, krow + (h / group) * head_dim, head_dim) * fscale;
        }
      }
      for (int64_t t = 0; t < std::min(kPrefetchAhead, ctx); ++t) {
        prefetch_row(vp, table, t, block_size, row_stride);  // the value pass's first rows
      }
      // Softmax per head, unnormalised: scores <- exp(scores - max); denom = sum.
      for (int64_t h = 0; h < num_heads; ++h) {
        float* s = scores.data() + h;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < ctx; ++t) top = std::max(top, s[t * num_heads]);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < ctx; ++t) {
          const float e = std::exp(s[t * num_heads] - top);
          s[t * num_heads] = e;
          sum += e;
        }
        denom[h] = sum;
        lp[b * num_heads + h] = top + std::log(sum);
      }
      // Values: acc[h] = sum_t p[h, t] * v[t, h / group]
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t = 0; t < ctx; ++t) {
        const float* vrow = vp + (table[t / block_size] * block_size + t % block_size) * row_stride;
        if (t + kPrefetchAhead < ctx) prefetch_row(vp, table, t + kPrefetchAhead, block_size, row_stride);
        for (int64_t h = 0; h < num_heads; ++h) {
          const float* vh = vrow + (h / group) * head_dim;
          const float p = scores[t * num_heads + h];
          float* ah = acc.data() + h * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * vh[d];
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        const float inv = 1.0f / denom[h];
        for (int64_t d = 0; d < head_dim; ++d) ob[h * head_dim + d] = acc[h * head_dim + d] * inv;
      }
    }
  });
  return {out, lse};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL, as torch's own operators run: a replica's event loop and Ray's threads
  // keep working while a step attends (about a millisecond a layer).
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over the paged KV cache, read in place (fp32, CPU)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
