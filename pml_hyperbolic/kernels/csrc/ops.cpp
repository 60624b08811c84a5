// The native kernels of kernels.c as torch operators (namespace pml_hyperbolic, names starting
// with "_native_": private to the package, called by pml_hyperbolic/kernels/native.py).
//
// Each operator checks its tensors (CPU, contiguous, one float dtype), then runs the C loop on row
// ranges given by `bounds` (part k covers [bounds[k], bounds[k+1])), the parts shared by torch's
// intra-op threads. The C file stays plain C (it is included here, with C linkage, so that one
// translation unit is built by torch.utils.cpp_extension). Only the ATen core headers and
// torch/library.h are included, not torch/extension.h (no pybind11): a short first build.
//
// Design note: docs/design/native-code.md

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#define restrict __restrict__
extern "C" {
#include "kernels.c"
}
#undef restrict

namespace {

using at::Tensor;

bool single(const Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble,
              "pml_hyperbolic native kernels: float32 or float64 expected, got ", t.scalar_type());
  return t.scalar_type() == at::kFloat;
}

void expect(const Tensor& t, const Tensor& like, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == like.scalar_type(), name,
              ": a contiguous CPU tensor of dtype ", like.scalar_type(), " expected");
}

void expect_index(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == at::kLong, name,
              ": a contiguous CPU int64 tensor expected");
}

// part(k) for every k in [0, parts), shared by torch's intra-op threads.
template <class F>
void in_parallel(int64_t parts, const F& part) {
  if (parts == 1) {
    part(0);
  } else if (parts > 1) {
    at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end; ++k) part(k);
    });
  }
}

template <class T> struct C;
template <> struct C<float> {
  static constexpr auto tail = pml_tail_f32;
  static constexpr auto log1p = pml_log1p_f32;
  static constexpr auto sym_tail = pml_sym_tail_f32;
  static constexpr auto gen_tail = pml_gen_tail_f32;
  static constexpr auto sym_grad = pml_sym_grad_f32;
  static constexpr auto row_terms = pml_row_terms_f32;
  static constexpr auto uniform_rows = pml_uniform_rows_f32;
  static constexpr auto lca_rows = pml_lca_rows_f32;
  static constexpr auto lca_backward = pml_lca_backward_f32;
};
template <> struct C<double> {
  static constexpr auto tail = pml_tail_f64;
  static constexpr auto log1p = pml_log1p_f64;
  static constexpr auto sym_tail = pml_sym_tail_f64;
  static constexpr auto gen_tail = pml_gen_tail_f64;
  static constexpr auto sym_grad = pml_sym_grad_f64;
  static constexpr auto row_terms = pml_row_terms_f64;
  static constexpr auto uniform_rows = pml_uniform_rows_f64;
  static constexpr auto lca_rows = pml_lca_rows_f64;
  static constexpr auto lca_backward = pml_lca_backward_f64;
};

