// The int8 dot-product GEMM op: int4 / int6 / int8 weights x dynamic int8 activations, with out=. Its parts:
//
//   act_quant.h              x's rows into int8 codes, scales and code sums (each row on its own)
//   int8_gemm_checks.cpp     the operands' checks (amx_bf16_gemm.cpp's too)
//   vnni_layouts.h           the packed codes and scales as they lie in memory, and how a register block loads them
//   int8_gemm_operands.h     one GEMM's operands (both builds)
//   vnni_register_blocks.h   R rows x C column blocks in registers: vpdpbusd's integer sums, a group at a time
//   vnni_epilogue.h          a group's integer sums into the rows' fp32 sums and bf16 out (the formulas)
//   vnni_amx_rows.h          16 rows on AMX tiles, into the same epilogue (amx_tiles.h: the tiles)
//   vnni_amx_mode.cpp        whether the tiles run: the instructions, their software model (tests) or off
//   vnni_column_tiles.h      beyond decode, runs of column tiles shared between threads
//   avx2_gemm.h              the AVX2 levels' register blocks (the same bits)
//   this file                the decode / prompt dispatch, the op and its registration
//
// Packing happens once at load (engine/layers/linear/act_int8.py, with the plain-torch reference). Integer sums
// are exact and each output element's epilogue runs in the same order (groups in k order) whatever the register
// block, task or thread that computes it: a row's result depends neither on the batch, the tiling nor the threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "act_quant.h"
#include "avx2_gemm.h"
#include "int8_gemm_operands.h"
#include "ops.h"
#include "tasks.h"
#include "vnni_column_tiles.h"
#include "vnni_layouts.h"
#include "vnni_register_blocks.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

// The int8 GEMMs are built: on AVX-512 VNNI (vnni_register_blocks.h) or on AVX2 (avx2_gemm.h)
#if defined(CPUSERVE_VNNI) || defined(CPUSERVE_AVX2_GEMM)
#define CPUSERVE_INT8_GEMM 1
#endif

