// The least work on the bytes of a chained point's backward (attnres/ops/chain.py), for benchmarks/chain_floor.py.
//
// Whatever else a backward of a Full point computes, it reads each token's R source rows and its gradient row, and
// reads, adds to and writes back the R gradient-sum rows of the chain. This kernel does exactly that with one dot
// product per source and one multiply-add per element:
//   into[j] (+)= alpha_j * g + (g . x_j) * x_j
// tokens split across threads as the project's kernel splits them. Its time is the floor that any reordering of the
// real kernel's arithmetic could reach without moving fewer bytes.
//
// The floor of a lazy backward, which keeps each point's gradient row and forms each source's gradient once, when the
// chain reaches the source's producer, is two kernels with the same least arithmetic:
//   lazy_point:  g = dy + (dy . o) o                     per point: its gradient and mixture rows read, g written
//   lazy_source: grad = sum_l w_l g_l + (sum_l w_l (g_l . x)) x
//                                                        per source: it and every later point's g read, grad written
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

void floor_lazy_point(const at::Tensor& grad_out, const at::Tensor& mixture, const at::Tensor& g) {
  const int64_t d = grad_out.size(-1), n_tok = grad_out.numel() / d;
  for (const auto* t : {&grad_out, &mixture, &g})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == n_tok * d,
                "chain_floor: lazy_point takes fp32 contiguous rows of one shape");
  const float* dy = grad_out.data_ptr<float>();
  const float* o = mixture.data_ptr<float>();
  float* out = g.data_ptr<float>();
  at::parallel_for(0, n_tok, std::max<int64_t>(1, (int64_t(1) << 16) / d), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float *dn = dy + n * d, *on = o + n * d;
      float dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < d; ++i) dot += dn[i] * on[i];
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) out[n * d + i] = dn[i] + dot * on[i];
    }
  });
}

void floor_lazy_source(const at::Tensor& x, at::TensorList gs, const at::Tensor& weights, const at::Tensor& grad) {
  const int64_t n_g = int64_t(gs.size());
  const int64_t d = x.size(-1), n_tok = x.numel() / d;
  TORCH_CHECK(n_g > 0, "chain_floor: lazy_source expects the rows of at least one later point");
  for (const auto* t : {&x, &grad})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == n_tok * d,
                "chain_floor: lazy_source takes fp32 contiguous rows of one shape");
  std::vector<const float*> g(n_g);
  for (int64_t l = 0; l < n_g; ++l) {
    TORCH_CHECK(gs[l].scalar_type() == at::kFloat && gs[l].is_contiguous() && gs[l].numel() == n_tok * d,
                "chain_floor: lazy_source takes fp32 contiguous rows of one shape");
    g[l] = gs[l].data_ptr<float>();
  }
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.numel() == n_g * n_tok,
              "chain_floor: lazy_source weights [n, N], one row per later point");
  const float* xp = x.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  float* out = grad.data_ptr<float>();
  at::parallel_for(0, n_tok, std::max<int64_t>(1, (int64_t(1) << 16) / ((n_g + 1) * d)), [&](int64_t begin, int64_t end) {
    std::vector<float> sum(d);
    for (int64_t n = begin; n < end; ++n) {
      const float* xn = xp + n * d;
      float c = 0;
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t l = 0; l < n_g; ++l) {
        const float* gl = g[l] + n * d;
        const float a = w[l * n_tok + n];
        float dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < d; ++i) {
          dot += gl[i] * xn[i];
          sum[i] += a * gl[i];
        }
        c += a * dot;
      }
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) out[n * d + i] = sum[i] + c * xn[i];
    }
  });
}

}  // namespace

TORCH_LIBRARY(attnres_chain_floor, m) {
  m.def("bwd_into(Tensor grad_out, Tensor[] sources, Tensor weights, Tensor(a!) into, bool accumulate) -> ()");
  m.def("lazy_point(Tensor grad_out, Tensor mixture, Tensor(a!) g) -> ()");
  m.def("lazy_source(Tensor x, Tensor[] gs, Tensor weights, Tensor(a!) grad) -> ()");
}

TORCH_LIBRARY_IMPL(attnres_chain_floor, CPU, m) {
  m.impl("bwd_into", &floor_bwd_into);
  m.impl("lazy_point", &floor_lazy_point);
  m.impl("lazy_source", &floor_lazy_source);
}
