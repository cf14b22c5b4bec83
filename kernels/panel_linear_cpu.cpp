// Linear layers on the CPU over a compactly held weight: y = x W^T (+ bias), fp32 activations.
//
// Two forms of a weight, each giving back its fp32 values bit for bit. Held in column panels:
// panel p holds output columns 64 p .. 64 p + 63 (zero past N), row k of a panel the 64
// weights that multiply x[:, k].
// - Block-coded: W[n, k] = codes[n, k] * scale[n, k / 32] + offset[n, k / 32] exactly (int8
//   codes, fp32 scale and offset per 32 weights of a row: how GGUF's Q4_1 and Q8_0 blocks
//   dequantize; kernels/block_codes.py finds them). Codes [P, K, 64] int8; scales and
//   offsets [P, K / 32, 64]. A quarter of the fp32 bytes.
// - bf16-valued: every weight's fp32 value is a bf16 (its low 16 bits are zero, as in a bf16
//   checkpoint loaded in fp32). bf16 panels [P, K, 64]. Half the fp32 bytes.
//
// Why: a decode step's linears are a few rows against the whole weight, bound by reading
// it from memory (SmolLM2's fp32 linears: 540 MB a step). A panel is decoded into fp32
// (codes: one FMA per weight; bf16: a shift) one block of 32 k at a time: up to 16 rows in
// registers, 4 rows of x at a time; beyond, into a per-thread buffer that stays in L1,
// multiplied there with up to 6 rows at a time.
//
// Arithmetic: each output sums its K / 32 blocks in order, each block a fused multiply-add
// chain over its 32 k in order from 0 (then + bias): the same bits for any row count, any
// row's position in the batch and any thread count (batch-invariant by construction). It
// differs from another blocked sum (oneDNN's, MKL's) by rounding only.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 64;      // output columns a panel holds: 4 AVX-512 vectors
constexpr int64_t kRows = 6;        // rows of x a micro-kernel carries (6 x 4 accumulators)
constexpr int64_t kBlock = 32;      // weights of a row that share a scale and an offset
constexpr int64_t kRowGroup = 256;  // rows whose partial sums a thread's buffer holds
constexpr int64_t kFusedRows = 16;  // calls of at most this many rows decode in registers
// Blocks of codes (2 KB each) fetched ahead of their decoding, so that the memory stream
// runs under the multiplications of the blocks before (the out-of-order window alone does
// not reach that far: decode and multiply then add up instead of overlapping).
constexpr int64_t kBlocksAhead = 4;
constexpr int64_t kAheadBytes = kBlocksAhead * kBlock * kPanel;

bool compiled_for_avx512() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

#ifdef __AVX512F__
// One row's four accumulators (64 columns), named: GCC keeps an array of 24 vectors on the
// stack.
struct RowAcc {
  __m512 v0 = _mm512_setzero_ps(), v1 = _mm512_setzero_ps();
  __m512 v2 = _mm512_setzero_ps(), v3 = _mm512_setzero_ps();

  inline void fma(float x, __m512 w0, __m512 w1, __m512 w2, __m512 w3) {
    const __m512 xr = _mm512_set1_ps(x);
    v0 = _mm512_fmadd_ps(xr, w0, v0);
    v1 = _mm512_fmadd_ps(xr, w1, v1);
    v2 = _mm512_fmadd_ps(xr, w2, v2);
    v3 = _mm512_fmadd_ps(xr, w3, v3);
  }

  // total[0:64] = this (first block) or total + this
  inline void add_into(float* total, bool first) const {
    const __m512 v[4] = {v0, v1, v2, v3};
    for (int i = 0; i < 4; ++i) {
      float* t = total + 16 * i;
      _mm512_storeu_ps(t, first ? v[i] : _mm512_add_ps(_mm512_loadu_ps(t), v[i]));
    }
  }
};

// R rows' accumulators (R <= 6), named members for the reason above.
template <int R>
struct Rows {
  static_assert(R >= 1 && R <= 6);
  RowAcc a0, a1, a2, a3, a4, a5;

