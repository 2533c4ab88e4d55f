// A Llama-style model's decoder layers in one call on a CPU: each layer's RMSNorm (its residual
// add fused in), the fused q/k/v projection, rotary, cache writes and paged attention
// (`rotary_cache_attention`), the output projection, the second norm, and the gated MLP, with
// the same kernels the layers call one by one from Python, in the same order: the same bits.
//
// Why: on a CPU every kernel runs as it is called, so the interpreter's work between them adds
// to a step, and it is slow there: each product streams megabytes of weights through the
// caches, and the Python that follows (modules' calls, attribute lookups, the dispatcher) finds
// its code and data evicted. A 32-row decode step of the embedded model on a Zen 3 spent 10-15
// of its ~150 ms between the kernels; this loop leaves a few calls' worth.

#include <torch/extension.h>

#include <chrono>
#include <optional>
#include <vector>

#include "cpu_int8.h"
#include "cpu_kernels.h"
#include "cpu_linear.h"

namespace engine_cpu {

// A projection as `engine.model_loader.cpu_decoder_stack` hands it: [packed, bias] for a oneDNN-prepacked
// weight (`engine.layers.linear.project`), or int8's seven parts (`int8_weight`).
class Projection {
 public:
  Projection(const std::vector<std::optional<at::Tensor>>& parts, int64_t min_rows) {
    if (parts.size() == 7) {
      int8_ = int8_weight(parts);
      return;
    }
    TORCH_CHECK(parts.size() == 2 && parts[0], "a projection as [packed, bias] or int8's seven parts");
    packed_ = PackedMatrix{*parts[0], min_rows, parts[1].value_or(at::Tensor())};
  }

  at::Tensor operator()(const at::Tensor& x) const { return int8_ ? int8_matmul(x, *int8_) : packed_->project(x); }

  const std::optional<Int8Weight>& int8() const { return int8_; }

 private:
  std::optional<PackedMatrix> packed_;
  std::optional<Int8Weight> int8_;
};

// One layer's weights, attention settings and caches.
struct DecoderLayer {
  at::Tensor input_norm, post_norm;
  double input_eps, post_eps;
  Projection qkv, o, gate_up, down;
  int64_t heads, kv_heads;
  at::Tensor cos, sin, sinks;  // sinks: empty for none
  double scale, softcap;       // softcap: 0 for none
  int64_t sliding_window, chunk_size;  // 0 for none
  bool gelu;
  at::Tensor k_cache, v_cache, k_scale, v_scale;  // scales: empty unless the cache is int8

  // The gated MLP: int8's fused kernel where both projections are int8 (as `LlamaMLP.fused`).
  at::Tensor mlp(const at::Tensor& x) const {
    if (gate_up.int8() && down.int8()) return int8_gated_mlp(x, *gate_up.int8(), *down.int8(), gelu);
    return down(act_and_mul(gate_up(x), gelu));
  }
};

// Seconds of a forward's parts added into `seconds` [3] float64 where it is defined (a step
// breakdown's), else untimed: the products (the gated MLP whole, its activation with them, as
// the breakdown counts a `LlamaMLP`), the attention blocks, and the norms.
class PartClock {
 public:
  enum Part { kProducts = 0, kAttention = 1, kNorms = 2 };

  explicit PartClock(const std::optional<at::Tensor>& seconds)
      : seconds_(seconds && seconds->defined() ? seconds->data_ptr<double>() : nullptr) {}

  template <typename F>
  auto operator()(Part part, const F& fn) const {
    if (seconds_ == nullptr) return fn();
    const auto start = std::chrono::steady_clock::now();
    auto result = fn();
    seconds_[part] += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return result;
  }

 private:
  double* seconds_;
};

class DecoderStack {
 public:
  DecoderStack(at::Tensor final_norm, double final_eps) : final_norm_(std::move(final_norm)), final_eps_(final_eps) {}

  void add_layer(at::Tensor input_norm, double input_eps, at::Tensor post_norm, double post_eps,
                 const std::vector<std::optional<at::Tensor>>& qkv, const std::vector<std::optional<at::Tensor>>& o,
                 const std::vector<std::optional<at::Tensor>>& gate_up,
                 const std::vector<std::optional<at::Tensor>>& down, int64_t min_rows, int64_t heads,
                 int64_t kv_heads, at::Tensor cos, at::Tensor sin, at::Tensor sinks, double scale, double softcap,
                 int64_t sliding_window, int64_t chunk_size, bool gelu, at::Tensor k_cache, at::Tensor v_cache,
                 at::Tensor k_scale, at::Tensor v_scale) {
    layers_.push_back({std::move(input_norm), std::move(post_norm), input_eps, post_eps,
                       Projection(qkv, min_rows), Projection(o, min_rows), Projection(gate_up, min_rows),
                       Projection(down, min_rows), heads, kv_heads, std::move(cos), std::move(sin),
                       std::move(sinks), scale, softcap, sliding_window, chunk_size, gelu, std::move(k_cache),
                       std::move(v_cache), std::move(k_scale), std::move(v_scale)});
  }

