// The least work on the bytes of a chained point's backward (attnres/ops/chain.py), for benchmarks/chain_floor.py.
//
// Whatever else a backward of a Full point computes, it reads each token's R source rows and its gradient row, and
// reads, adds to and writes back the R gradient-sum rows of the chain. This kernel does exactly that with one dot
// product per source and one multiply-add per element:
//   into[j] (+)= alpha_j * g + (g . x_j) * x_j
// tokens split across threads as the project's kernel splits them. Its time is the floor that any reordering of the
// real kernel's arithmetic could reach without moving fewer bytes.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

void floor_bwd_into(const at::Tensor& grad_out, at::TensorList sources, const at::Tensor& weights,
                    const at::Tensor& into, bool accumulate) {
  const int64_t n_src = int64_t(sources.size());
  TORCH_CHECK(n_src > 0, "chain_floor: expected at least one source");
  const int64_t d = sources[0].size(-1), n_tok = sources[0].numel() / d;
  auto fp32_contiguous = [](const at::Tensor& t) { return t.scalar_type() == at::kFloat && t.is_contiguous(); };
  TORCH_CHECK(fp32_contiguous(grad_out) && grad_out.numel() == n_tok * d, "chain_floor: grad_out as a source");
  for (const auto& x : sources)
    TORCH_CHECK(fp32_contiguous(x) && x.numel() == n_tok * d, "chain_floor: fp32 contiguous sources of one shape");
  TORCH_CHECK(fp32_contiguous(weights) && weights.numel() == n_src * n_tok, "chain_floor: weights [R, N]");
  TORCH_CHECK(fp32_contiguous(into) && into.numel() == n_src * n_tok * d, "chain_floor: into [R, N, d]");
  std::vector<const float*> x(n_src);
  for (int64_t j = 0; j < n_src; ++j) x[j] = sources[j].data_ptr<float>();
  const float* g = grad_out.data_ptr<float>();
  const float* alpha = weights.data_ptr<float>();
  float* sums = into.data_ptr<float>();
  // the project kernel's grain (attnres/ops/cpu/depth_attention.cpp, grain_size)
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (n_src * d));
  at::parallel_for(0, n_tok, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> dots(n_src);
    for (int64_t n = begin; n < end; ++n) {
      const float* gn = g + n * d;
      for (int64_t j = 0; j < n_src; ++j) {
        const float* xj = x[j] + n * d;
        float dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < d; ++i) dot += xj[i] * gn[i];
        dots[j] = dot;
      }
      for (int64_t j = 0; j < n_src; ++j) {
        const float* xj = x[j] + n * d;
        float* sj = sums + (j * n_tok + n) * d;
        const float a = alpha[j * n_tok + n], b = dots[j];
        if (accumulate) {
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) sj[i] += a * gn[i] + b * xj[i];
        } else {
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) sj[i] = a * gn[i] + b * xj[i];
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(attnres_chain_floor, m) {
  m.def("bwd_into(Tensor grad_out, Tensor[] sources, Tensor weights, Tensor(a!) into, bool accumulate) -> ()");
}

TORCH_LIBRARY_IMPL(attnres_chain_floor, CPU, m) { m.impl("bwd_into", &floor_bwd_into); }
