// Products on matrices prepacked for oneDNN, shared by the experts (`cpu_fused_moe.cpp`) and the
// decoder stack (`cpu_decoder.cpp`).
#pragma once

#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>

namespace engine_cpu {

// A matrix prepacked by torch.ops.mkldnn._reorder_linear_weight ([out, in]) and its bias [out]
// (undefined: none). Products on fewer than min_rows rows are padded to that many, as
// `engine.layers.linear.project` pads, so that a row's bits do not depend on its batch.
struct PackedMatrix {
  at::Tensor packed;
  int64_t min_rows;
  at::Tensor bias;

  // x [rows, in] times the matrix (+ bias), rows at least min_rows.
  at::Tensor times(const at::Tensor& x) const {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                                 const std::optional<at::Tensor>&, c10::string_view,
                                                 c10::List<std::optional<at::Scalar>>,
                                                 std::optional<c10::string_view>)>();
    const std::optional<at::Tensor> b = bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt;
    return op.call(x, packed, b, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
  }
  // x [rows, in] times the matrix (+ bias), any number of rows: as `project`, zero rows
  // appended up to min_rows and their results dropped.
  at::Tensor project(const at::Tensor& x) const {
    const int64_t rows = x.size(0);
    if (rows >= min_rows) return times(x);
    return times(at::constant_pad_nd(x, {0, 0, 0, min_rows - rows})).slice(0, 0, rows);
  }
  int64_t in() const { return packed.size(1); }
  int64_t out() const { return packed.size(0); }
};

}  // namespace engine_cpu
