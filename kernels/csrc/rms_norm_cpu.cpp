// RMSNorm (Zhang & Sennrich 2019) of float32 rows on the CPU, in one pass per row:
// y = weight * (x / sqrt(mean(x^2) + eps)), written as transformers' LlamaRMSNorm
// computes it (x times the reciprocal square root, then times the weight). Rows are
// spread over torch's intra-op threads. Differs from torch's composite F.rms_norm in
// float32 summation order only; for a decode batch it is one call instead of six ops.
//
// Registered as torch.ops.mm_serve_cpu.rms_norm by kernels/cpu_extension.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

namespace {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "rms_norm: float32 CPU tensors only");
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), "rms_norm: x must be contiguous [..., H]");
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden && weight.is_contiguous(),
              "rms_norm: weight must be a contiguous [H] tensor matching x's last dimension");
  at::Tensor out = at::empty_like(x);
  const int64_t rows = hidden == 0 ? 0 : x.numel() / hidden;
  const float* x_data = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  // Grain: ~32K values a task, so a decode batch stays on one thread.
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(hidden, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x_data + r * hidden;
      float* dst = out_data + r * hidden;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < hidden; ++i) sum += row[i] * row[i];
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + feps);
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) dst[i] = w[i] * (row[i] * inv);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mm_serve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
}