  // rows r < R: += x[r, k] * (w0 w1 w2 w3), x rows of stride ldx
  inline void fma(const float* x, int64_t ldx, int64_t k, __m512 w0, __m512 w1, __m512 w2,
                  __m512 w3) {
    a0.fma(x[k], w0, w1, w2, w3);
    if constexpr (R > 1) a1.fma(x[ldx + k], w0, w1, w2, w3);
    if constexpr (R > 2) a2.fma(x[2 * ldx + k], w0, w1, w2, w3);
    if constexpr (R > 3) a3.fma(x[3 * ldx + k], w0, w1, w2, w3);
    if constexpr (R > 4) a4.fma(x[4 * ldx + k], w0, w1, w2, w3);
    if constexpr (R > 5) a5.fma(x[5 * ldx + k], w0, w1, w2, w3);
  }

  // total rows (stride 64) = these (first block) or total + these
  inline void add_into(float* total, bool first) const {
    a0.add_into(total, first);
    if constexpr (R > 1) a1.add_into(total + kPanel, first);
    if constexpr (R > 2) a2.add_into(total + 2 * kPanel, first);
    if constexpr (R > 3) a3.add_into(total + 3 * kPanel, first);
    if constexpr (R > 4) a4.add_into(total + 4 * kPanel, first);
    if constexpr (R > 5) a5.add_into(total + 5 * kPanel, first);
  }
};

// chunk.run<Max>(r) for r = 0, Max, 2 Max, ... then chunk.run<rows - r>(r) for what is left
template <int Max, typename Chunk>
inline void over_rows(int64_t rows, const Chunk& chunk) {
  int64_t r = 0;
  for (; r + Max <= rows; r += Max) chunk.template run<Max>(r);
  switch (rows - r) {
    case 1: chunk.template run<1>(r); break;
    case 2: if constexpr (Max > 2) chunk.template run<2>(r); break;
    case 3: if constexpr (Max > 3) chunk.template run<3>(r); break;
    case 4: if constexpr (Max > 4) chunk.template run<4>(r); break;
    case 5: if constexpr (Max > 5) chunk.template run<5>(r); break;
    default: break;
  }
}

// total[r, 0:64] (+)= x[r, 0:32] . block [32, 64] for r < R: x rows of stride ldx, total rows
// of stride 64; each row's partial sum runs from 0 over the block's 32 weights in order.
template <int R>
inline void block_kernel(const float* x, int64_t ldx, const float* block, float* total,
                         bool first) {
  Rows<R> acc;
  const float* w = block;
  for (int64_t k = 0; k < kBlock; ++k, w += kPanel) {
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
    const __m512 w2 = _mm512_loadu_ps(w + 32), w3 = _mm512_loadu_ps(w + 48);
    acc.fma(x, ldx, k, w0, w1, w2, w3);
  }
  acc.add_into(total, first);
}

struct BlockChunk {
  const float* x;
  int64_t ldx;
  const float* block;
  float* total;
  bool first;

  template <int R>
  void run(int64_t r) const {
    block_kernel<R>(x + r * ldx, ldx, block, total + r * kPanel, first);
  }
};

void rows_of_block(const float* x, int64_t ldx, int64_t rows, const float* block, float* total,
                   bool first) {
  over_rows<kRows>(rows, BlockChunk{x, ldx, block, total, first});
}

// 16 codes as fp32
inline __m512 code_vector(const int8_t* codes) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}

// The scales and offsets (4 lines each) of the block kAheadBytes of codes ahead: panels and
// their blocks lie one after another, so "ahead" crosses into the next panel (and past the
// end, where a prefetch is dropped).
inline void prefetch_scales_ahead(const float* scale, const float* offset) {
  for (int64_t i = 0; i < 4; ++i) {
    _mm_prefetch(reinterpret_cast<const char*>(scale + kBlocksAhead * kPanel + 16 * i),
                 _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(offset + kBlocksAhead * kPanel + 16 * i),
                 _MM_HINT_T0);
  }
}

