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
// and that backward itself, written plainly with all its arithmetic (fp32; the same bytes as the lazy floor, plus
// each point's mixture-norm scalars, the depth weights and the folded queries):
//   lazy_point_backward:  the output-norm backward, dm = r (w*dy) - r^3/d ((w*dy) . o) o with r the mixture's rstd,
//                         dm . o (written into its row of the chain's [points, N]), which the softmax backward of
//                         every source of the point subtracts, and the output-norm gain's gradient
//   lazy_source_backward: with ds_l = alpha_l (dm_l . x - dm_l . o_l) and u = sum_l ds_l c_l,
//                         grad = sum_l alpha_l dm_l + k u - k^3/d (u . x) x (k: the key norm's rstd of x), and each
//                         later query's gradient share, dC_l = sum over tokens of ds_l k x
#include <ATen/Parallel.h>
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// Every op here reads fp32 contiguous tensors: `what` names the argument and the shape expected of it.
void check_fp32(const at::Tensor& t, int64_t numel, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == numel, "chain_floor: ", what);
}

// The data of a list of rows [N, d], checked.
std::vector<const float*> row_pointers(at::TensorList rows, int64_t numel, const char* what) {
  TORCH_CHECK(!rows.empty(), "chain_floor: ", what, ", at least one");
  std::vector<const float*> out;
  for (const auto& t : rows) {
    check_fp32(t, numel, what);
    out.push_back(t.data_ptr<float>());
  }
  return out;
}

// The project kernel's grain (attnres/ops/cpu/depth_attention.cpp, grain_size): about 64K floats of rows a chunk.
int64_t grain(int64_t rows, int64_t d) { return std::max<int64_t>(1, (int64_t(1) << 16) / (rows * d)); }

