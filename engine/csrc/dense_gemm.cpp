// fp32 and bf16 weights' GEMM of the rows that are not prompt tokens (decode rows, speculative verification rows):
// y[M, N] = x[M, K] @ W[N, K].T (+ bias), x, W, bias and y of one dtype, fp32 sums. engine/layers/linear/dense.py.
//
// torch's F.linear (oneDNN / MKL) picks its blocking, and with it each row's summation order, by the number of rows,
// so a verification step of k + 1 rows rounds unlike a one-row decode and greedy speculative output drifts after a
// near-tie. Here each output element is one accumulator of fp32 lanes over K in increasing order (dense_lanes.h),
// reduced in a fixed tree and rounded once (bias added before the rounding): its bits depend on its row of x and
// its row of W alone, not on M, on its place in the batch, on the register block, the tiling or the threads.
//
// Threads split N only: a task owns kCols output columns (W's rows; 16 x K bf16 stays in L1 for K up to 1536) and
// runs every row through them, kRows at a time, C columns a register block (as int8_gemm.cpp does).

#include <ATen/ATen.h>
#include <torch/library.h>

#include "dense_lanes.h"
#include "ops.h"
#include "tasks.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

namespace {

std::atomic<int64_t> g_runs{0};  // calls, for the tests (which path the layers take)

#if defined(CPUSERVE_DENSE_GEMM)
using namespace cpuserve_dense;
constexpr int64_t kCols = 16;  // output columns per task
constexpr int kRows = 4;       // activation rows per register block
#if defined(__AVX512F__)
constexpr int kColBlock = 4;   // columns per register block: 16 accumulators, 4 weights and a row of 32 registers
constexpr int64_t kPrefetch = 512;  // bytes ahead in each weight row (tasks interleave between threads)
#else
constexpr int kColBlock = 2;   // 8 accumulators, 2 weights and a row of 16 registers
constexpr int64_t kPrefetch = 256;
#endif

// The fp32 sum s of one element rounded into y, with the bias added first
template <typename T>
inline void store(T* y, float s, const T* bias, int64_t c) {
  *y = static_cast<T>(bias ? s + static_cast<float>(bias[c]) : s);  // BFloat16's constructor rounds to nearest even
}

// R rows of x (K apart) x C rows of W (K apart): out[r * ldo + c]
template <typename T, int R, int C>
void block(const T* x, const T* w, int64_t K, const T* bias, T* out, int64_t ldo) {
  using S = typename StepOf<T>::type;
  Acc acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = zero();
  int64_t k = 0;
  for (; k + S::kStep <= K; k += S::kStep) {
    typename S::In wv[C];
    for (int c = 0; c < C; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(w + c * K + k) + kPrefetch, _MM_HINT_T0);
      wv[c] = S::load(w + c * K + k);
    }
    for (int r = 0; r < R; ++r) {
      const typename S::In a = S::load(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = S::mac(a, wv[c], acc[r][c]);
    }
  }
  if (const int64_t rest = K - k; rest > 0) {
    typename S::In wv[C];
    for (int c = 0; c < C; ++c) wv[c] = S::load(w + c * K + k, rest);
    for (int r = 0; r < R; ++r) {
      const typename S::In a = S::load(x + r * K + k, rest);
      for (int c = 0; c < C; ++c) acc[r][c] = S::mac(a, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store(out + r * ldo + c, sum(acc[r][c]), bias, c);
}

// R rows through `cols` columns, kColBlock at a time, then one at a time
template <typename T, int R>
void rows(const T* x, const T* w, int64_t K, const T* bias, int64_t cols, T* out, int64_t ldo) {
  int64_t c = 0;
  for (; c + kColBlock <= cols; c += kColBlock)
    block<T, R, kColBlock>(x, w + c * K, K, bias ? bias + c : nullptr, out + c, ldo);
  for (; c < cols; ++c) block<T, R, 1>(x, w + c * K, K, bias ? bias + c : nullptr, out + c, ldo);
}

// Every row of x through `cols` columns, kRows rows per pass and the last ones in one
template <typename T>
void all_rows(const T* x, int64_t M, int64_t K, const T* w, const T* bias, int64_t cols, T* out, int64_t ldo) {
  static_assert(kRows == 4, "the switch below handles the last 1-3 rows");
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) rows<T, kRows>(x + m * K, w, K, bias, cols, out + m * ldo, ldo);
  switch (M - m) {
    case 3: rows<T, 3>(x + m * K, w, K, bias, cols, out + m * ldo, ldo); break;
    case 2: rows<T, 2>(x + m * K, w, K, bias, cols, out + m * ldo, ldo); break;
    case 1: rows<T, 1>(x + m * K, w, K, bias, cols, out + m * ldo, ldo); break;
  }
}

template <typename T>
void gemm(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), ldo = out.stride(0);
  const T* xd = x.data_ptr<T>();
  const T* wd = weight.data_ptr<T>();
  const T* bd = bias ? bias->data_ptr<T>() : nullptr;
  T* od = out.data_ptr<T>();
  cpuserve_tasks::share_tasks((N + kCols - 1) / kCols, [&](const auto& next) {
    for (int64_t nb; (nb = next()) >= 0;) {
      const int64_t n0 = nb * kCols;
      all_rows(xd, M, K, wd + n0 * K, bd ? bd + n0 : nullptr, std::min(kCols, N - n0), od + n0, ldo);
    }
  });
}
#endif

bool dense_gemm_supported() {
#if defined(CPUSERVE_DENSE_GEMM)
  return true;
#else
  return false;
#endif
}

std::string dense_gemm_isa() {
#if defined(CPUSERVE_DENSE_GEMM)
  return isa();
#else
  return "";
#endif
}

int64_t dense_gemm_runs() { return g_runs.load(); }

// out: [M, N] of x's dtype, rows contiguous (a slice of rows of a larger output, or a shared-memory slot)
at::Tensor& dense_gemm_out(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                           at::Tensor& out) {
  TORCH_CHECK(dense_gemm_supported(), "dense_gemm needs AVX2 or AVX-512 (it was built without them)");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dense_gemm: x must be float32 or bfloat16, got ", dtype);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "dense_gemm: x must be contiguous [M, K]");
  TORCH_CHECK(weight.scalar_type() == dtype && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.size(1) == x.size(1),
              "dense_gemm: weight must be contiguous [N, K] of x's dtype, got ", weight.scalar_type(), " ",
              weight.sizes(), " for x ", x.sizes());
  const int64_t M = x.size(0), N = weight.size(0);
  TORCH_CHECK(!bias || (bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == N),
              "dense_gemm: bias must be contiguous [N] of x's dtype");
  TORCH_CHECK(out.scalar_type() == dtype && out.dim() == 2 && out.size(0) == M && out.size(1) == N &&
                  out.stride(1) == 1 && (M <= 1 || out.stride(0) >= N),
              "dense_gemm: out must be [M, N] = [", M, ", ", N, "] of x's dtype with contiguous rows, got ",
              out.scalar_type(), " ", out.sizes(), " strides ", out.strides());
  g_runs.fetch_add(1, std::memory_order_relaxed);
#if defined(CPUSERVE_DENSE_GEMM)
  if (dtype == at::kFloat)
    gemm<float>(x, weight, bias, out);
  else
    gemm<bf16>(x, weight, bias, out);
#endif
  return out;
}

at::Tensor dense_gemm(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  auto out = at::empty({x.size(0), weight.size(0)}, x.options());
  dense_gemm_out(x, weight, bias, out);
  return out;
}

}  // namespace

at::Tensor& cpuserve_ops::dense_gemm_out(const at::Tensor& x, const at::Tensor& weight,
                                         const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  return ::dense_gemm_out(x, weight, bias, out);
}

TORCH_LIBRARY_FRAGMENT(cpuserve, m) {
  m.def("dense_gemm(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("dense_gemm.out(Tensor x, Tensor weight, Tensor? bias, *, Tensor(a!) out) -> Tensor(a!)");
  m.def("dense_gemm_supported() -> bool");
  m.def("dense_gemm_isa() -> str");
  m.def("dense_gemm_runs() -> int");
}

TORCH_LIBRARY_IMPL(cpuserve, CPU, m) {
  m.impl("dense_gemm", &dense_gemm);
  m.impl("dense_gemm.out", &dense_gemm_out);
}

TORCH_LIBRARY_IMPL(cpuserve, CompositeExplicitAutograd, m) {
  m.impl("dense_gemm_supported", &dense_gemm_supported);
  m.impl("dense_gemm_isa", &dense_gemm_isa);
  m.impl("dense_gemm_runs", &dense_gemm_runs);
}