// One block (32 k) of a block-coded panel: row(k) gives the 64 weights that multiply x[:, k],
// code * scale + offset, as fp32.
struct CodedBlock {
  const int8_t* codes;  // [32, 64]
  __m512 s0, s1, s2, s3, o0, o1, o2, o3;

  CodedBlock(const int8_t* c, const float* scale, const float* offset) : codes(c) {
    prefetch_scales_ahead(scale, offset);
    s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale + 16);
    s2 = _mm512_loadu_ps(scale + 32), s3 = _mm512_loadu_ps(scale + 48);
    o0 = _mm512_loadu_ps(offset), o1 = _mm512_loadu_ps(offset + 16);
    o2 = _mm512_loadu_ps(offset + 32), o3 = _mm512_loadu_ps(offset + 48);
  }

  inline void row(int64_t k, __m512& w0, __m512& w1, __m512& w2, __m512& w3) const {
    const int8_t* c = codes + k * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(c + kAheadBytes), _MM_HINT_T0);
    w0 = _mm512_fmadd_ps(code_vector(c), s0, o0);
    w1 = _mm512_fmadd_ps(code_vector(c + 16), s1, o1);
    w2 = _mm512_fmadd_ps(code_vector(c + 32), s2, o2);
    w3 = _mm512_fmadd_ps(code_vector(c + 48), s3, o3);
  }
};

// 16 bf16 as fp32 (a bf16 is an fp32's high half)
inline __m512 bf16_vector(const uint16_t* values) {
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

// One block (32 k) of a bf16 panel, as CodedBlock.
struct Bf16Block {
  const uint16_t* values;  // [32, 64]

  inline void row(int64_t k, __m512& w0, __m512& w1, __m512& w2, __m512& w3) const {
    const uint16_t* v = values + k * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(v) + kAheadBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(v) + kAheadBytes + 64, _MM_HINT_T0);
    w0 = bf16_vector(v), w1 = bf16_vector(v + 16);
    w2 = bf16_vector(v + 32), w3 = bf16_vector(v + 48);
  }
};

// One block of a panel, decoded: out [32, 64].
template <typename Block>
inline void decode_block(const Block& block, float* out) {
  for (int64_t k = 0; k < kBlock; ++k) {
    float* o = out + k * kPanel;
    __m512 w0, w1, w2, w3;
    block.row(k, w0, w1, w2, w3);
    _mm512_storeu_ps(o, w0);
    _mm512_storeu_ps(o + 16, w1);
    _mm512_storeu_ps(o + 32, w2);
    _mm512_storeu_ps(o + 48, w3);
  }
}

// A block decoded in registers: total[r, 0:64] (+)= x[r, 0:32] . block for r < R, with the
// same values and sums as block_kernel over decode_block's output. For few rows: the
// decoding runs beside the multiplications instead of before them (1.5-1.7x at 1-4 rows),
// and R <= 4 keeps 16 accumulators, the block's constants and 4 weights in registers.
template <int R, typename Block>
inline void fused_kernel(const float* x, int64_t ldx, const Block& block, float* total,
                         bool first) {
  static_assert(R <= 4);
  Rows<R> acc;
  for (int64_t k = 0; k < kBlock; ++k) {
    __m512 w0, w1, w2, w3;
    block.row(k, w0, w1, w2, w3);
    acc.fma(x, ldx, k, w0, w1, w2, w3);
  }
  acc.add_into(total, first);
}

template <typename Block>
struct FusedChunk {
  const float* x;
  int64_t ldx;
  const Block& block;
  float* total;
  bool first;

  template <int R>
  void run(int64_t r) const {
    fused_kernel<R>(x + r * ldx, ldx, block, total + r * kPanel, first);
  }
};

template <typename Block>
void fused_rows(const float* x, int64_t ldx, int64_t rows, const Block& block, float* total,
                bool first) {
  over_rows<4>(rows, FusedChunk<Block>{x, ldx, block, total, first});
}

