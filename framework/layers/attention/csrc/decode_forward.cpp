// A plain Llama model's forward over a few tokens a request, in one call.
//
// A small model's decode forward on a CPU is mostly the cost of calling its kernels from
// Python: some fifty operator calls a forward at a few microseconds each, around kernels
// that take a hundred microseconds in all for a two-layer 128-wide model. A draft model
// of speculative decoding pays that K times a step. llama_decode makes the same kernel
// calls, in the same order with the same arguments, from C++ (through the dispatcher,
// under a microsecond each): the norms, linear_rows, rotary, write_kv, paged_attention and
// silu_and_mul of this library, and torch's embedding and index_select, which copy. Its
// logits are therefore those of the module tree bit for bit (the draft's decode plan,
// framework/speculative/draft_decode.py, and its tests).
//
// The tokens: request i feeds lengths[i] tokens at positions starts[i]... of its request
// row rows[i] (whose slots there it holds); every token attends as a decode token of its
// own, after all of them are written, and only each request's last token goes through
// the last layer's attention output and MLP, and the LM head. Every product runs in
// linear_rows: the caller sends only steps whose products fit it.
//
// Registered as torch.ops.framework_cpu.llama_decode.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/ones.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace {

using Tensor = at::Tensor;

template <typename Signature>
c10::TypedOperatorHandle<Signature> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// This library's kernels, found once.
struct Kernels {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double)> rms_norm =
      find<Tensor(const Tensor&, const Tensor&, double)>("framework_cpu::rms_norm");
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&,
                                                      const Tensor&, double)>
      add_rms_norm = find<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&,
                                                     const Tensor&, double)>(
          "framework_cpu::add_rms_norm");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&,
                                  std::optional<bool>)>
      linear_rows = find<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&,
                         std::optional<bool>)>("framework_cpu::linear_rows");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t)>
      rotary = find<Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t)>(
          "framework_cpu::rotary");
  c10::TypedOperatorHandle<void(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&)>
      write_kv = find<void(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&)>(
          "framework_cpu::write_kv");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  const Tensor&, const Tensor&, const Tensor&, double, int64_t,
                                  double, const std::optional<Tensor>&,
                                  const std::optional<Tensor>&)>
      paged_attention =
          find<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                      const Tensor&, const Tensor&, double, int64_t, double,
                      const std::optional<Tensor>&, const std::optional<Tensor>&)>(
              "framework_cpu::paged_attention");
  c10::TypedOperatorHandle<Tensor(const Tensor&)> silu_and_mul =
      find<Tensor(const Tensor&)>("framework_cpu::silu_and_mul");
};

const Kernels& kernels() {
  static const Kernels found;
  return found;
}

// Each layer's tensors in `layers`, in this order.
enum LayerTensor : int64_t { kInputNorm, kQkv, kO, kPostNorm, kGateUp, kDown, kPerLayer };

// Where each fed token sits: its request row, position and KV slot; and each request's
// last token's index among them.
struct Places {
  Tensor rows, positions, slots, seq_lens, last;
};

Places places(const Tensor& rows, const Tensor& starts, const Tensor& lengths,
              const Tensor& req_to_token, int64_t count) {
  const auto options = rows.options();
  Places p{at::empty({count}, options), at::empty({count}, options),
           at::empty({count}, options), at::empty({count}, options),
           at::empty({rows.numel()}, options)};
  const int64_t* row = rows.const_data_ptr<int64_t>();
  const int64_t* start = starts.const_data_ptr<int64_t>();
  const int64_t* length = lengths.const_data_ptr<int64_t>();
  const int64_t* table = req_to_token.const_data_ptr<int64_t>();
  const int64_t context = req_to_token.size(1);
  int64_t *tr = p.rows.mutable_data_ptr<int64_t>(), *tp = p.positions.mutable_data_ptr<int64_t>();
  int64_t *ts = p.slots.mutable_data_ptr<int64_t>(), *tl = p.seq_lens.mutable_data_ptr<int64_t>();
  int64_t* last = p.last.mutable_data_ptr<int64_t>();
  int64_t t = 0;
  for (int64_t i = 0; i < rows.numel(); ++i) {
    TORCH_CHECK(length[i] >= 1 && start[i] >= 0 && start[i] + length[i] <= context,
                "llama_decode: request ", i, " feeds ", length[i], " tokens at ", start[i],
                " of a context of ", context);
    for (int64_t j = 0; j < length[i]; ++j, ++t) {
      TORCH_CHECK(t < count, "llama_decode: the lengths add up to more than the tokens");
      tr[t] = row[i];
      tp[t] = start[i] + j;
      ts[t] = table[row[i] * context + tp[t]];
      tl[t] = tp[t] + 1;
    }
    last[i] = t - 1;
  }
  TORCH_CHECK(t == count, "llama_decode: the lengths add up to ", t, ", not ", count);
  return p;
}

