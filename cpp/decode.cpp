// The compiled decode step: one mx::compile'd call per generated token that
// runs the embedding, every LFM2 layer (short conv or attention, dense MLP or
// sparse MoE) and the head, with the KV buffers and conv states passed in and
// returned (so the compiled graph is pure and MLX can donate the buffers).
//
// The op sequence mirrors the Rust eager decode (src/model/lfm2.rs,
// lfm2_moe.rs) exactly, so compiled and eager results agree byte for byte;
// tests hold that. Each quantized projection is dispatched by the spec the
// Rust side copied from the model's quant-info registry, never inferred.
//
// Every decoder object owns its weights and its compile id: two models in
// one process each keep their own compiled function.
#include <algorithm>
#include <atomic>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/compile_impl.h"
#include "mlx/mlx.h"
#include "mlxb.h"
#include "mlxb_internal.h"

namespace mx = mlx::core;
using mlxb::A;
using mlxb::wrap;

namespace {

struct QSpec {
  bool quant = false;
  std::string mode;
  int bits = 0;
  int group_size = 0;
};

struct Linear {
  mx::array w{0.0f};
  std::optional<mx::array> scales, biases, bias;
  QSpec q;

  mx::array apply(const mx::array& x) const {
    if (!q.quant) {
      if (bias) return mx::addmm(*bias, x, mx::transpose(w, {1, 0}), 1.0f, 1.0f);
      return mx::matmul(x, mx::transpose(w, {1, 0}));
    }
    auto y = mx::quantized_matmul(x, w, *scales, biases, true, q.group_size, q.bits, q.mode);
    return bias ? mx::add(y, *bias) : y;
  }
};

// Stacked experts [E, out, in], dense or quantized.
struct Experts {
  mx::array w{0.0f};
  std::optional<mx::array> scales, biases;
  QSpec q;
};

struct Layer {
  bool attn = false;
  bool moe = false;
  mx::array op_norm{0.0f}, ffn_norm{0.0f};
  // attention
  Linear q, k, v, o;
  mx::array q_norm{0.0f}, k_norm{0.0f};
  // conv
  Linear in, out;
  mx::array conv_w{0.0f};
  std::optional<mx::array> conv_b;
  // dense mlp
  Linear w1, w2, w3;
  // moe
  Linear gate;
  std::optional<mx::array> expert_bias;
  Experts eg, eu, ed;
};

struct Decoder {
  mlxb_decoder_config cfg{};
  std::vector<bool> attn, moe;
  std::map<std::string, mx::array> weights;
  std::map<std::string, QSpec> specs;
  Linear embed;  // the table, used by take and as the tied head
  std::optional<Linear> lm_head;
  mx::array final_norm{0.0f};
  std::vector<Layer> layers;
  mx::Dtype dtype = mx::float32;
  std::uintptr_t compile_id = 0;
  std::function<std::vector<mx::array>(const std::vector<mx::array>&)> compiled;
  bool finalized = false;
  // (rows, cache capacity) of every shape traced so far. MLX keeps one trace
  // per input shape for as long as the function lives and scans them on
  // every call; batches of changing size over growing caches would pile up
  // traces without end in a long-running server, so past cfg.max_traces
  // they are all dropped and the shapes in use are traced again.
  std::set<std::pair<int, int>> traced;
};

std::atomic<std::uintptr_t> g_next_id{1};

mx::array scalar(double v, mx::Dtype dt) { return mx::array(v, dt); }

const mx::array& need(Decoder& d, const std::string& name) {
  auto it = d.weights.find(name);
  if (it == d.weights.end()) throw std::invalid_argument("compiled decode: weight `" + name + "` was not registered");
  return it->second;
}

std::optional<mx::array> maybe(Decoder& d, const std::string& name) {
  auto it = d.weights.find(name);
  if (it == d.weights.end()) return std::nullopt;
  return it->second;
}

Linear linear(Decoder& d, const std::string& p) {
  Linear l;
  l.w = need(d, p + ".weight");
  auto it = d.specs.find(p);
  if (it != d.specs.end()) {
    l.q = it->second;
    l.scales = need(d, p + ".scales");
    l.biases = maybe(d, p + ".biases");
  }
  l.bias = maybe(d, p + ".bias");
  return l;
}

Experts experts(Decoder& d, const std::string& p) {
  Experts e;
  e.w = need(d, p + ".weight");
  auto it = d.specs.find(p);
  if (it != d.specs.end()) {
    e.q = it->second;
    e.scales = need(d, p + ".scales");
    e.biases = maybe(d, p + ".biases");
  }
  return e;
}

mx::array embed_rows(const Decoder& d, const mx::array& ids) {
  const Linear& e = d.embed;
  if (!e.q.quant) return mx::take(e.w, ids, 0);
  auto w = mx::take(e.w, ids, 0);
  auto s = mx::take(*e.scales, ids, 0);
  std::optional<mx::array> b;
  if (e.biases) b = mx::take(*e.biases, ids, 0);
  return mx::dequantize(w, s, b, e.q.group_size, e.q.bits, e.q.mode, std::nullopt, d.dtype);
}

mx::array gathered(const Experts& e, const mx::array& x, const mx::array& idx) {
  if (!e.q.quant) return mx::gather_mm(x, mx::swapaxes(e.w, -1, -2), std::nullopt, idx, false);
  return mx::gather_qmm(x, e.w, *e.scales, e.biases, std::nullopt, idx, true, e.q.group_size, e.q.bits, e.q.mode,
                        std::nullopt, false);
}

mx::array moe(const Decoder& d, const Layer& l, const mx::array& x) {
  const auto& c = d.cfg;
  int k = c.experts_per_token, e = c.num_experts;
  int b = x.shape(0), t = x.shape(1), dim = x.shape(2);
  auto probs = mx::sigmoid(l.gate.apply(x));
  mx::array select = l.expert_bias ? mx::add(mx::astype(probs, mx::float32), *l.expert_bias) : probs;
  auto inds = mx::stop_gradient(mx::slice(mx::argpartition(select, e - k, -1), {0, 0, e - k}, {b, t, e}, {1, 1, 1}));
  auto scores = mx::take_along_axis(probs, inds, -1);
  if (c.norm_topk_prob) {
    auto denom = mx::add(mx::sum(scores, std::vector<int>{-1}, true), scalar(1e-6, scores.dtype()));
    scores = mx::divide(scores, denom);
  }
  if (c.routed_scaling_factor != 1.0f) scores = mx::multiply(scores, scalar(c.routed_scaling_factor, scores.dtype()));
  scores = mx::astype(scores, x.dtype());
  mx::array y{0.0f};
  if (c.cpu_non_f32_experts) {
    // Mirrors SparseMoe::gathered_upcast: MLX's CPU gather_mm is float32-only.
    auto flat = mx::reshape(inds, {-1});
    auto xs = mx::astype(mx::reshape(mx::broadcast_to(mx::reshape(x, {b * t, 1, 1, dim}), {b * t, k, 1, dim}),
                                     {b * t * k, 1, dim}),
                         mx::float32);
    auto sel = [&](const Experts& ex) { return mx::astype(mx::take(ex.w, flat, 0), mx::float32); };
    auto last2 = [](const mx::array& a) { return mx::transpose(a, {0, 2, 1}); };
    auto g = mx::matmul(xs, last2(sel(l.eg)));
    auto u = mx::matmul(xs, last2(sel(l.eu)));
    auto h = mx::multiply(mx::multiply(g, mx::sigmoid(g)), u);
    y = mx::reshape(mx::astype(mx::matmul(h, last2(sel(l.ed))), x.dtype()), {b, t, k, dim});
  } else {
    auto xe = mx::reshape(x, {b, t, 1, 1, dim});
    auto g = gathered(l.eg, xe, inds);
    auto u = gathered(l.eu, xe, inds);
    auto h = mx::multiply(mx::multiply(g, mx::sigmoid(g)), u);
    y = mx::squeeze(gathered(l.ed, h, inds), -2);
  }
  return mx::sum(mx::multiply(y, mx::expand_dims(scores, -1)), std::vector<int>{-2}, false);
}

// inputs: token ids [B, 1], the positions (an int32 scalar for one sequence,
// int32 [B] for a batch of sequences at different positions), then in layer
// order the K and V buffers of an attention layer ([B, kv_heads, cap,
// head_dim]) or the state of a conv layer ([B, L-1, hidden]).
// outputs: logits [B, V], then the new buffers and states in the same order.
std::vector<mx::array> step(const Decoder& d, const std::vector<mx::array>& in) {
  const auto& c = d.cfg;
  const mx::array& ids = in[0];
  const mx::array& pos = in[1];
  // A batch writes each row's token at its own position: one scatter per
  // buffer, instead of one update per sequence.
  const bool per_row = pos.ndim() == 1;
  size_t next = 2;
  std::vector<mx::array> new_state;
  float eps = c.norm_eps;
  int hd = c.head_dim;
  auto h = embed_rows(d, ids);
  int b = h.shape(0), t = h.shape(1);
  for (size_t i = 0; i < d.layers.size(); ++i) {
    const Layer& l = d.layers[i];
    auto x = mx::fast::rms_norm(h, l.op_norm, eps);
    mx::array r{0.0f};
    if (l.attn) {
      auto q = mx::reshape(l.q.apply(x), {b, t, c.num_heads, hd});
      auto k = mx::reshape(l.k.apply(x), {b, t, c.num_kv_heads, hd});
      auto v = mx::reshape(l.v.apply(x), {b, t, c.num_kv_heads, hd});
      q = mx::transpose(mx::fast::rms_norm(q, l.q_norm, eps), {0, 2, 1, 3});
      k = mx::transpose(mx::fast::rms_norm(k, l.k_norm, eps), {0, 2, 1, 3});
      v = mx::transpose(v, {0, 2, 1, 3});
      q = mx::fast::rope(q, hd, false, c.rope_theta, 1.0f, pos);
      k = mx::fast::rope(k, hd, false, c.rope_theta, 1.0f, pos);
      const mx::array& kbuf = in[next++];
      const mx::array& vbuf = in[next++];
      int cap = kbuf.shape(2);
      auto cols = mx::arange(0.0, static_cast<double>(cap), 1.0, mx::int32);
      mx::array kn{0.0f}, vn{0.0f}, mask{false};
      if (per_row) {
        auto rows = mx::arange(0.0, static_cast<double>(b), 1.0, mx::int32);
        auto row_update = [&](const mx::array& x) { return mx::reshape(x, {b, 1, c.num_kv_heads, 1, hd}); };
        kn = mx::scatter(kbuf, {rows, pos}, row_update(k), {0, 2});
        vn = mx::scatter(vbuf, {rows, pos}, row_update(v), {0, 2});
        mask = mx::reshape(mx::less(mx::reshape(cols, {1, cap}), mx::reshape(mx::add(pos, scalar(1.0, mx::int32)), {b, 1})),
                           {b, 1, 1, cap});
      } else {
        auto start = mx::reshape(pos, {1});
        kn = mx::slice_update(kbuf, k, start, {2});
        vn = mx::slice_update(vbuf, v, start, {2});
        mask = mx::reshape(mx::less(cols, mx::add(pos, scalar(1.0, mx::int32))), {1, 1, 1, cap});
      }
      auto o = mx::fast::scaled_dot_product_attention(q, kn, vn, c.attn_scale, "array", mask);
      o = mx::reshape(mx::transpose(o, {0, 2, 1, 3}), {b, t, c.num_heads * hd});
      r = l.o.apply(o);
      new_state.push_back(kn);
      new_state.push_back(vn);
    } else {
      auto bcx = l.in.apply(x);
      auto parts = mx::split(bcx, 3, -1);
      auto bx = mx::multiply(parts[0], parts[2]);
      const mx::array& state = in[next++];
      auto padded = mx::concatenate({state, bx}, 1);
      int n = padded.shape(1), keep = c.conv_kernel - 1;
      new_state.push_back(mx::slice(padded, {0, n - keep, 0}, {padded.shape(0), n, padded.shape(2)}, {1, 1, 1}));
      auto conv = mx::conv1d(padded, l.conv_w, 1, 0, 1, c.hidden_size);
      if (l.conv_b) conv = mx::add(conv, *l.conv_b);
      r = l.out.apply(mx::multiply(parts[1], conv));
    }
    h = mx::add(h, r);
    x = mx::fast::rms_norm(h, l.ffn_norm, eps);
    mx::array f{0.0f};
    if (l.moe) {
      f = moe(d, l, x);
    } else {
      auto g = l.w1.apply(x);
      f = l.w2.apply(mx::multiply(mx::multiply(g, mx::sigmoid(g)), l.w3.apply(x)));
    }
    h = mx::add(h, f);
  }
  h = mx::fast::rms_norm(h, d.final_norm, eps);
  auto logits = d.lm_head ? d.lm_head->apply(h) : d.embed.apply(h);
  std::vector<mx::array> out{mx::reshape(logits, {b, -1})};
  out.insert(out.end(), new_state.begin(), new_state.end());
  return out;
}

void finalize(Decoder& d) {
  const auto& c = d.cfg;
  d.embed = linear(d, "embed");
  if (maybe(d, "lm_head.weight")) d.lm_head = linear(d, "lm_head");
  d.final_norm = need(d, "final_norm");
  d.dtype = d.final_norm.dtype();
  for (int i = 0; i < c.num_layers; ++i) {
    Layer l;
    std::string p = "L" + std::to_string(i) + ".";
    l.attn = d.attn[i];
    l.moe = d.moe[i];
    l.op_norm = need(d, p + "op_norm");
    l.ffn_norm = need(d, p + "ffn_norm");
    if (l.attn) {
      l.q = linear(d, p + "q");
      l.k = linear(d, p + "k");
      l.v = linear(d, p + "v");
      l.o = linear(d, p + "o");
      l.q_norm = need(d, p + "q_norm");
      l.k_norm = need(d, p + "k_norm");
    } else {
      l.in = linear(d, p + "in");
      l.out = linear(d, p + "out");
      l.conv_w = need(d, p + "conv_w");
      l.conv_b = maybe(d, p + "conv_b");
    }
    if (l.moe) {
      l.gate = linear(d, p + "gate");
      l.expert_bias = maybe(d, p + "expert_bias");
      l.eg = experts(d, p + "eg");
      l.eu = experts(d, p + "eu");
      l.ed = experts(d, p + "ed");
    } else {
      l.w1 = linear(d, p + "w1");
      l.w2 = linear(d, p + "w2");
      l.w3 = linear(d, p + "w3");
    }
    d.layers.push_back(std::move(l));
  }
  d.weights.clear();  // the layers hold their arrays now
  d.compile_id = reinterpret_cast<std::uintptr_t>(&d) ^ (g_next_id.fetch_add(1) << 1);
  Decoder* dp = &d;
  d.compiled = mx::detail::compile([dp](const std::vector<mx::array>& in) { return step(*dp, in); }, d.compile_id);
  d.finalized = true;
}

}  // namespace

