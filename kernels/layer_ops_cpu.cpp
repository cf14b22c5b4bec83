// A decoder layer's elementwise work in one pass each, fp32, CPU: RMSNorm, rotary embedding
// (in place, on the fused qkv projection's output) and SwiGLU's silu(gate) * up.
//
// Each replaces a chain of torch operators (RMSNorm 7, RoPE about 14, SwiGLU 2 and a split),
// so a decode step of 32 rows pays one dispatch where it paid several, and a 2,048-token
// prefill reads each activation once. The arithmetic is Hugging Face's, in its order: RMSNorm
// is w * (x * rsqrt(mean(x^2) + eps)) with the mean summed in another order (so within an
// ulp, not bit for bit); RoPE rounds each product before the sum, as torch's separate
// operators do (no fused multiply-add there); silu(g) = g / (1 + exp(-g)) with the vector
// exponential of cpu_math.h (within 2 ulp) where the CPU has AVX-512.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>

#include "cpu_math.h"

namespace {

void check_fp32_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 &&
                  x.is_contiguous(),
              name, " must be a contiguous float32 CPU tensor [rows, width]");
}

}  // namespace

// x [T, H], weight [H] -> [T, H]
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_fp32_rows(x, "x");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.dim() == 1 &&
                  weight.is_contiguous() && weight.size(0) == x.size(1),
              "weight must be contiguous float32 [H] with H = x.size(1)");
  const int64_t rows = x.size(0), width = x.size(1);
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = xp + t * width;
      float* orow = op + t * width;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < width; ++i) sum += xr[i] * xr[i];
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(width) + feps);
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float normed = xr[i] * inv;
        orow[i] = wp[i] * normed;
      }
    }
  });
  return out;
}

// In place on qkv [T, (Hq + 2 Hkv) * D]: the first Hq + Hkv heads of each row (q, then k) are
// rotated by position: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin (halves of each head).
// cos, sin: [P, D]; positions [T] int64 < P.
__attribute__((optimize("fp-contract=off"))) void rope_qkv_(
    torch::Tensor& qkv, const torch::Tensor& positions, const torch::Tensor& cos,
    const torch::Tensor& sin, int64_t rotated_heads, int64_t head_dim) {
  check_fp32_rows(qkv, "qkv");
  check_fp32_rows(cos, "cos");
  check_fp32_rows(sin, "sin");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(1) == head_dim && head_dim % 2 == 0,
              "cos and sin must be [P, head_dim] with an even head_dim");
  TORCH_CHECK(rotated_heads * head_dim <= qkv.size(1), "qkv rows are shorter than the heads");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.dim() == 1 &&
                  positions.is_contiguous() && positions.size(0) == qkv.size(0),
              "positions must be contiguous int64 [T]");
  const int64_t rows = qkv.size(0), width = qkv.size(1), limit = cos.size(0);
  const int64_t half = head_dim / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < limit, "position ", pos[t], " outside the table of ",
                limit);
  }
  float* base = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pos[t] * head_dim;
      const float* s = sp + pos[t] * head_dim;
      for (int64_t h = 0; h < rotated_heads; ++h) {
        float* x = base + t * width + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[i + half];
          const float a1 = x1 * c[i], b1 = x2 * s[i];
          const float a2 = x2 * c[i + half], b2 = x1 * s[i + half];
          x[i] = a1 - b1;
          x[i + half] = a2 + b2;
        }
      }
    }
  });
}

// gate_up [T, 2I] (gate columns, then up) -> [T, I]: silu(gate) * up
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  check_fp32_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({rows, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = gp + t * 2 * inter;
      const float* u = g + inter;
      float* o = op + t * inter;
      int64_t i = 0;
#ifdef __AVX512F__
      const __m512 one = _mm512_set1_ps(1.0f), lowest = _mm512_set1_ps(-103.0f);
      for (; i + 16 <= inter; i += 16) {
        const __m512 x = _mm512_loadu_ps(g + i);
        const __m512 e = exp_vec(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), x), lowest));
        const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(one, e));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(silu, _mm512_loadu_ps(u + i)));
      }
#endif
      for (; i < inter; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over rows (fp32, CPU)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rope_qkv_", &rope_qkv_, "Rotary embedding of the q and k heads of qkv, in place",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up (fp32, CPU)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