// out[r, 0:cols] = total[r, 0:cols] (+ bias) for r < rows (out rows of stride ldo)
void write_rows(const float* total, int64_t rows, float* out, int64_t ldo, int64_t cols,
                const float* bias) {
  for (int64_t i = 0; i < kPanel / 16; ++i) {
    const int64_t first = 16 * i;
    if (first >= cols) break;
    const __mmask16 mask =
        cols - first >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (cols - first)) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + first) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 t = _mm512_loadu_ps(total + r * kPanel + first);
      _mm512_mask_storeu_ps(out + r * ldo + first, mask, bias ? _mm512_add_ps(t, b) : t);
    }
  }
}

// a per-thread buffer of at least n floats
float* thread_buffer(int64_t n) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

// out [M, N] = x [M, K] . the panels (+ bias); block_at(p, blk) is panel p's block blk (of K /
// 32). Panels are split across threads. Up to 16 rows, each block is decoded in registers
// once per 4 rows; beyond, into the thread's buffer once per 256 rows. Both give the same bits.
template <typename BlockAt>
void multiply_panels(const float* xp, int64_t M, int64_t K, int64_t P, int64_t N,
                     const float* bias, float* op, const BlockAt& block_at) {
  const int64_t B = K / kBlock;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    float* buffer = thread_buffer(kBlock * kPanel + kRowGroup * kPanel);
    float* total = buffer + kBlock * kPanel;  // [rows, 64] partial sums
    for (int64_t p = begin; p < end; ++p) {
      const int64_t first = p * kPanel, cols = std::min(kPanel, N - first);
      for (int64_t r0 = 0; r0 < M; r0 += kRowGroup) {
        const int64_t rows = std::min(kRowGroup, M - r0);
        for (int64_t blk = 0; blk < B; ++blk) {
          const auto block = block_at(p, blk);
          const float* xb = xp + r0 * K + blk * kBlock;
          if (rows <= kFusedRows) {
            fused_rows(xb, K, rows, block, total, blk == 0);
          } else {
            decode_block(block, buffer);
            rows_of_block(xb, K, rows, buffer, total, blk == 0);
          }
        }
        write_rows(total, rows, op + r0 * N + first, N, cols, bias ? bias + first : nullptr);
      }
    }
  });
}

// The fp32 weight [N, K] that the panels hold, as the kernel decodes them.
template <typename BlockAt>
void decode_panels(int64_t P, int64_t K, int64_t N, float* op, const BlockAt& block_at) {
  float buffer[kBlock * kPanel];
  for (int64_t p = 0; p < P; ++p) {
    for (int64_t b = 0; b < K / kBlock; ++b) {
      decode_block(block_at(p, b), buffer);
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j)
        for (int64_t k = 0; k < kBlock; ++k)
          op[(p * kPanel + j) * K + b * kBlock + k] = buffer[k * kPanel + j];
    }
  }
}
#endif

void check_fp32(const torch::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.dim() == dim &&
                  t.is_contiguous(),
              name, " must be a contiguous float32 CPU tensor of ", dim, " dimensions");
}

// panels [P, K, 64] of ``dtype`` (``what`` names them in the error), K a multiple of 32, N in
// the last panel
void check_panels(const torch::Tensor& panels, torch::ScalarType dtype, const char* what,
                  int64_t out_features) {
  TORCH_CHECK(compiled_for_avx512(), "panel_linear was built without AVX-512");
  TORCH_CHECK(panels.device().is_cpu() && panels.scalar_type() == dtype &&
                  panels.dim() == 3 && panels.is_contiguous() && panels.size(2) == kPanel,
              what, " must be contiguous [P, K, 64] of ", dtype);
  TORCH_CHECK(panels.size(1) % kBlock == 0, "K must be a multiple of ", kBlock);
  const int64_t P = panels.size(0);
  TORCH_CHECK(out_features > (P - 1) * kPanel && out_features <= P * kPanel,
              "out_features must lie in the last panel");
}