// tokens [n]: the fed tokens, request after request; rows, starts, lengths [requests]:
// each request's row, its first fed position and how many it feeds (all int64);
// req_to_token [rows, context]; embedding [vocab, hidden]; cos, sin [positions, head_dim / 2]
// in the model's dtype; layers: kPerLayer tensors a layer (LayerTensor); kv: each layer's
// K and V buffers, written; eps: the input and post-attention norms' a layer; sizes:
// (q features, kv features, head_dim, query heads); scaling: the attention's.
// Returns the logits [requests, head rows] at each request's last token, in the model's
// dtype.
Tensor llama_decode(const Tensor& tokens, const Tensor& rows, const Tensor& starts,
                    const Tensor& lengths, const Tensor& req_to_token, const Tensor& embedding,
                    const Tensor& cos, const Tensor& sin, at::TensorList layers,
                    at::TensorList kv, at::ArrayRef<double> eps, at::IntArrayRef sizes,
                    double scaling, const Tensor& final_norm, double final_eps,
                    const Tensor& head) {
  for (const Tensor* t : {&tokens, &rows, &starts, &lengths, &req_to_token})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "llama_decode: contiguous int64 indices only");
  const int64_t layer_count = static_cast<int64_t>(layers.size()) / kPerLayer;
  TORCH_CHECK(layer_count >= 1 && static_cast<int64_t>(layers.size()) == layer_count * kPerLayer &&
                  static_cast<int64_t>(kv.size()) == 2 * layer_count &&
                  static_cast<int64_t>(eps.size()) == 2 * layer_count && sizes.size() == 4,
              "llama_decode: ", kPerLayer, " tensors, 2 KV buffers and 2 eps a layer, 4 sizes");
  const Kernels& k = kernels();
  const int64_t count = tokens.numel(), requests = rows.numel();
  const int64_t q_size = sizes[0], kv_size = sizes[1], head_dim = sizes[2], heads = sizes[3];
  const Places p = places(rows, starts, lengths, req_to_token, count);
  const Tensor ones = at::ones({count}, rows.options());
  const Tensor cos_rows = cos.index_select(0, p.positions);
  const Tensor sin_rows = sin.index_select(0, p.positions);
  const bool all_last = count == requests;
  Tensor hidden = at::embedding(embedding, tokens);
  Tensor residual;
  Tensor normed;
  for (int64_t layer = 0; layer < layer_count; ++layer) {
    const Tensor* w = layers.data() + layer * kPerLayer;
    if (!residual.defined()) {
      residual = hidden;
      normed = k.rms_norm.call(hidden, w[kInputNorm], eps[2 * layer]);
    } else {
      std::tie(normed, residual) = k.add_rms_norm.call(hidden, residual, w[kInputNorm],
                                                       eps[2 * layer]);
    }
    const Tensor qkv = k.linear_rows.call(normed, w[kQkv], std::nullopt, std::nullopt);
    Tensor q = k.rotary.call(qkv.narrow(1, 0, q_size), cos_rows, sin_rows, head_dim);
    const Tensor key = k.rotary.call(qkv.narrow(1, q_size, kv_size), cos_rows, sin_rows,
                                     head_dim);
    Tensor k_buffer = kv[2 * layer], v_buffer = kv[2 * layer + 1];
    k.write_kv.call(k_buffer, v_buffer, p.slots, key, qkv.narrow(1, q_size + kv_size, kv_size));
    Tensor attending = p.rows, seen = p.seq_lens;
    int64_t at = count;
    if (!all_last && layer == layer_count - 1) {
      // Only each request's last token goes on from here.
      q = q.index_select(0, p.last);
      residual = residual.index_select(0, p.last);
      attending = p.rows.index_select(0, p.last);
      seen = p.seq_lens.index_select(0, p.last);
      at = requests;
    }
    const Tensor attended = k.paged_attention.call(
        q.reshape({at, heads, head_dim}).contiguous(), k_buffer, v_buffer, req_to_token,
        attending, seen, ones.narrow(0, 0, at), scaling, 0, 0.0, std::nullopt, std::nullopt);
    hidden = k.linear_rows.call(attended.view({at, -1}), w[kO], std::nullopt, std::nullopt);
    std::tie(normed, residual) = k.add_rms_norm.call(hidden, residual, w[kPostNorm],
                                                     eps[2 * layer + 1]);
    const Tensor gate_up = k.linear_rows.call(normed, w[kGateUp], std::nullopt, std::nullopt);
    hidden = k.linear_rows.call(k.silu_and_mul.call(gate_up), w[kDown], std::nullopt,
                                std::nullopt);
  }
  normed = std::get<0>(k.add_rms_norm.call(hidden, residual, final_norm, final_eps));
  return k.linear_rows.call(normed, head, std::nullopt, std::nullopt);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(framework_cpu, m) {
  m.def(
      "llama_decode(Tensor tokens, Tensor rows, Tensor starts, Tensor lengths, "
      "Tensor req_to_token, Tensor embedding, Tensor cos, Tensor sin, Tensor[] layers, "
      "Tensor(a!)[] kv, float[] eps, int[] sizes, float scaling, Tensor final_norm, "
      "float final_eps, Tensor head) -> Tensor");
  m.impl("llama_decode", c10::DispatchKey::CPU, &llama_decode);
}