template <class T>
T* ptr(const std::optional<Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

// P -> D = log1p(W + sqrt2 S)/sqrt(c), W = P q_j; S written when given (pml_tail_*).
template <class T>
void tail_t(Tensor& P, const std::optional<Tensor>& S, const Tensor& q, double inv_sqrt_c, at::IntArrayRef bounds) {
  T* p = P.data_ptr<T>();
  T* s = ptr<T>(S);
  const T* qq = q.data_ptr<T>();
  const long cols = P.size(1);
  in_parallel(bounds.size() - 1, [&](int64_t k) { C<T>::tail(p, s, qq, bounds[k], bounds[k + 1], cols, (T)inv_sqrt_c); });
}

void tail_(Tensor P, std::optional<Tensor> S, Tensor q, double inv_sqrt_c, at::IntArrayRef bounds) {
  TORCH_CHECK(P.dim() == 2 && q.dim() == 1 && q.size(0) == P.size(1), "_native_tail_: P (N, M), q (M,) expected");
  const bool f32 = single(P);
  expect(P, P, "P");
  expect(q, P, "q");
  if (S.has_value()) {
    expect(*S, P, "S");
    TORCH_CHECK(S->sizes() == P.sizes(), "_native_tail_: S must have P's shape");
  }
  f32 ? tail_t<float>(P, S, q, inv_sqrt_c, bounds) : tail_t<double>(P, S, q, inv_sqrt_c, bounds);
}

void log1p_out(Tensor u, Tensor out) {
  const bool f32 = single(u);
  expect(u, u, "u");
  expect(out, u, "out");
  TORCH_CHECK(out.numel() == u.numel(), "_native_log1p: out must have u's size");
  if (f32) {
    C<float>::log1p(u.data_ptr<float>(), out.data_ptr<float>(), u.numel());
  } else {
    C<double>::log1p(u.data_ptr<double>(), out.data_ptr<double>(), u.numel());
  }
}

// part(k, &count_k) for every k in [0, parts), as in_parallel; returns the sum of the parts' counts.
template <class F>
int64_t counted_in_parallel(int64_t parts, const F& part) {
  std::vector<long> counts(parts > 0 ? parts : 0, 0);
  in_parallel(parts, [&](int64_t k) { part(k, &counts[k]); });
  int64_t total = 0;
  for (long c : counts) total += c;
  return total;
}

// x is y: G (x x^T above the diagonal) -> the full symmetric D; returns the close pairs' count.
template <class T>
int64_t sym_tail_t(Tensor& G, const std::optional<Tensor>& S, const Tensor& x2, const Tensor& p2, const Tensor& q,
                   double inv_sqrt_c, double close, at::IntArrayRef bounds) {
  T* g = G.data_ptr<T>();
  T* s = ptr<T>(S);
  const T *a = x2.data_ptr<T>(), *b = p2.data_ptr<T>(), *cq = q.data_ptr<T>();
  const long n = G.size(0);
  return counted_in_parallel(bounds.size() - 1, [&](int64_t k, long* count) {
    C<T>::sym_tail(g, s, a, b, cq, n, (T)inv_sqrt_c, (T)close, bounds[k], bounds[k + 1], count);
  });
}

int64_t sym_tail_(Tensor G, std::optional<Tensor> S, Tensor x2, Tensor p2, Tensor q, double inv_sqrt_c, double close,
                  at::IntArrayRef bounds) {
  TORCH_CHECK(G.dim() == 2 && G.size(0) == G.size(1), "_native_sym_tail_: G must be square");
  const bool f32 = single(G);
  expect(G, G, "G");
  for (const Tensor* t : {&x2, &p2, &q}) {
    expect(*t, G, "x2, p2, q");
    TORCH_CHECK(t->dim() == 1 && t->size(0) == G.size(0), "_native_sym_tail_: x2, p2, q must be (N,)");
  }
  if (S.has_value()) {
    expect(*S, G, "S");
    TORCH_CHECK(S->sizes() == G.sizes(), "_native_sym_tail_: S must have G's shape");
  }
  return f32 ? sym_tail_t<float>(G, S, x2, p2, q, inv_sqrt_c, close, bounds)
             : sym_tail_t<double>(G, S, x2, p2, q, inv_sqrt_c, close, bounds);
}

// x is not y: G = x y^T -> D; returns the close pairs' count (marked -1 in D).
template <class T>
int64_t gen_tail_t(Tensor& G, const std::optional<Tensor>& S, const Tensor& x2, const Tensor& p2, const Tensor& y2,
                   const Tensor& q, double inv_sqrt_c, double close, at::IntArrayRef bounds) {
  T* g = G.data_ptr<T>();
  T* s = ptr<T>(S);
  const T *a = x2.data_ptr<T>(), *b = p2.data_ptr<T>(), *c2 = y2.data_ptr<T>(), *cq = q.data_ptr<T>();
  const long cols = G.size(1);
  return counted_in_parallel(bounds.size() - 1, [&](int64_t k, long* count) {
    C<T>::gen_tail(g, s, a, b, c2, cq, bounds[k], bounds[k + 1], cols, (T)inv_sqrt_c, (T)close, count);
  });
}

int64_t gen_tail_(Tensor G, std::optional<Tensor> S, Tensor x2, Tensor p2, Tensor y2, Tensor q, double inv_sqrt_c,
                  double close, at::IntArrayRef bounds) {
  TORCH_CHECK(G.dim() == 2, "_native_gen_tail_: G must be (N, M)");
  const bool f32 = single(G);
  expect(G, G, "G");
  for (const Tensor* t : {&x2, &p2}) {
    expect(*t, G, "x2, p2");
    TORCH_CHECK(t->dim() == 1 && t->size(0) == G.size(0), "_native_gen_tail_: x2, p2 must be (N,)");
  }
  for (const Tensor* t : {&y2, &q}) {
    expect(*t, G, "y2, q");
    TORCH_CHECK(t->dim() == 1 && t->size(0) == G.size(1), "_native_gen_tail_: y2, q must be (M,)");
  }
  if (S.has_value()) {
    expect(*S, G, "S");
    TORCH_CHECK(S->sizes() == G.sizes(), "_native_gen_tail_: S must have G's shape");
  }
  for (size_t k = 0; k < bounds.size(); ++k)
    TORCH_CHECK(bounds[k] >= 0 && bounds[k] <= G.size(0) && (k == 0 || bounds[k] >= bounds[k - 1]),
                "_native_gen_tail_: bounds must be non-decreasing rows in [0, N]");
  return f32 ? gen_tail_t<float>(G, S, x2, p2, y2, q, inv_sqrt_c, close, bounds)
             : gen_tail_t<double>(G, S, x2, p2, y2, q, inv_sqrt_c, close, bounds);
}

// S (above the diagonal) -> E = U/S + (U/S)^T; U read with its strides.
template <class T>
void sym_grad_t(const Tensor& U, Tensor& S, at::IntArrayRef bounds) {
  const T* u = U.data_ptr<T>();
  T* s = S.data_ptr<T>();
  const long su0 = U.stride(0), su1 = U.stride(1), n = S.size(0);
  in_parallel(bounds.size() - 1, [&](int64_t k) { C<T>::sym_grad(u, su0, su1, s, n, bounds[k], bounds[k + 1]); });
}

void sym_grad_(Tensor U, Tensor S, at::IntArrayRef bounds) {
  TORCH_CHECK(S.dim() == 2 && S.size(0) == S.size(1) && U.sizes() == S.sizes(), "_native_sym_grad_: square U, S");
  const bool f32 = single(S);
  expect(S, S, "S");
  TORCH_CHECK(U.device().is_cpu() && U.scalar_type() == S.scalar_type(), "_native_sym_grad_: U must be CPU, S's dtype");
  f32 ? sym_grad_t<float>(U, S, bounds) : sym_grad_t<double>(U, S, bounds);
}

// (x2, inv_a) in float64; with `extras` also the symmetric tail's row vectors (3, N) in x's dtype
// and the counts of nonzero and of extreme rows.
std::tuple<Tensor, Tensor, Tensor, int64_t, int64_t> row_terms(Tensor x, double c, double floor, double extreme_inv_a,
                                                               double tiny_sq, bool extras) {
  TORCH_CHECK(x.dim() == 2, "_native_row_terms: x must be (N, D)");
  const bool f32 = single(x);
  expect(x, x, "x");
  const long n = x.size(0), dim = x.size(1);
  auto f64 = x.options().dtype(at::kDouble);
  Tensor x2 = at::empty({n}, f64), inv_a = at::empty({n}, f64);
  Tensor vectors = at::empty({extras ? 3 : 0, n}, x.options());
  long counts[2] = {0, 0};
  if (n == 0) return {x2, inv_a, vectors, 0, 0};
  double *px2 = x2.data_ptr<double>(), *pinv = inv_a.data_ptr<double>();
  if (f32) {
    float* v = extras ? vectors.data_ptr<float>() : nullptr;
    C<float>::row_terms(x.data_ptr<float>(), n, dim, c, floor, px2, pinv, extreme_inv_a, tiny_sq, v,
                        v ? v + n : nullptr, v ? v + 2 * n : nullptr, extras ? counts : nullptr);
  } else {
    double* v = extras ? vectors.data_ptr<double>() : nullptr;
    C<double>::row_terms(x.data_ptr<double>(), n, dim, c, floor, px2, pinv, extreme_inv_a, tiny_sq, v,
                         v ? v + n : nullptr, v ? v + 2 * n : nullptr, extras ? counts : nullptr);
  }
  return {x2, inv_a, vectors, counts[0], counts[1]};
}

void uniform_rows_(int64_t key, int64_t first_row, Tensor out) {
  TORCH_CHECK(out.dim() == 2, "_native_uniform_rows_: out must be (rows, P)");
  const bool f32 = single(out);
  expect(out, out, "out");
  if (f32) {
    C<float>::uniform_rows((uint64_t)key, (uint64_t)first_row, out.size(0), out.size(1), out.data_ptr<float>());
  } else {
    C<double>::uniform_rows((uint64_t)key, (uint64_t)first_row, out.size(0), out.size(1), out.data_ptr<double>());
  }
}

// HIER's LCA triplet rows [bounds[0], bounds[-1]); part k uses row k of `work` (parts, 2P).
template <class T>
int64_t lca_rows_t(const Tensor& dist, const Tensor& i, const Tensor& j, const Tensor& k, double inv_tau,
                   double margin, bool noise, int64_t key, Tensor& loss, Tensor& a, Tensor& b,
                   const std::optional<Tensor>& grads, const std::optional<Tensor>& on, Tensor& work,
                   at::IntArrayRef bounds) {
  const int64_t parts = bounds.size() - 1;
  TORCH_CHECK(work.dim() == 2 && work.size(0) >= parts && work.size(1) == 2 * dist.size(1),
              "_native_lca_rows_: work must be (parts, 2P)");
  std::vector<int> codes(parts > 0 ? parts : 0, 0);
  const T* d = dist.data_ptr<T>();
  const long n = dist.size(0), p = dist.size(1), rows = i.numel();
  const int64_t *ii = i.data_ptr<int64_t>(), *jj = j.data_ptr<int64_t>(), *kk = k.data_ptr<int64_t>();
  T *pl = loss.data_ptr<T>(), *pg = ptr<T>(grads), *po = ptr<T>(on), *pw = work.data_ptr<T>();
  int64_t *pa = a.data_ptr<int64_t>(), *pb = b.data_ptr<int64_t>();
  in_parallel(parts, [&](int64_t q) {
    codes[q] = C<T>::lca_rows(d, n, p, ii, jj, kk, rows, bounds[q], bounds[q + 1], (T)inv_tau, (T)margin, noise ? 1 : 0,
                              (uint64_t)key, pl, pa, pb, pg, po, pw + q * 2 * p);
  });
  for (int c : codes)
    if (c) return c;
  return 0;
}

int64_t lca_rows_(Tensor dist, Tensor i, Tensor j, Tensor k, double inv_tau, double margin, bool noise, int64_t key,
                  Tensor loss, Tensor a, Tensor b, std::optional<Tensor> grads, std::optional<Tensor> on, Tensor work,
                  at::IntArrayRef bounds) {
  TORCH_CHECK(dist.dim() == 2, "_native_lca_rows_: dist must be (N, P)");
  const bool f32 = single(dist);
  expect(dist, dist, "dist");
  expect(loss, dist, "loss");
  expect(work, dist, "work");
  for (const Tensor* t : {&i, &j, &k, &a, &b}) expect_index(*t, "i, j, k, a, b");
  const int64_t rows = i.numel();
  TORCH_CHECK(j.numel() == rows && k.numel() == rows && loss.numel() == rows && a.numel() == rows &&
                  b.numel() == rows, "_native_lca_rows_: i, j, k, loss, a, b must have one length");
  if (grads.has_value()) {
    expect(*grads, dist, "grads");
    TORCH_CHECK(grads->numel() == 2 * rows * dist.size(1), "_native_lca_rows_: grads must be (2, T, P)");
  }
  if (on.has_value()) {
    expect(*on, dist, "on");
    TORCH_CHECK(on->numel() == 3 * rows, "_native_lca_rows_: on must be (3, T)");
  }
  return f32 ? lca_rows_t<float>(dist, i, j, k, inv_tau, margin, noise, key, loss, a, b, grads, on, work, bounds)
             : lca_rows_t<double>(dist, i, j, k, inv_tau, margin, noise, key, loss, a, b, grads, on, work, bounds);
}

// HIER's backward scatter; part q owns grad's rows [bounds[q], bounds[q+1]).
template <class T>
int64_t lca_backward_t(Tensor& grad, const Tensor& dist, const Tensor& i, const Tensor& j, const Tensor& k,
                       const Tensor& u, const Tensor& scale, at::IntArrayRef bounds) {
  const int64_t parts = bounds.size() - 1;
  std::vector<int> codes(parts > 0 ? parts : 0, 0);
  T* g = grad.data_ptr<T>();
  const T *d = dist.data_ptr<T>(), *pu = u.data_ptr<T>(), *ps = scale.data_ptr<T>();
  const int64_t *ii = i.data_ptr<int64_t>(), *jj = j.data_ptr<int64_t>(), *kk = k.data_ptr<int64_t>();
  const long n = dist.size(0), p = dist.size(1), rows = i.numel();
  in_parallel(parts, [&](int64_t q) {
    codes[q] = C<T>::lca_backward(g, d, n, p, ii, jj, kk, pu, ps, rows, bounds[q], bounds[q + 1]);
  });
  for (int c : codes)
    if (c) return c;
  return 0;
}

int64_t lca_backward_(Tensor grad, Tensor dist, Tensor i, Tensor j, Tensor k, Tensor u, Tensor scale,
                      at::IntArrayRef bounds) {
  TORCH_CHECK(dist.dim() == 2 && grad.sizes() == dist.sizes(), "_native_lca_backward_: grad and dist (N, P)");
  const bool f32 = single(dist);
  for (const Tensor* t : {&grad, &dist, &u, &scale}) expect(*t, dist, "grad, dist, u, scale");
  for (const Tensor* t : {&i, &j, &k}) expect_index(*t, "i, j, k");
  const int64_t rows = i.numel();
  TORCH_CHECK(j.numel() == rows && k.numel() == rows && scale.numel() == rows && u.numel() == 2 * rows * dist.size(1),
              "_native_lca_backward_: i, j, k, scale (T,), u (2, T, P) expected");
  return f32 ? lca_backward_t<float>(grad, dist, i, j, k, u, scale, bounds)
             : lca_backward_t<double>(grad, dist, i, j, k, u, scale, bounds);
}

int64_t vector_clones() { return pml_vector_clones(); }

// 1 when built with OpenMP: at::parallel_for (in_parallel) then shares the loops over torch's
// intra-op threads; without it at::parallel_for runs its whole range on the calling thread.
int64_t openmp_build() {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pml_hyperbolic, m) {
  m.def("_native_tail_(Tensor(a!) P, Tensor(b!)? S, Tensor q, float inv_sqrt_c, int[] bounds) -> ()");
  m.def("_native_log1p(Tensor u, Tensor(a!) out) -> ()");
  m.def("_native_sym_tail_(Tensor(a!) G, Tensor(b!)? S, Tensor x2, Tensor p2, Tensor q, float inv_sqrt_c, "
        "float close, int[] bounds) -> int");
  m.def("_native_gen_tail_(Tensor(a!) G, Tensor(b!)? S, Tensor x2, Tensor p2, Tensor y2, Tensor q, float inv_sqrt_c, "
        "float close, int[] bounds) -> int");
  m.def("_native_sym_grad_(Tensor U, Tensor(a!) S, int[] bounds) -> ()");
  m.def("_native_row_terms(Tensor x, float c, float floor, float extreme_inv_a, float tiny_sq, bool extras) "
        "-> (Tensor, Tensor, Tensor, int, int)");
  m.def("_native_uniform_rows_(int key, int first_row, Tensor(a!) out) -> ()");
  m.def("_native_lca_rows_(Tensor dist, Tensor i, Tensor j, Tensor k, float inv_tau, float margin, bool noise, "
        "int key, Tensor(a!) loss, Tensor(b!) a, Tensor(c!) b, Tensor(d!)? grads, Tensor(e!)? on, Tensor(f!) work, "
        "int[] bounds) -> int");
  m.def("_native_lca_backward_(Tensor(a!) grad, Tensor dist, Tensor i, Tensor j, Tensor k, Tensor u, Tensor scale, "
        "int[] bounds) -> int");
  m.def("_native_vector_clones() -> int");
  m.def("_native_openmp() -> int");
}

TORCH_LIBRARY_IMPL(pml_hyperbolic, CPU, m) {
  m.impl("_native_tail_", TORCH_FN(tail_));
  m.impl("_native_log1p", TORCH_FN(log1p_out));
  m.impl("_native_sym_tail_", TORCH_FN(sym_tail_));
  m.impl("_native_gen_tail_", TORCH_FN(gen_tail_));
  m.impl("_native_sym_grad_", TORCH_FN(sym_grad_));
  m.impl("_native_row_terms", TORCH_FN(row_terms));
  m.impl("_native_uniform_rows_", TORCH_FN(uniform_rows_));
  m.impl("_native_lca_rows_", TORCH_FN(lca_rows_));
  m.impl("_native_lca_backward_", TORCH_FN(lca_backward_));
}

TORCH_LIBRARY_IMPL(pml_hyperbolic, CompositeExplicitAutograd, m) {
  m.impl("_native_vector_clones", TORCH_FN(vector_clones));
  m.impl("_native_openmp", TORCH_FN(openmp_build));
}