// codes [P, K, 64] int8, scales and offsets [P, K / 32, 64], N in the last panel
void check_blocks(const torch::Tensor& codes, const torch::Tensor& scales,
                  const torch::Tensor& offsets, int64_t out_features) {
  check_panels(codes, torch::kInt8, "codes", out_features);
  check_fp32(scales, "scales", 3);
  check_fp32(offsets, "offsets", 3);
  const std::vector<int64_t> want = {codes.size(0), codes.size(1) / kBlock, kPanel};
  TORCH_CHECK(scales.sizes() == want && offsets.sizes() == want,
              "scales and offsets must be [P, K / 32, 64]");
}

}  // namespace

// int8 codes [N, K], scales and offsets [N, K / 32] -> panels (see the top).
std::vector<torch::Tensor> pack_blocks(const torch::Tensor& codes, const torch::Tensor& scales,
                                       const torch::Tensor& offsets) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == torch::kInt8 &&
                  codes.dim() == 2 && codes.is_contiguous(),
              "codes must be contiguous int8 [N, K]");
  const int64_t N = codes.size(0), K = codes.size(1), B = K / kBlock;
  TORCH_CHECK(K % kBlock == 0, "K must be a multiple of ", kBlock);
  check_fp32(scales, "scales", 2);
  check_fp32(offsets, "offsets", 2);
  TORCH_CHECK(scales.size(0) == N && scales.size(1) == B && offsets.sizes() == scales.sizes(),
              "scales and offsets must be [N, K / 32]");
  const int64_t P = (N + kPanel - 1) / kPanel;
  auto c_out = torch::zeros({P, K, kPanel}, codes.options());
  auto s_out = torch::zeros({P, B, kPanel}, scales.options());
  auto o_out = torch::zeros({P, B, kPanel}, scales.options());
  const int8_t* c = codes.data_ptr<int8_t>();
  const float* sc = scales.data_ptr<float>();
  const float* of = offsets.data_ptr<float>();
  int8_t* co = c_out.data_ptr<int8_t>();
  float* so = s_out.data_ptr<float>();
  float* oo = o_out.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t p = n / kPanel, j = n % kPanel;
    for (int64_t k = 0; k < K; ++k) co[(p * K + k) * kPanel + j] = c[n * K + k];
    for (int64_t b = 0; b < B; ++b) {
      so[(p * B + b) * kPanel + j] = sc[n * B + b];
      oo[(p * B + b) * kPanel + j] = of[n * B + b];
    }
  }
  return {c_out, s_out, o_out};
}

// panel p's block blk of block-coded panels (codes [P, K, 64], scales and offsets [P, K / 32,
// 64]), as a CodedBlock
struct CodedBlocks {
  const int8_t* codes;
  const float* scales;
  const float* offsets;
  int64_t K;

  CodedBlocks(const torch::Tensor& c, const torch::Tensor& s, const torch::Tensor& o)
      : codes(c.data_ptr<int8_t>()), scales(s.data_ptr<float>()),
        offsets(o.data_ptr<float>()), K(c.size(1)) {}

#ifdef __AVX512F__
  CodedBlock operator()(int64_t p, int64_t blk) const {
    const int64_t at = (p * (K / kBlock) + blk) * kPanel;
    return CodedBlock(codes + (p * K + blk * kBlock) * kPanel, scales + at, offsets + at);
  }
#endif
};

// The fp32 weight [N, K] that block-coded panels hold, as the kernel decodes it.
torch::Tensor decode_blocks(const torch::Tensor& codes, const torch::Tensor& scales,
                            const torch::Tensor& offsets, int64_t out_features) {
  check_blocks(codes, scales, offsets, out_features);
  auto out = torch::empty({out_features, codes.size(1)}, scales.options());
#ifdef __AVX512F__
  decode_panels(codes.size(0), codes.size(1), out_features, out.data_ptr<float>(),
                CodedBlocks(codes, scales, offsets));
#endif
  return out;
}

// bias as a pointer (nullptr: none), checked against N
const float* bias_pointer(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  check_fp32(*bias, "bias", 1);
  TORCH_CHECK(bias->size(0) == N, "bias must be [out_features]");
  return bias->data_ptr<float>();
}

