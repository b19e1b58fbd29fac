// The runner's slot attention (services/verifier/runner.py) for CPU bfloat16 / float16 steps as C++
// operators: slot_attention, the fused kernel of fused_attention.h (no GEMM, each row in float32 in a
// fixed order), and slot_attention_aten, the same ATen calls as the Python body
// (_slot_attention_eager with the grouped attention of services/verifier/attention.py), in the same
// order on the same views, hence the same bits, without the interpreter between them. Built by
// services/verifier/native.py (the system compiler, torch's headers and libraries).
//
// dartree_native::set_cache(Tensor[] keys, Tensor[] values): the slot KV cache, per layer
//     [S, H_kv, C, Dh] (SlotKVCache.keys / values), for this thread's steps.
// dartree_native::set_step(int[] parts, Tensor[] biases): the active step, per request (segment) i:
//     parts[5i .. 5i + 4] = first row, end row, slot, start column, KV length; biases[i] = its additive
//     mask [G * R_i, L_i] float32 (attention.additive_mask).
// dartree_native::clear_step(): no active step (slot_attention then raises).
// dartree_native::slot_attention(query [1, Hq, R, Dh], key [1, H_kv, R, Dh], value, layer (0-d int64),
//     scaling) -> [1, R, Hq, Dh] contiguous: writes each request's K/V rows into its slot, then attends
//     each request's rows to its slot up to its KV length with the fused kernel (fused_attention.h:
//     no GEMM, float32 accumulation in a fixed order, each row computed alone).
// dartree_native::slot_attention_aten(same arguments) -> the same, by the ATen calls of the Python body
//     (bitwise the Python body's output; the reference of the fused kernel).
// dartree_native::int4_mm(x [M, K], packed, group_size, scale_zeros) -> [M, N]: torch's int4 CPU kernel
//     (aten::_weight_int4pack_mm_for_cpu) as one op of a compiled graph (services/q4_weights.py Int4Linear).
// dartree_native::q4_mm(x [M, K], qw, dm) -> [M, N], dartree_native::q8_mm(x [M, K], qw, scale) -> [M, N]:
//     the integer-dot q4 linears and int8 lm_head (int_dot.h, services/int_dot.py);
//     dartree_native::int_dot_isa() -> str: "avx512_vnni" or "scalar".

#include <torch/library.h>
#include <ATen/ATen.h>

#include "fused_attention.h"
#include "int_dot.h"

#include <stdexcept>
#include <vector>

namespace {

constexpr int64_t kRowBlock = 32;   // attention.ROW_BLOCK
constexpr int64_t kKvBlock = 1024;  // attention.KV_BLOCK

struct Step {
  std::vector<at::Tensor> keys, values;
  std::vector<int64_t> parts;
  std::vector<at::Tensor> biases;
  bool active = false;
};

thread_local Step state;

// attention._block
at::Tensor block(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                 const at::Tensor& bias, double scale) {
  const int64_t hq = query.size(1), rows = query.size(2), dh = query.size(3);
  const int64_t hkv = key.size(0), length = key.size(1);
  at::Tensor q = query.select(0, 0).reshape({hkv, hq / hkv * rows, dh});
  at::Tensor scores_t = at::bmm(key, q.transpose(1, 2));
  at::Tensor probs = at::softmax(at::add(bias, scores_t.transpose(1, 2), scale), -1).to(query.scalar_type());
  at::Tensor out;
  if (length <= kKvBlock) {
    out = at::bmm(probs, value);
  } else {  // Python's sum(...) of the float32 block products: 0 + first, then + each next
    at::Tensor acc;
    for (int64_t c = 0; c < length; c += kKvBlock) {
      const int64_t w = std::min(kKvBlock, length - c);
      at::Tensor part = at::bmm(probs.slice(2, c, c + w), value.slice(1, c, c + w)).to(at::kFloat);
      acc = acc.defined() ? at::add(acc, part) : at::add(part, 0);
    }
    out = acc.to(query.scalar_type());
  }
  return out.view({1, hq, rows, dh});
}

// attention.attend
at::Tensor attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                  const at::Tensor& bias, double scale) {
  const int64_t rows = query.size(2);
  if (rows <= kRowBlock) return block(query, key, value, bias, scale);
  const int64_t g = query.size(1) / key.size(0);
  at::Tensor b3 = bias.view({g, rows, key.size(1)});
  std::vector<at::Tensor> outs;
  for (int64_t a = 0; a < rows; a += kRowBlock) {
    const int64_t e = std::min(a + kRowBlock, rows);
    outs.push_back(block(query.slice(2, a, e), key, value, b3.slice(1, a, e).flatten(0, 1), scale));
  }
  return at::cat(outs, 2);
}