namespace {

using bf16 = at::BFloat16;
using cpuserve_int8::GemmOperands;

std::atomic<int64_t> g_runs{0};  // calls of vnni_gemm_out, for the tests (which kernels the layers use)

bool vnni_gemm_supported() {
#if defined(CPUSERVE_INT8_GEMM)
  return true;
#else
  return false;
#endif
}

#if defined(CPUSERVE_VNNI)
using cpuserve_vnni::StoredScales;
using cpuserve_vnni::SuperScales;

// Up to kFewRows rows (decode) a task is a run of column blocks in register blocks of kFewRowsBlock rows x 1 block:
// one sequential stream of weights per thread, each loaded once for 8 rows. One thread, CPU time, SmolLM2's 30
// layers of int4 weights, against 4 rows x 2 blocks: 1.14-1.4x at 1-8 rows, 1.04-1.08x at 12-16, none at 32.
constexpr int64_t kFewRows = 16;
constexpr int kFewRowsBlock = 8;
// Decode tasks per thread: each a run of adjacent column blocks, so a thread streams long sequential runs of weights
// and takes the shared counter (a cache line the threads pass back and forth) a few times per GEMM, not once per
// 16 columns
constexpr int64_t kDecodeTasksPerThread = 4;
// Decode's column blocks b..end-1 of one GEMM of M <= kFewRows rows: their weights read once for up to 8 rows. Every
// width goes one column block a register block: two blocks at a time (two streams, two chains of 6-bit unpacking) ran
// Q6_K at one row 22-24 GB/s against 35-41 for one at a time once decode prefetched far enough (kDecodePrefetch).
template <int Bits, typename Scales>
void decode_blocks(const GemmOperands<Scales>& gemm, int64_t M, int64_t b, int64_t end) {
  using cpuserve_vnni::all_rows_fixed, cpuserve_vnni::kDecodePrefetch;
  for (; b < end; ++b) all_rows_fixed<Bits, kFewRowsBlock, 1>(gemm, M, b, kDecodePrefetch);
}

// GEMMs of one layout (the same N, K and scales' form), gemms[i] of rows[i] rows: those of up to kFewRows rows in one
// parallel region, a task a run of column blocks of one of them (a mixture of experts' decode: its 8 narrow GEMMs a
// projection as 8 x 1 tasks on 2 threads where one region each left 1 or 2 tasks a thread, a barrier each), each
// larger one as runs of column tiles shared between threads. A single GEMM gets the tasks it got alone.
template <int Bits, typename Scales>
void run_gemms(const std::vector<GemmOperands<Scales>>& gemms, const std::vector<int64_t>& rows) {
  std::vector<size_t> few;
  for (size_t i = 0; i < gemms.size(); ++i)
    if (rows[i] <= kFewRows) few.push_back(i);
  if (!few.empty()) {
    const int64_t num_blocks = gemms[0].N / 16;
    const int64_t run = std::min(num_blocks, cpuserve_tasks::run_length(num_blocks * static_cast<int64_t>(few.size()),
                                                                        kDecodeTasksPerThread));
    const int64_t per_gemm = (num_blocks + run - 1) / run;
    cpuserve_tasks::share_tasks(per_gemm * static_cast<int64_t>(few.size()), [&](const auto& next) {
      for (int64_t t; (t = next()) >= 0;) {
        const size_t i = few[t / per_gemm];
        const int64_t b = t % per_gemm * run;
        decode_blocks<Bits>(gemms[i], rows[i], b, std::min(num_blocks, b + run));
      }
    });
  }
  for (size_t i = 0; i < gemms.size(); ++i)
    if (rows[i] > kFewRows) cpuserve_vnni::tile_runs<Bits>(gemms[i], rows[i]);
}
#endif

#if defined(CPUSERVE_AVX2_GEMM)  // the same entry below, over avx2_gemm.h's register blocks
using cpuserve_avx2::StoredScales;
using cpuserve_avx2::SuperScales;

template <int Bits, typename Scales>
void run_gemms(const std::vector<GemmOperands<Scales>>& gemms, const std::vector<int64_t>& rows) {
  for (size_t i = 0; i < gemms.size(); ++i) cpuserve_avx2::Gemm<Bits, Scales>{gemms[i]}.run(rows[i]);
}
#endif

// One row run of a GEMM over several weights of one layout: rows [row, row + rows) of x through the weights whose
// tensors start at these bytes (a stack's expert e: each tensor's e-th slice), into the same rows of out
struct RowRun {
  const void *packed, *scales, *zoffs, *supers;
  int64_t row, rows;
};

// x [M, K] bf16 through each run's weights into out [M, N]; packed, scales, zoffs, supers: the layout every run's
// weights share (check_gemm_operands' shapes and types); each x row is quantized once whatever the runs
at::Tensor& gemm_runs(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zoffs,
                      int64_t bits, int64_t act_group, const c10::optional<at::Tensor>& supers,
                      const std::vector<RowRun>& runs, at::Tensor& out) {
  TORCH_CHECK(vnni_gemm_supported(), "the int8 dot-product GEMMs need AVX-512 VNNI or AVX2 (this build has neither)");
  cpuserve_ops::check_gemm_operands(x, packed, scales, zoffs, bits, act_group, supers, out);
  g_runs.fetch_add(static_cast<int64_t>(runs.size()), std::memory_order_relaxed);
#if defined(CPUSERVE_INT8_GEMM)
  const int64_t N = packed.size(0) * 16, K = packed.size(1) * 32 / bits, M = x.size(0);
  const int64_t num_weight_groups = scales.size(1), act_groups = K / act_group;
  const int64_t sum_groups = std::max(act_groups, num_weight_groups);  // the zero terms' groups (int8_gemm_operands.h)
  auto act_codes = at::empty({M, K}, x.options().dtype(at::kChar));
  // act_scales [M, act_groups]; act_sums, code_sums [M, sum_groups]; act_row_sum [M]; code_sums16 [M, sum_groups] int16
  const int64_t num_terms = M * (act_groups + 2 * sum_groups + 1) + (M * sum_groups + 1) / 2;
  auto terms = at::empty({num_terms}, x.options().dtype(at::kFloat));
  float *act_scales = terms.data_ptr<float>(), *act_sums = act_scales + M * act_groups;
  float* act_row_sum = act_sums + 2 * M * sum_groups;
  int32_t* code_sums = reinterpret_cast<int32_t*>(act_sums + M * sum_groups);
  int16_t* code_sums16 = reinterpret_cast<int16_t*>(act_row_sum + M);
  cpuserve_act::quantize_rows(x.data_ptr<bf16>(), M, K, act_group, K / sum_groups, act_codes.data_ptr<int8_t>(),
                              act_scales, act_sums, code_sums, code_sums16, act_row_sum);
  const bool symmetric = zoffs.scalar_type() == at::kInt;  // each run's zoffs then its {z, e}
  // form(run): the run's scales in the form of this layout
  const auto run_widths = [&](auto form) {  // the codes' width, with the scales' form
    using Scales = decltype(form(runs[0]));
    std::vector<GemmOperands<Scales>> gemms;
    std::vector<int64_t> rows;
    for (const RowRun& r : runs) {
      const int32_t* header = static_cast<const int32_t*>(r.zoffs);
      const GemmOperands<Scales> all{act_codes.data_ptr<int8_t>(), act_scales, act_sums, code_sums, code_sums16,
                                     act_row_sum, static_cast<const uint8_t*>(r.packed), 0, form(r),
                                     symmetric ? header[0] : 0, symmetric ? std::ldexp(1.f, -header[1]) : 1.f, K,
                                     act_group, num_weight_groups, N, out.data_ptr<bf16>(), out.stride(0)};
      gemms.push_back(all.rows_from(r.row));
      rows.push_back(r.rows);
    }
    if (bits == 4) return run_gemms<4>(gemms, rows);
    if (bits == 6) return run_gemms<6>(gemms, rows);
    if constexpr (!Scales::kFactored) run_gemms<8>(gemms, rows);
  };
  if (supers.has_value()) {
    const int64_t shift = __builtin_ctzll(num_weight_groups / supers->size(1)), per_super = supers->size(2);
    cpuserve_int8::with_super_scales<SuperScales>(scales.scalar_type() == at::kByte, symmetric, [&](auto form) {
      using Factored = decltype(form);
      run_widths([&](const RowRun& r) {
        return Factored{static_cast<decltype(Factored::sub)>(r.scales),
                        symmetric ? nullptr : static_cast<const uint8_t*>(r.zoffs),
                        static_cast<const at::Half*>(r.supers), num_weight_groups, shift, per_super};
      });
    });
  } else {
    const auto stored = [&](auto scale) {  // scale: the scales' type
      using T = decltype(scale);
      run_widths([&](const RowRun& r) {
        return StoredScales<T>{static_cast<const T*>(r.scales), symmetric ? nullptr : static_cast<const T*>(r.zoffs),
                               num_weight_groups, 0};
      });
    };
    if (scales.scalar_type() == at::kHalf) {
      stored(at::Half{});
    } else {
      stored(float{});
    }
  }
#endif
  return out;
}

at::Tensor& vnni_gemm_out(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                          const at::Tensor& zoffs, int64_t bits, int64_t act_group,
                          const c10::optional<at::Tensor>& supers, at::Tensor& out) {
  const RowRun all{packed.data_ptr(), scales.data_ptr(), zoffs.data_ptr(),
                   supers.has_value() ? supers->data_ptr() : nullptr, 0, x.size(0)};
  return gemm_runs(x, packed, scales, zoffs, bits, act_group, supers, {all}, out);
}

// x [M, K] bf16: each run's rows through its expert's weights of the stack w (tensors [E, ...], expert e at index e),
// into the same rows of out [M, N]
at::Tensor& vnni_gemm_experts_out(const at::Tensor& x, const cpuserve_ops::ExpertWeights& w,
                                  const std::vector<cpuserve_ops::ExpertRows>& runs, at::Tensor& out) {
  const int64_t E = w.packed.size(0);
  for (const at::Tensor* t : {&w.packed, &w.scales, &w.zoffs})
    TORCH_CHECK(t->dim() >= 2 && t->size(0) == E && t->is_contiguous(), "expert weights: every tensor must be "
                "contiguous [E=", E, ", ...], got ", t->sizes());
  TORCH_CHECK(!w.supers.has_value() || (w.supers->size(0) == E && w.supers->is_contiguous()),
              "expert weights: supers must be contiguous [E, ...]");
  const auto slice = [&](const at::Tensor& t, int64_t e) {
    return static_cast<const char*>(t.data_ptr()) + e * t.stride(0) * t.element_size();
  };
  const bool symmetric = w.zoffs.scalar_type() == at::kInt;  // each expert's zoffs its own {z, e}
  std::vector<RowRun> rows;
  for (const auto& r : runs) {
    const int32_t* header = symmetric ? w.zoffs.data_ptr<int32_t>() + r.expert * w.zoffs.stride(0) : nullptr;
    TORCH_CHECK(!symmetric || (w.zoffs.size(-1) == 2 && header[0] >= 0 && header[0] < (1 << w.bits) &&
                               header[1] >= 0 && header[1] < (w.supers.has_value() ? 1 : 64)),
                "expert ", r.expert, ": zoffs must be {z, e} as check_scales takes them");
    TORCH_CHECK(r.expert >= 0 && r.expert < E && r.start >= 0 && r.count > 0 && r.start + r.count <= x.size(0),
                "expert run (", r.expert, ", rows ", r.start, " + ", r.count, ") out of range");
    rows.push_back({slice(w.packed, r.expert), slice(w.scales, r.expert), slice(w.zoffs, r.expert),
                    w.supers.has_value() ? slice(*w.supers, r.expert) : nullptr, r.start, r.count});
  }
  const auto sup = w.supers.has_value() ? c10::optional<at::Tensor>(w.supers->select(0, 0)) : c10::nullopt;
  return gemm_runs(x, w.packed.select(0, 0), w.scales.select(0, 0), w.zoffs.select(0, 0), w.bits, w.act_group, sup,
                   rows, out);
}

at::Tensor vnni_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zoffs,
                     int64_t bits, int64_t act_group, const c10::optional<at::Tensor>& supers) {
  auto out = at::empty({x.size(0), packed.size(0) * 16}, x.options());
  return vnni_gemm_out(x, packed, scales, zoffs, bits, act_group, supers, out);
}