struct mlxb_decoder_s {
  Decoder d;
};

extern "C" {

int mlxb_decoder_new(const mlxb_decoder_config* cfg, const uint8_t* attn_layers, const uint8_t* moe_layers,
                     mlxb_decoder* out) {
  MLXB_TRY({
    auto* h = new mlxb_decoder_s();
    h->d.cfg = *cfg;
    for (int i = 0; i < cfg->num_layers; ++i) {
      h->d.attn.push_back(attn_layers[i] != 0);
      h->d.moe.push_back(moe_layers[i] != 0);
    }
    *out = h;
  })
}

int mlxb_decoder_add_weight(mlxb_decoder d, const char* name, mlxb_array a) {
  MLXB_TRY({
    if (d->d.finalized) throw std::logic_error("compiled decode: weights added after finalize");
    d->d.weights.insert_or_assign(std::string(name), A(a));
  })
}

int mlxb_decoder_set_quant(mlxb_decoder d, const char* path, const char* mode, int bits, int group_size) {
  MLXB_TRY({ d->d.specs[std::string(path)] = QSpec{true, std::string(mode), bits, group_size}; })
}

int mlxb_decoder_finalize(mlxb_decoder d) { MLXB_TRY({ finalize(d->d); }) }

int mlxb_decoder_step(mlxb_decoder d, int compiled, const mlxb_array* ins, size_t n_in, mlxb_array* outs,
                      size_t cap_out, size_t* n_out) {
  MLXB_TRY({
    if (!d->d.finalized) throw std::logic_error("compiled decode: step before finalize");
    std::vector<mx::array> in;
    in.reserve(n_in);
    for (size_t i = 0; i < n_in; ++i) in.push_back(A(ins[i]));
    if (compiled) {
      std::pair<int, int> key{in.at(0).shape(0), 0};
      for (size_t i = 2; i < in.size(); ++i) {
        if (in[i].ndim() == 4) {
          key.second = in[i].shape(2);
          break;
        }
      }
      if (!d->d.traced.count(key)) {
        if (d->d.traced.size() >= static_cast<size_t>(std::max(1, d->d.cfg.max_traces))) {
          mx::detail::compile_erase(mx::detail::compile_cache(), d->d.compile_id);
          d->d.traced.clear();
        }
        d->d.traced.insert(key);
      }
    }
    auto res = compiled ? d->d.compiled(in) : step(d->d, in);
    if (res.size() > cap_out) throw std::invalid_argument("compiled decode: too many outputs for the caller");
    for (size_t i = 0; i < res.size(); ++i) outs[i] = wrap(res[i]);
    *n_out = res.size();
  })
}

void mlxb_decoder_free(mlxb_decoder d) {
  if (!d) return;
  try {
    if (d->d.finalized) mx::detail::compile_erase(mx::detail::compile_cache(), d->d.compile_id);
  } catch (...) {
  }
  delete d;
}

}  // extern "C"
