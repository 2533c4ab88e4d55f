// Mixture-of-experts feed-forward for CPUs: each expert that received tokens multiplies
// just their rows through its oneDNN-prepacked matrices (or its int8 ones, `cpu_int8.h`),
// whole experts spread over the threads.
//
// The step's (token, expert) slots are sorted by expert, stably. Each expert with slots is
// one task: gather its rows (zero-padded to min_rows, as `engine.layers.linear.project`
// pads), the gate/up product, SiLU(gate) * up rounded as the model's dtype rounds each,
// the down product, rows written to the slots' places in one buffer. A thread runs one
// expert at a time, the largest first, and oneDNN runs single-threaded inside the
// parallel region: two experts' products at a decode step's 16 rows each take 0.78 of the
// time side by side on one thread each that they take one after the other on two threads
// (bfloat16, Zen 4), and the ~10 small PyTorch calls per expert around them are gone.
//
// Then each token adds its slots' rows times their routing weights in float32, in expert
// order: its result depends on its own row and experts only, never on the rest of the step.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <vector>

#include "cpu_activation.h"
#include "cpu_int8.h"
#include "cpu_linear.h"
#include "cpu_vector.h"

namespace {

using namespace engine_cpu;

// A matrix quantized per output feature (`cpu_int8.h`): q [in, out] int8, scale [out]. Its
// int32 sums are exact, so it needs no padding to give a row the same bits in any batch.
struct Int8Matrix {
  at::Tensor q, scale;
  int64_t min_rows = 1;

  at::Tensor times(const at::Tensor& x) const { return int8_matmul(x, {q, scale, std::nullopt, {}}); }
  int64_t in() const { return q.size(0); }
  int64_t out() const { return q.size(1); }
};

// The slots (token t's j-th choice is slot t * top_k + j) grouped by expert: expert e's
// are order[start[e]:start[e + 1]], in slot order; slot s sits at position[s].
struct SlotsByExpert {
  std::vector<int64_t> start, order, position;

  SlotsByExpert(const int64_t* ids, int64_t slots, int64_t experts)
      : start(experts + 1, 0), order(slots), position(slots) {
    for (int64_t s = 0; s < slots; ++s) {
      TORCH_CHECK(ids[s] >= 0 && ids[s] < experts, "expert ids within [0, ", experts, "), got ", ids[s]);
      ++start[ids[s] + 1];
    }
    for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t s = 0; s < slots; ++s) {
      position[s] = next[ids[s]]++;
      order[position[s]] = s;
    }
  }

  int64_t count(int64_t e) const { return start[e + 1] - start[e]; }

  // The experts with slots, the largest first.
  std::vector<int64_t> busy() const {
    std::vector<int64_t> experts;
    for (int64_t e = 0; e + 1 < static_cast<int64_t>(start.size()); ++e)
      if (count(e) > 0) experts.push_back(e);
    std::stable_sort(experts.begin(), experts.end(), [&](int64_t a, int64_t b) { return count(a) > count(b); });
    return experts;
  }
};

// out[r] = SiLU(gate[r]) * up[r] for h[r] = [gate | up], each step rounded to scalar_t as
// PyTorch's F.silu(gate) * up rounds it (`cpu_activation.h`).
template <typename scalar_t>
void silu_and_mul(const scalar_t* h, int64_t rows, int64_t inter, scalar_t* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* gate = h + r * 2 * inter;
    act_row(gate, gate + inter, inter, /*gelu=*/false, out + r * inter);
  }
}

// Expert e's SwiGLU of the rows of its slots, written to ys at the slots' positions.
template <typename scalar_t, typename Matrix>
void run_expert(const at::Tensor& x, const SlotsByExpert& slots, int64_t e, int64_t top_k, const Matrix& w13,
                const Matrix& w2, scalar_t* ys) {
  const int64_t hidden = x.size(1), first = slots.start[e], n = slots.count(e), m = std::max(n, w13.min_rows);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  at::Tensor rows = at::empty({m, hidden}, x.options());
  scalar_t* rp = rows.data_ptr<scalar_t>();
  for (int64_t r = 0; r < n; ++r) std::copy_n(xp + slots.order[first + r] / top_k * hidden, hidden, rp + r * hidden);
  std::fill(rp + n * hidden, rp + m * hidden, scalar_t(0));
  const at::Tensor h = w13.times(rows);
  const int64_t inter = h.size(1) / 2;
  at::Tensor act = at::empty({m, inter}, x.options());
  silu_and_mul<scalar_t>(h.data_ptr<scalar_t>(), m, inter, act.data_ptr<scalar_t>());
  const at::Tensor y = w2.times(act);
  std::copy_n(y.data_ptr<scalar_t>(), n * hidden, ys + first * hidden);
}

// out[t] = sum over t's slots, in expert order, of weight * ys[slot's position], in float32.
template <typename scalar_t>
void combine(const scalar_t* ys, const SlotsByExpert& slots, const int64_t* ids, const float* weights, int64_t top_k,
             int64_t hidden, at::Tensor& out) {
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, out.size(0), 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(hidden);
    std::vector<int64_t> mine(top_k);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t j = 0; j < top_k; ++j) mine[j] = t * top_k + j;
      std::sort(mine.begin(), mine.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
      std::fill(acc.begin(), acc.end(), 0.f);
      for (const int64_t s : mine) {
        const scalar_t* y = ys + slots.position[s] * hidden;
        int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
        if constexpr (kVector8<scalar_t>) {
          const __m256 w = _mm256_set1_ps(weights[s]);
          for (; d + 8 <= hidden; d += 8)
            _mm256_storeu_ps(acc.data() + d, _mm256_fmadd_ps(w, load8(y + d), _mm256_loadu_ps(acc.data() + d)));
        }
#endif
        for (; d < hidden; ++d) acc[d] += weights[s] * static_cast<float>(y[d]);
      }
      for (int64_t d = 0; d < hidden; ++d) op[t * hidden + d] = static_cast<scalar_t>(acc[d]);
    }
  });
}