int64_t vnni_gemm_runs() { return g_runs.load(); }

// The instructions this build's int8 GEMMs run on: "avx512_vnni" (and AMX tiles, vnni_amx_mode.cpp), "avx_vnni" or
// "avx2" (avx2_gemm.h), or "" where they are not built
std::string vnni_gemm_isa() {
#if defined(CPUSERVE_VNNI)
  return "avx512_vnni";
#elif defined(CPUSERVE_AVX2_GEMM) && defined(__AVXVNNI__)
  return "avx_vnni";
#elif defined(CPUSERVE_AVX2_GEMM)
  return "avx2";
#else
  return "";
#endif
}

}  // namespace

at::Tensor& cpuserve_ops::vnni_gemm_experts_out(const at::Tensor& x, const ExpertWeights& w,
                                                const std::vector<ExpertRows>& runs, at::Tensor& out) {
  return ::vnni_gemm_experts_out(x, w, runs, out);
}

at::Tensor& cpuserve_ops::vnni_gemm_out(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                                        const at::Tensor& zoffs, int64_t bits, int64_t act_group,
                                        const c10::optional<at::Tensor>& supers, at::Tensor& out) {
  return ::vnni_gemm_out(x, packed, scales, zoffs, bits, act_group, supers, out);
}

TORCH_LIBRARY_FRAGMENT(cpuserve, m) {
  m.def("vnni_gemm(Tensor x, Tensor packed, Tensor scales, Tensor zoffs, int bits, int act_group, "
        "Tensor? supers=None) -> Tensor");
  m.def("vnni_gemm.out(Tensor x, Tensor packed, Tensor scales, Tensor zoffs, int bits, int act_group, "
        "Tensor? supers=None, *, Tensor(a!) out) -> Tensor(a!)");
  m.def("vnni_gemm_supported() -> bool");
  m.def("vnni_gemm_runs() -> int");
  m.def("vnni_gemm_isa() -> str");
}

TORCH_LIBRARY_IMPL(cpuserve, CPU, m) {
  m.impl("vnni_gemm", &vnni_gemm);
  m.impl("vnni_gemm.out", &vnni_gemm_out);
}

TORCH_LIBRARY_IMPL(cpuserve, CompositeExplicitAutograd, m) {
  m.impl("vnni_gemm_supported", &vnni_gemm_supported);
  m.impl("vnni_gemm_runs", &vnni_gemm_runs);
  m.impl("vnni_gemm_isa", &vnni_gemm_isa);
}