// x [M, K] . block-coded panels -> [M, N] (+ bias).
torch::Tensor linear_blocks(const torch::Tensor& x, const torch::Tensor& codes,
                            const torch::Tensor& scales, const torch::Tensor& offsets,
                            int64_t out_features, const c10::optional<torch::Tensor>& bias) {
  check_fp32(x, "x", 2);
  check_blocks(codes, scales, offsets, out_features);
  TORCH_CHECK(codes.size(1) == x.size(1), "codes must be [P, K, 64] with K = x.size(1)");
  const float* b = bias_pointer(bias, out_features);
  auto out = torch::empty({x.size(0), out_features}, x.options());
#ifdef __AVX512F__
  multiply_panels(x.data_ptr<float>(), x.size(0), x.size(1), codes.size(0), out_features, b,
                  out.data_ptr<float>(), CodedBlocks(codes, scales, offsets));
#endif
  return out;
}

// panel p's block blk of bf16 panels [P, K, 64], as a Bf16Block
struct Bf16Blocks {
  const uint16_t* values;
  int64_t K;

  explicit Bf16Blocks(const torch::Tensor& v)
      : values(reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>())), K(v.size(1)) {}

#ifdef __AVX512F__
  Bf16Block operator()(int64_t p, int64_t blk) const {
    return Bf16Block{values + (p * K + blk * kBlock) * kPanel};
  }
#endif
};

// bf16 weight [N, K] -> panels [P, K, 64] (zero past N)
torch::Tensor pack_bf16(const torch::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == torch::kBFloat16 &&
                  weight.dim() == 2 && weight.is_contiguous(),
              "weight must be contiguous bfloat16 [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(K % kBlock == 0, "K must be a multiple of ", kBlock);
  auto padded = torch::zeros({P * kPanel, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({P, kPanel, K}).transpose(1, 2).contiguous();
}

// The fp32 weight [N, K] that bf16 panels hold, as the kernel decodes them.
torch::Tensor decode_bf16(const torch::Tensor& panels, int64_t out_features) {
  check_panels(panels, torch::kBFloat16, "bf16 panels", out_features);
  auto out = torch::empty({out_features, panels.size(1)}, panels.options().dtype(torch::kFloat32));
#ifdef __AVX512F__
  decode_panels(panels.size(0), panels.size(1), out_features, out.data_ptr<float>(),
                Bf16Blocks(panels));
#endif
  return out;
}

// x [M, K] . bf16 panels -> [M, N] (+ bias).
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& panels,
                          int64_t out_features, const c10::optional<torch::Tensor>& bias) {
  check_fp32(x, "x", 2);
  check_panels(panels, torch::kBFloat16, "bf16 panels", out_features);
  TORCH_CHECK(panels.size(1) == x.size(1), "panels must be [P, K, 64] with K = x.size(1)");
  const float* b = bias_pointer(bias, out_features);
  auto out = torch::empty({x.size(0), out_features}, x.options());
#ifdef __AVX512F__
  multiply_panels(x.data_ptr<float>(), x.size(0), x.size(1), panels.size(0), out_features, b,
                  out.data_ptr<float>(), Bf16Blocks(panels));
#endif
  return out;
}

bool available() { return compiled_for_avx512(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this build has the AVX-512 kernel");
  m.def("pack_blocks", &pack_blocks, "int8 codes [N, K], scales, offsets [N, K/32] -> panels",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("decode_blocks", &decode_blocks, "block-coded panels -> the fp32 weight [N, K]",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("linear_blocks", &linear_blocks, "x [M, K] . block-coded panels -> [M, N] (+ bias)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("pack_bf16", &pack_bf16, "bf16 weight [N, K] -> panels [P, K, 64]",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("decode_bf16", &decode_bf16, "bf16 panels -> the fp32 weight [N, K]",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("linear_bf16", &linear_bf16, "x [M, K] . bf16 panels -> [M, N] (+ bias)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