void set_cache(std::vector<at::Tensor> keys, std::vector<at::Tensor> values) {
  state.keys = std::move(keys);
  state.values = std::move(values);
}

void set_step(std::vector<int64_t> parts, std::vector<at::Tensor> biases) {
  if (parts.size() != 5 * biases.size()) throw std::invalid_argument("set_step: 5 ints per bias expected");
  state.parts = std::move(parts);
  state.biases = std::move(biases);
  state.active = true;
}

void clear_step() {
  state.active = false;
  state.biases.clear();
}

at::Tensor slot_attention_aten(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const at::Tensor& layer, double scaling) {
  if (!state.active) throw std::runtime_error("dartree_native::slot_attention outside a step");
  const int64_t l = layer.item<int64_t>();
  if (l < 0 || l >= static_cast<int64_t>(state.keys.size())) throw std::out_of_range("slot_attention: layer");
  const size_t n = state.biases.size();
  const bool one = n == 1;
  std::vector<at::Tensor> outs;
  outs.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t* p = state.parts.data() + 5 * i;
    const int64_t a = p[0], b = p[1], slot = p[2], start = p[3], length = p[4];
    at::Tensor k = state.keys[l].select(0, slot), v = state.values[l].select(0, slot);
    at::Tensor keys = one ? key.select(0, 0) : key.select(0, 0).slice(1, a, b);
    at::Tensor values = one ? value.select(0, 0) : value.select(0, 0).slice(1, a, b);
    const int64_t rows = keys.size(1);
    k.slice(1, start, start + rows).copy_(keys);  // SlotKVCache.write_read
    v.slice(1, start, start + rows).copy_(values);
    at::Tensor q = one ? query : query.slice(2, a, b);
    outs.push_back(attend(q, k.slice(1, 0, length), v.slice(1, 0, length), state.biases[i], scaling));
  }
  at::Tensor out = one ? outs[0] : at::cat(outs, 2);
  return out.transpose(1, 2).contiguous();
}

// SlotKVCache.write_read's writes: each request's K/V rows [1, H_kv, rows, Dh] into columns start.. of its slot.
void write_rows(const at::Tensor& cache, const at::Tensor& rows, int64_t a, int64_t b, int64_t slot, int64_t start) {
  cache.select(0, slot).slice(1, start, start + (b - a)).copy_(rows.select(0, 0).slice(1, a, b));
}

template <typename T>
void fused(const at::Tensor& query, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
           const std::vector<dartree_fused::Request>& reqs, double scaling) {
  dartree_fused::Views<T> w{query.const_data_ptr<T>(), query.stride(1), query.stride(2),
                            k.const_data_ptr<T>(), v.const_data_ptr<T>(), k.stride(0), k.stride(1), k.stride(2),
                            out.mutable_data_ptr<T>(), query.size(1), k.size(1), query.size(3),
                            static_cast<float>(scaling)};
  dartree_fused::attend_all(w, reqs);
}