void floor_bwd_into(const at::Tensor& grad_out, at::TensorList sources, const at::Tensor& weights,
                    const at::Tensor& into, bool accumulate) {
  TORCH_CHECK(!sources.empty(), "chain_floor: expected at least one source");
  const int64_t n_src = int64_t(sources.size()), d = sources[0].size(-1), n_tok = sources[0].numel() / d;
  const auto x = row_pointers(sources, n_tok * d, "fp32 contiguous sources of one shape");
  check_fp32(grad_out, n_tok * d, "grad_out as a source");
  check_fp32(weights, n_src * n_tok, "weights [R, N]");
  check_fp32(into, n_src * n_tok * d, "into [R, N, d]");
  const float* g = grad_out.data_ptr<float>();
  const float* alpha = weights.data_ptr<float>();
  float* sums = into.data_ptr<float>();
  at::parallel_for(0, n_tok, grain(n_src, d), [&](int64_t begin, int64_t end) {
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

// row . x, while adding a * row into sum: the one pass a lazy source makes over each later point's kept row
inline float dot_and_add(const float* row, const float* x, float a, float* sum, int64_t d) {
  float dot = 0;
#pragma omp simd reduction(+ : dot)
  for (int64_t i = 0; i < d; ++i) {
    dot += row[i] * x[i];
    sum[i] += a * row[i];
  }
  return dot;
}

void floor_lazy_point(const at::Tensor& grad_out, const at::Tensor& mixture, const at::Tensor& g) {
  const int64_t d = grad_out.size(-1), n_tok = grad_out.numel() / d;
  const auto rows = row_pointers({grad_out, mixture, g}, n_tok * d, "lazy_point takes fp32 contiguous rows of one shape");
  const float *dy = rows[0], *o = rows[1];
  float* out = g.data_ptr<float>();
  at::parallel_for(0, n_tok, grain(1, d), [&](int64_t begin, int64_t end) {
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
  const int64_t d = x.size(-1), n_tok = x.numel() / d, n_g = int64_t(gs.size());
  const auto g = row_pointers(gs, n_tok * d, "lazy_source takes the fp32 contiguous rows of the later points");
  row_pointers({x, grad}, n_tok * d, "lazy_source takes fp32 contiguous rows of one shape");
  check_fp32(weights, n_g * n_tok, "lazy_source weights [n, N], one row per later point");
  const float* xp = x.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  float* out = grad.data_ptr<float>();
  at::parallel_for(0, n_tok, grain(n_g + 1, d), [&](int64_t begin, int64_t end) {
    std::vector<float> sum(d);
    for (int64_t n = begin; n < end; ++n) {
      const float* xn = xp + n * d;
      float c = 0;
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t l = 0; l < n_g; ++l) {
        const float a = w[l * n_tok + n];
        c += a * dot_and_add(g[l] + n * d, xn, a, sum.data(), d);
      }
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) out[n * d + i] = sum[i] + c * xn[i];
    }
  });
}

at::Tensor lazy_point_backward(const at::Tensor& grad_out, const at::Tensor& mixture, const at::Tensor& weight,
                               const at::Tensor& rstd, const at::Tensor& dm, const at::Tensor& dm_dot_o) {
  const int64_t d = grad_out.size(-1), n_tok = grad_out.numel() / d;
  const auto rows =
      row_pointers({grad_out, mixture, dm}, n_tok * d, "lazy_point_backward takes fp32 contiguous rows of one shape");
  check_fp32(weight, d, "lazy_point_backward weight [d]");
  check_fp32(rstd, n_tok, "lazy_point_backward rstd [N]");
  check_fp32(dm_dot_o, n_tok, "lazy_point_backward dm_dot_o [N]");
  auto d_weight = at::zeros({at::get_num_threads(), d}, grad_out.options());  // one row per thread, summed after
  const float *dy = rows[0], *o = rows[1], *w = weight.data_ptr<float>(), *r = rstd.data_ptr<float>();
  float *out = dm.data_ptr<float>(), *mo = dm_dot_o.data_ptr<float>(), *dw = d_weight.data_ptr<float>();
  at::parallel_for(0, n_tok, grain(1, d), [&](int64_t begin, int64_t end) {
    float* dwt = dw + at::get_thread_num() * d;
    for (int64_t n = begin; n < end; ++n) {
      const float *dn = dy + n * d, *on = o + n * d;
      float* mn = out + n * d;
      const float rn = r[n];
      float dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < d; ++i) dot += w[i] * dn[i] * on[i];
      const float k = rn * rn * rn / d * dot;
      float m_o = 0;
#pragma omp simd reduction(+ : m_o)
      for (int64_t i = 0; i < d; ++i) {
        mn[i] = rn * w[i] * dn[i] - k * on[i];
        m_o += mn[i] * on[i];
        dwt[i] += dn[i] * on[i] * rn;
      }
      mo[n] = m_o;
    }
  });
  return d_weight.sum(0);
}

at::Tensor lazy_source_backward(const at::Tensor& x, at::TensorList dms, const at::Tensor& dm_dot_o,
                                const at::Tensor& alpha, const at::Tensor& queries, double eps, const at::Tensor& grad) {
  const int64_t d = x.size(-1), n_tok = x.numel() / d, n_l = int64_t(dms.size());
  const auto dm = row_pointers(dms, n_tok * d, "lazy_source_backward takes the fp32 contiguous rows of the later points");
  row_pointers({x, grad}, n_tok * d, "lazy_source_backward takes fp32 contiguous rows of one shape");
  row_pointers({dm_dot_o, alpha}, n_l * n_tok, "lazy_source_backward dm_dot_o and alpha [n, N], one row per later point");
  check_fp32(queries, n_l * d, "lazy_source_backward queries [n, d], one per later point");
  auto d_queries = at::zeros({at::get_num_threads(), n_l, d}, x.options());  // one block per thread, summed after
  const float *xp = x.data_ptr<float>(), *mo = dm_dot_o.data_ptr<float>(), *a = alpha.data_ptr<float>();
  const float* c = queries.data_ptr<float>();
  float *out = grad.data_ptr<float>(), *dq = d_queries.data_ptr<float>();
  const float eps_f = float(eps);
  at::parallel_for(0, n_tok, grain(n_l + 1, d), [&](int64_t begin, int64_t end) {
    float* dqt = dq + at::get_thread_num() * n_l * d;
    std::vector<float> sum(d), u(d);
    for (int64_t n = begin; n < end; ++n) {
      const float* xn = xp + n * d;
      float ss = 0;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < d; ++i) ss += xn[i] * xn[i];
      const float k = 1.f / std::sqrt(ss / d + eps_f);
      std::fill(sum.begin(), sum.end(), 0.f);
      std::fill(u.begin(), u.end(), 0.f);
      for (int64_t l = 0; l < n_l; ++l) {
        const float al = a[l * n_tok + n];
        const float ds = al * (dot_and_add(dm[l] + n * d, xn, al, sum.data(), d) - mo[l * n_tok + n]);
        const float* cl = c + l * d;
        float* dql = dqt + l * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) {
          u[i] += ds * cl[i];
          dql[i] += ds * k * xn[i];
        }
      }
      float u_x = 0;
#pragma omp simd reduction(+ : u_x)
      for (int64_t i = 0; i < d; ++i) u_x += u[i] * xn[i];
      const float b = k * k * k / d * u_x;
      float* gn = out + n * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) gn[i] = sum[i] + k * u[i] - b * xn[i];
    }
  });
  return d_queries.sum(0);
}

}  // namespace

TORCH_LIBRARY(attnres_chain_floor, m) {
  m.def("bwd_into(Tensor grad_out, Tensor[] sources, Tensor weights, Tensor(a!) into, bool accumulate) -> ()");
  m.def("lazy_point(Tensor grad_out, Tensor mixture, Tensor(a!) g) -> ()");
  m.def("lazy_source(Tensor x, Tensor[] gs, Tensor weights, Tensor(a!) grad) -> ()");
  m.def("lazy_point_backward(Tensor grad_out, Tensor mixture, Tensor weight, Tensor rstd, Tensor(a!) dm, "
        "Tensor(b!) dm_dot_o) -> Tensor");
  m.def("lazy_source_backward(Tensor x, Tensor[] dms, Tensor dm_dot_o, Tensor alpha, Tensor queries, float eps, "
        "Tensor(a!) grad) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnres_chain_floor, CPU, m) {
  m.impl("bwd_into", &floor_bwd_into);
  m.impl("lazy_point", &floor_lazy_point);
  m.impl("lazy_source", &floor_lazy_source);
  m.impl("lazy_point_backward", &lazy_point_backward);
  m.impl("lazy_source_backward", &lazy_source_backward);
}
