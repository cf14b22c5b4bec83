// The CPU attention kernels as one Python module (built by kernels/paged_attention_cpu.py).

#include <torch/extension.h>

#include <vector>

std::vector<torch::Tensor> paged_decode_attention(const torch::Tensor& q,
                                                  const torch::Tensor& k_cache,
                                                  const torch::Tensor& v_cache,
                                                  const torch::Tensor& block_tables,
                                                  const torch::Tensor& visible, double scale);

std::vector<torch::Tensor> paged_prefill_attention(
    const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
    const torch::Tensor& block_tables, const torch::Tensor& q_lens,
    const torch::Tensor& offsets, const torch::Tensor& ctx, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL, as torch's own operators run: a replica's event loop and Ray's threads
  // keep working while a step attends.
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over the paged KV cache, read in place (fp32, CPU)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "Causal prefill / chunk attention over the paged KV cache (fp32, CPU)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