// The fused kernel (fused_attention.h) over the active step: the slot writes, then every request's rows.
at::Tensor slot_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const at::Tensor& layer, double scaling) {
  if (!state.active) throw std::runtime_error("dartree_native::slot_attention outside a step");
  const int64_t l = layer.item<int64_t>();
  if (l < 0 || l >= static_cast<int64_t>(state.keys.size())) throw std::out_of_range("slot_attention: layer");
  const at::Tensor &k = state.keys[l], &v = state.values[l];
  TORCH_CHECK(query.dim() == 4 && query.size(0) == 1 && key.dim() == 4 && query.size(3) == k.size(3) &&
                  query.size(1) % k.size(1) == 0 && query.size(3) % dartree_fused::kLanes == 0 && query.scalar_type() == k.scalar_type() &&
                  key.scalar_type() == k.scalar_type() && query.stride(3) == 1 && k.stride(3) == 1 &&
                  v.strides() == k.strides(),
              "dartree_native::slot_attention: query ", query.sizes(), " ", query.scalar_type(), " against a cache ",
              k.sizes(), " ", k.scalar_type());
  std::vector<dartree_fused::Request> reqs;
  for (size_t i = 0; i < state.biases.size(); ++i) {
    const int64_t* p = state.parts.data() + 5 * i;
    const at::Tensor& bias = state.biases[i];
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.dim() == 2 && bias.stride(1) == 1 &&
                    bias.size(0) >= p[1] - p[0] && bias.size(1) == p[4] && p[4] <= k.size(2) && p[1] <= query.size(2),
                "dartree_native::slot_attention: request ", i, " bias ", bias.sizes(), " for its parts");
    write_rows(k, key, p[0], p[1], p[2], p[3]);
    write_rows(v, value, p[0], p[1], p[2], p[3]);
    reqs.push_back({p[0], p[1] - p[0], p[2], p[3], p[4], bias.const_data_ptr<float>(), bias.stride(0)});
  }
  at::Tensor out = at::empty({1, query.size(2), query.size(1), query.size(3)}, query.options());
  switch (query.scalar_type()) {
    case at::kBFloat16: fused<c10::BFloat16>(query, k, v, out, reqs, scaling); break;
    case at::kHalf: fused<c10::Half>(query, k, v, out, reqs, scaling); break;
    case at::kFloat: fused<float>(query, k, v, out, reqs, scaling); break;
    default: TORCH_CHECK(false, "dartree_native::slot_attention: no kernel for ", query.scalar_type());
  }
  return out;
}

// The int4 CPU kernel with its group size as an int: the call quantized::int4mm_packed_weight_cpu
// makes after reading the group size from a tensor (one item() a call, 124 calls a q4 step).
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, int64_t group_size,
                   const at::Tensor& scale_zeros) {
  return at::_weight_int4pack_mm_for_cpu(x, packed, group_size, scale_zeros);
}

}  // namespace

TORCH_LIBRARY(dartree_native, m) {
  m.def("set_cache(Tensor[] keys, Tensor[] values) -> ()", &set_cache);
  m.def("set_step(int[] parts, Tensor[] biases) -> ()", &set_step);
  m.def("clear_step() -> ()", &clear_step);
  m.def("slot_attention(Tensor query, Tensor key, Tensor value, Tensor layer, float scaling) -> Tensor");
  m.impl("slot_attention", c10::DispatchKey::CPU, TORCH_FN(slot_attention));
  m.def("slot_attention_aten(Tensor query, Tensor key, Tensor value, Tensor layer, float scaling) -> Tensor");
  m.impl("slot_attention_aten", c10::DispatchKey::CPU, TORCH_FN(slot_attention_aten));
  m.def("int4_mm(Tensor x, Tensor packed, int group_size, Tensor scale_zeros) -> Tensor");
  m.impl("int4_mm", c10::DispatchKey::CPU, TORCH_FN(int4_mm));
  m.def("q4_mm(Tensor x, Tensor qw, Tensor dm) -> Tensor");
  m.impl("q4_mm", c10::DispatchKey::CPU, TORCH_FN(int_dot::q4_mm));
  m.def("q8_mm(Tensor x, Tensor qw, Tensor scale) -> Tensor");
  m.impl("q8_mm", c10::DispatchKey::CPU, TORCH_FN(int_dot::q8_mm));
  m.def("int_dot_isa() -> str", &int_dot::isa);
}