template <typename scalar_t, typename Matrix>
at::Tensor experts_forward(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                           const std::vector<Matrix>& w13, const std::vector<Matrix>& w2) {
  const int64_t hidden = x.size(1), top_k = ids.size(1), slots = ids.numel();
  const int64_t* idp = ids.data_ptr<int64_t>();
  const SlotsByExpert by_expert(idp, slots, static_cast<int64_t>(w13.size()));
  const std::vector<int64_t> busy = by_expert.busy();
  at::Tensor ys = at::empty({slots, hidden}, x.options());
  scalar_t* yp = ys.data_ptr<scalar_t>();
  const int threads = static_cast<int>(std::clamp<int64_t>(busy.size(), 1, at::get_num_threads()));
  std::exception_ptr failure;  // an exception must not leave the parallel region
#pragma omp parallel num_threads(threads)
  {
    c10::InferenceMode inference;  // per thread: the caller's mode does not reach OpenMP's workers
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < busy.size(); ++i) {
      try {
        run_expert<scalar_t>(x, by_expert, busy[i], top_k, w13[busy[i]], w2[busy[i]], yp);
      } catch (...) {
#pragma omp critical
        if (!failure) failure = std::current_exception();
      }
    }
  }
  if (failure) std::rethrow_exception(failure);
  at::Tensor out = at::empty_like(x);
  combine<scalar_t>(yp, by_expert, idp, weights.data_ptr<float>(), top_k, hidden, out);
  return out;
}

// The routed experts' output in x's dtype after checking the shapes: x [tokens, hidden];
// topk_weights [tokens, top_k] (any float dtype; summed in float32); topk_ids [tokens, top_k]
// int64; w13[e], w2[e] expert e's gate/up [hidden -> 2 * inter] and down [inter -> hidden].
template <typename Matrix>
at::Tensor experts(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                   const std::vector<Matrix>& w13, const std::vector<Matrix>& w2) {
  TORCH_CHECK(x.dim() == 2 && topk_ids.dim() == 2 && topk_ids.sizes() == topk_weights.sizes() &&
              topk_ids.size(0) == x.size(0), "x [tokens, hidden], topk_weights and topk_ids [tokens, top_k]");
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong, "int64 expert ids");
  TORCH_CHECK(!w13.empty() && w13.size() == w2.size(), "two matrices per expert");
  for (size_t e = 0; e < w13.size(); ++e)
    TORCH_CHECK(w13[e].in() == x.size(1) && w2[e].out() == x.size(1) && w13[e].out() == 2 * w2[e].in(), "expert ", e,
                ": gate/up [hidden -> 2 * inter] and down [inter -> hidden]");
  const at::Tensor ids = topk_ids.contiguous();
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_moe", [&] {
    out = experts_forward<scalar_t>(x.contiguous(), topk_weights.to(at::kFloat).contiguous(), ids, w13, w2);
  });
  return out;
}

}  // namespace

// w13[e] [2 * inter, hidden] and w2[e] [hidden, inter] prepacked for oneDNN; min_rows: products
// run on at least this many rows.
at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                     const std::vector<at::Tensor>& w13, const std::vector<at::Tensor>& w2, int64_t min_rows) {
  TORCH_CHECK(w13.size() == w2.size(), "two matrices per expert");
  std::vector<PackedMatrix> gate_up, down;
  for (size_t e = 0; e < w13.size(); ++e) {
    TORCH_CHECK(w13[e].dim() == 2 && w2[e].dim() == 2, "expert ", e, ": 2-D prepacked matrices");
    gate_up.push_back({w13[e], min_rows});
    down.push_back({w2[e], min_rows});
  }
  return experts(x, topk_weights, topk_ids, gate_up, down);
}

// The experts quantized per output feature (`engine.quantization.int8`): w13_q [E, hidden,
// 2 * inter] int8, w13_scale [E, 2 * inter], w2_q [E, inter, hidden], w2_scale [E, hidden].
at::Tensor fused_moe_int8(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                          const at::Tensor& w13_q, const at::Tensor& w13_scale, const at::Tensor& w2_q,
                          const at::Tensor& w2_scale) {
  TORCH_CHECK(w13_q.dim() == 3 && w2_q.dim() == 3 && w13_scale.dim() == 2 && w2_scale.dim() == 2 &&
              w13_q.size(0) == w2_q.size(0) && w13_scale.size(0) == w13_q.size(0) &&
              w2_scale.size(0) == w2_q.size(0), "w13_q [E, hidden, 2 * inter], w2_q [E, inter, hidden], "
              "scales [E, out]");
  std::vector<Int8Matrix> gate_up, down;
  for (int64_t e = 0; e < w13_q.size(0); ++e) {
    gate_up.push_back({w13_q[e].contiguous(), w13_scale[e].contiguous()});
    down.push_back({w2_q[e].contiguous(), w2_scale[e].contiguous()});
  }
  return experts(x, topk_weights, topk_ids, gate_up, down);
}