  // The final hidden states [rows, hidden] of `hidden` [rows, hidden] (the embeddings) through
  // every layer and the final norm, as `LlamaModel.forward` computes them; with `kept_rows` the
  // last layer's attention output, MLP and final norm of those rows alone. The attention
  // arguments are `rotary_cache_attention`'s.
  at::Tensor forward(const at::Tensor& hidden, const at::Tensor& positions, const at::Tensor& slots,
                     const at::Tensor& block_tables, const at::Tensor& row_seq, const at::Tensor& row_keys,
                     int64_t block_size, const std::optional<at::Tensor>& kept_rows,
                     const std::optional<at::Tensor>& seconds) {
    TORCH_CHECK(!layers_.empty(), "a decoder stack without layers");
    const PartClock clock(seconds);
    at::Tensor x = hidden, residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      DecoderLayer& layer = layers_[i];
      const bool keep = kept_rows && i + 1 == layers_.size();
      at::Tensor normed;
      if (residual.defined()) {
        const auto out = clock(PartClock::kNorms, [&] { return rms_norm(x, layer.input_norm, layer.input_eps, residual); });
        normed = out[0], residual = out[1];
      } else {  // the first layer: the stream starts as the embeddings in float32, a copy of its own
        normed = clock(PartClock::kNorms, [&] { return rms_norm(x, layer.input_norm, layer.input_eps, std::nullopt); })[0];
        residual = x.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
      }
      if (keep) residual = residual.index_select(0, *kept_rows);
      const at::Tensor qkv = clock(PartClock::kProducts, [&] { return layer.qkv(normed); });
      at::Tensor attention = clock(PartClock::kAttention, [&] {
        return rotary_cache_attention(qkv, layer.heads, layer.kv_heads, positions, layer.cos, layer.sin,
                                      layer.k_cache, layer.v_cache, layer.k_scale, layer.v_scale, slots, block_tables,
                                      row_seq, row_keys, layer.sinks, block_size, layer.scale, layer.sliding_window,
                                      layer.chunk_size, layer.softcap);
      });
      if (keep) attention = attention.index_select(0, *kept_rows);
      x = clock(PartClock::kProducts, [&] { return layer.o(attention); });
      const auto out = clock(PartClock::kNorms, [&] { return rms_norm(x, layer.post_norm, layer.post_eps, residual); });
      residual = out[1];
      x = clock(PartClock::kProducts, [&] { return layer.mlp(out[0]); });
    }
    return clock(PartClock::kNorms, [&] { return rms_norm(x, final_norm_, final_eps_, residual); })[0];
  }

 private:
  at::Tensor final_norm_;
  double final_eps_;
  std::vector<DecoderLayer> layers_;
};

}  // namespace engine_cpu

// The Python class (`engine.kernels.cpu_decoder`): built once per model and KV cache, then called
// once a step, without the interpreter's lock.
void bind_decoder_stack(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<engine_cpu::DecoderStack>(m, "DecoderStack", "A Llama-style model's decoder layers in one call (CPU)")
      .def(py::init<at::Tensor, double>(), py::arg("final_norm"), py::arg("final_eps"))
      .def("add_layer", &engine_cpu::DecoderStack::add_layer, py::arg("input_norm"), py::arg("input_eps"),
           py::arg("post_norm"), py::arg("post_eps"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"),
           py::arg("down"), py::arg("min_rows"), py::arg("heads"), py::arg("kv_heads"), py::arg("cos"),
           py::arg("sin"), py::arg("sinks"), py::arg("scale"), py::arg("softcap"), py::arg("sliding_window"),
           py::arg("chunk_size"), py::arg("gelu"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"),
           py::arg("v_scale"))
      .def("forward", &engine_cpu::DecoderStack::forward, py::arg("hidden"), py::arg("positions"), py::arg("slots"),
           py::arg("block_tables"), py::arg("row_seq"), py::arg("row_keys"), py::arg("block_size"),
           py::arg("kept_rows"), py::arg("seconds"), py::call_guard<py::gil_scoped_release>());
}
