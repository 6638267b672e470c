// Expert shapes, sources and checkpoint naming (tandem/experts.h).
#include "tandem/experts.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "tandem/error.h"

namespace tandem {

ExpertNaming ExpertNaming::qwen3() {
  return {"model.layers.{L}.mlp.experts.{E}.gate_proj.weight", "model.layers.{L}.mlp.experts.{E}.up_proj.weight",
          "model.layers.{L}.mlp.experts.{E}.down_proj.weight"};
}
ExpertNaming ExpertNaming::mixtral() {
  return {"model.layers.{L}.block_sparse_moe.experts.{E}.w1.weight", "model.layers.{L}.block_sparse_moe.experts.{E}.w3.weight",
          "model.layers.{L}.block_sparse_moe.experts.{E}.w2.weight"};
}

namespace {

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string expand(const std::string& pattern, int layer, int expert) {
  std::string s = pattern;
  for (auto [key, v] : {std::pair<const char*, int>{"{L}", layer}, {"{E}", expert}}) {
    for (size_t at; (at = s.find(key)) != std::string::npos;) s.replace(at, 3, std::to_string(v));
  }
  return s;
}

}  // namespace

ExpertNaming ExpertNaming::detect(const Checkpoint& ckpt, int layer) {
  for (const ExpertNaming& n : {qwen3(), mixtral()})
    if (ckpt.contains(expand(n.gate, layer, 0))) return n;
  TANDEM_FAIL(Errc::bad_format, "checkpoint ", ckpt.root().string(), " has no routed experts for layer ", layer,
              " under a known naming (tried ", expand(qwen3().gate, layer, 0), " and ", expand(mixtral().gate, layer, 0),
              ")");
}

void check_expert_source(const ExpertSource& src, const MoeShape& sh, int e) {
  auto check = [&](const char* what, const WeightView& v, int n, int k) {
    TANDEM_CHECK(v.n == n && v.k == k, Errc::invalid_argument, "moe: expert ", e, " ", what, " is [", v.n, " x ", v.k,
                 "], the layer needs [", n, " x ", k, "]");
  };
  check("gate", src.gate, sh.inter, sh.hidden);
  check("up", src.up, sh.inter, sh.hidden);
  check("down", src.down, sh.hidden, sh.inter);
  const WeightView* biases[] = {&src.gate_bias, &src.up_bias, &src.down_bias};
  const char* names[] = {"gate bias", "up bias", "down bias"};
  const int lens[] = {sh.inter, sh.inter, sh.hidden};
  for (int i = 0; i < 3; ++i) {
    const bool given = biases[i]->data != nullptr;
    TANDEM_CHECK(given == sh.bias, Errc::invalid_argument, "moe: expert ", e, ": ",
                 sh.bias ? "the layer's experts have biases, its " : "the layer's experts have no biases, but its ",
                 names[i], given ? " is given" : " is missing");
    if (given) check(names[i], *biases[i], 1, lens[i]);
  }
}

std::string describe_experts(const MoeShape& sh) {
  std::string s = sh.act.plain() ? "silu(gate) * up"
                                 : str_cat("a clamped SwiGLU (alpha ", sh.act.alpha, ", limit ", sh.act.limit, ", up + ",
                                           sh.act.up_offset, ")");
  return sh.bias ? s + " with biases" : s;
}

std::string ExpertNaming::name(const std::string& pattern, int layer, int expert) { return expand(pattern, layer, expert); }

namespace {

// A 4-bit quantized weight's tensors in a checkpoint, found from the dense name `name`
// ("x.weight"): GPTQ / AWQ (x.qweight, x.qzeros, x.scales, optional x.g_idx) or
// compressed-tensors pack-quantized (x.weight_packed, x.weight_scale, optional
// x.weight_zero_point, x.weight_shape, optional x.weight_g_idx). Empty `parts`: not quantized.
struct Q4Tensors {
  bool compressed = false;
  std::string qweight, scales, qzeros, g_idx, shape;  // names; empty: absent
  std::vector<std::string> parts;                     // every one present
};

Q4Tensors q4_tensors(const Checkpoint& ckpt, const std::string& name) {
  Q4Tensors t;
  if (ckpt.contains(name)) return t;
  auto add = [&](std::string& field, const std::string& n) {
    if (ckpt.contains(n)) {
      field = n;
      t.parts.push_back(n);
    }
  };
  if (ckpt.contains(name + "_packed")) {
    t.compressed = true;
    add(t.qweight, name + "_packed");
    add(t.scales, name + "_scale");
    add(t.qzeros, name + "_zero_point");
    add(t.shape, name + "_shape");
    add(t.g_idx, name + "_g_idx");
    return t;
  }
  const std::string suffix = ".weight";
  if (name.size() <= suffix.size() || name.compare(name.size() - suffix.size(), suffix.size(), suffix)) return t;
  const std::string base = name.substr(0, name.size() - suffix.size());
  if (!ckpt.contains(base + ".qweight")) return t;
  add(t.qweight, base + ".qweight");
  add(t.scales, base + ".scales");
  add(t.qzeros, base + ".qzeros");
  add(t.g_idx, base + ".g_idx");
  return t;
}

TensorView read_i32_or_fail(const Checkpoint& ckpt, const std::string& t, Dtype dtype, const std::vector<int64_t>& shape,
                            const std::string& what) {
  const TensorView v = ckpt.tensor(t);
  TANDEM_CHECK(v.info->dtype == dtype && v.info->shape == shape, Errc::bad_format, t, " (file ",
               ckpt.file_of(t).path().string(), ") is ", dtype_name(v.info->dtype), " ", shape_str(v.info->shape), "; ",
               what, " needs ", dtype_name(dtype), " ", shape_str(shape));
  return v;
}

WeightView q4_view(const Checkpoint& ckpt, const std::string& name, const Q4Tensors& t, int n, int k,
                   std::vector<std::shared_ptr<const Q4Source>>& keep) {
  auto q = std::make_shared<Q4Source>();
  const char* fmt = t.compressed ? "compressed-tensors" : "GPTQ / AWQ";
  auto need = [&](const std::string& field, const char* part) {
    TANDEM_CHECK(!field.empty(), Errc::bad_format, "checkpoint ", ckpt.root().string(), ": ", name, " is ", fmt,
                 "-quantized but its ", part, " tensor is missing");
  };
  need(t.scales, t.compressed ? "weight_scale" : "scales");
  TANDEM_CHECK(n % 8 == 0 && k % 8 == 0, Errc::unsupported, name, ": a 4-bit quantized weight of [", n, " x ", k,
               "] needs both sizes multiples of 8");
  const TensorView qw = ckpt.tensor(t.qweight);
  const auto& sshape = ckpt.info(t.scales).shape;
  const Dtype sd = ckpt.info(t.scales).dtype;
  TANDEM_CHECK(sd == Dtype::F16 || sd == Dtype::BF16 || sd == Dtype::F32, Errc::bad_format, t.scales, " is ",
               dtype_name(sd), "; scales must be F16, BF16 or F32");
  q->scale_type = sd == Dtype::F16 ? Q4Source::Scale::f16 : sd == Dtype::BF16 ? Q4Source::Scale::bf16 : Q4Source::Scale::f32;
  int groups = 0;
  if (t.compressed) {
    q->layout = Q4Source::Layout::packed_rows;
    const std::vector<int64_t> want_packed = {n, k / 8};
    TANDEM_CHECK(qw.info->dtype == Dtype::I32 && qw.info->shape == want_packed, Errc::bad_format,
                 t.qweight, " is ", dtype_name(qw.info->dtype), " ", shape_str(qw.info->shape), "; 4-bit ", fmt,
                 " of [", n, " x ", k, "] is I32 [", n, ", ", k / 8, "] (other bit widths are not supported)");
    TANDEM_CHECK(sshape.size() == 2 && sshape[0] == n && sshape[1] > 0 && k % sshape[1] == 0, Errc::bad_format,
                 t.scales, " has shape ", shape_str(sshape), ": [", n, ", groups] with groups dividing k = ", k,
                 " (per-channel or per-tensor scales are not read)");
    groups = static_cast<int>(sshape[1]);
    if (!t.qzeros.empty())
      q->qzeros = read_i32_or_fail(ckpt, t.qzeros, Dtype::I32, {n / 8, groups}, "packed 4-bit zero points").data;
  } else {
    need(t.qzeros, "qzeros");
    TANDEM_CHECK(qw.info->dtype == Dtype::I32 && qw.info->shape.size() == 2, Errc::bad_format, t.qweight, " is ",
                 dtype_name(qw.info->dtype), " ", shape_str(qw.info->shape), "; GPTQ and AWQ store I32");
    const std::vector<int64_t> gptq_shape = {k / 8, n}, awq_shape = {k, n / 8};
    if (qw.info->shape == gptq_shape) {
      q->layout = Q4Source::Layout::gptq;
    } else if (qw.info->shape == awq_shape) {
      q->layout = Q4Source::Layout::awq;
    } else {
      TANDEM_FAIL(Errc::bad_format, t.qweight, " has shape ", shape_str(qw.info->shape), ": 4-bit GPTQ of [", n,
                  " x ", k, "] is [", k / 8, ", ", n, "], AWQ is [", k, ", ", n / 8,
                  "] (other bit widths are not supported)");
    }
    TANDEM_CHECK(sshape.size() == 2 && sshape[1] == n && sshape[0] > 0 && k % sshape[0] == 0, Errc::bad_format,
                 t.scales, " has shape ", shape_str(sshape), ": [groups, ", n, "] with groups dividing k = ", k);
    groups = static_cast<int>(sshape[0]);
    q->qzeros = read_i32_or_fail(ckpt, t.qzeros, Dtype::I32, {groups, n / 8}, "4-bit zero points").data;
  }
  if (!t.g_idx.empty()) {  // groups in order along k only
    const int group = k / groups;
    const TensorView g = read_i32_or_fail(ckpt, t.g_idx, Dtype::I32, {k}, "a group index");
    for (int c = 0; c < k; ++c) {
      int32_t v;
      std::memcpy(&v, g.data + 4 * static_cast<size_t>(c), 4);
      TANDEM_CHECK(v == c / group, Errc::unsupported, t.g_idx, "[", c, "] is ", v, ", not ", c / group,
                   ": act-order (desc_act) weights, whose groups are permuted along k, are not supported "
                   "(quantize without act-order, or load a bf16 / FP8 checkpoint)");
    }
  }
  q->qweight = qw.data;
  q->scales = ckpt.tensor(t.scales).data;
  q->n = n;
  q->k = k;
  q->group = k / groups;
  WeightView v;
  v.type = SourceType::q4_gptq;
  v.data = q->qweight;
  v.n = n;
  v.k = k;
  v.q4 = q.get();
  v.name = qw.info->name.c_str();
  v.file = ckpt.file_of(t.qweight).path().c_str();
  keep.push_back(std::move(q));
  return v;
}

WeightView checkpoint_view(const Checkpoint& ckpt, const std::string& name, int n, int k,
                           std::vector<std::shared_ptr<const Q4Source>>& keep) {
  if (const Q4Tensors t = q4_tensors(ckpt, name); !t.parts.empty()) return q4_view(ckpt, name, t, n, k, keep);
  TANDEM_CHECK(ckpt.contains(name), Errc::bad_format, "checkpoint ", ckpt.root().string(), " has no tensor ", name);
  const TensorView t = ckpt.tensor(name);
  TANDEM_CHECK(t.info->shape.size() == 2 && t.info->shape[0] == n && t.info->shape[1] == k, Errc::bad_format, name,
               " has shape ", shape_str(t.info->shape), ", the layer needs [", n, ", ", k, "]");
  WeightView v;
  v.data = t.data;
  v.n = n;
  v.k = k;
  v.name = t.info->name.c_str();
  v.file = ckpt.file_of(name).path().c_str();
  switch (t.info->dtype) {
    case Dtype::F32: v.type = SourceType::f32; break;
    case Dtype::BF16: v.type = SourceType::bf16; break;
    case Dtype::F16: v.type = SourceType::f16; break;
    case Dtype::F8_E4M3: {
      v.type = SourceType::f8_e4m3;
      const std::string sname = name + "_scale_inv";
      // Without its block scales an FP8 weight is off by the scale (often 100x and more):
      // never run it unscaled.
      TANDEM_CHECK(ckpt.contains(sname), Errc::bad_format, "checkpoint ", ckpt.root().string(), ": ", name, " (file ",
                   ckpt.file_of(name).path().string(), ") is F8_E4M3 but has no ", sname,
                   " (its block scales); FP8 expert weights need them");
      {
        const TensorView st = ckpt.tensor(sname);
        const int bn = static_cast<int>(st.info->shape.size() == 2 ? st.info->shape[0] : 0);
        const int bk = static_cast<int>(st.info->shape.size() == 2 ? st.info->shape[1] : 0);
        TANDEM_CHECK(st.info->dtype == Dtype::F32 && bn > 0 && bk > 0, Errc::bad_format, sname,
                     " must be a 2-d F32 tensor of block scales");
        TANDEM_CHECK(reinterpret_cast<uintptr_t>(st.data) % alignof(float) == 0, Errc::bad_format, sname,
                     " is not 4-byte aligned in its file");
        v.block_scale = reinterpret_cast<const float*>(st.data);
        v.block_n = (n + bn - 1) / bn;
        v.block_k = (k + bk - 1) / bk;
        // Blocks are square powers of two in practice (128); recover them from the grid.
        for (int b = 1; b <= n; b *= 2)
          if ((n + b - 1) / b == bn) { v.block_n = b; break; }
        for (int b = 1; b <= k; b *= 2)
          if ((k + b - 1) / b == bk) { v.block_k = b; break; }
        v.scale_ld = bk;
      }
      break;
    }
    default:
      TANDEM_FAIL(Errc::unsupported, name, " has dtype ", dtype_name(t.info->dtype),
                  "; expert weights must be F32, BF16, F16 or F8_E4M3");
  }
  return v;
}

// Rows [row0, row0 + n) of expert e in a fused tensor [experts x rows x k] (transformers v5's
// experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]), read in place.
WeightView fused_view(const Checkpoint& ckpt, const std::string& name, int experts, int e, int rows, int row0, int n,
                      int k, std::vector<std::shared_ptr<const Q4Source>>& keep) {
  TANDEM_CHECK(ckpt.contains(name), Errc::bad_format, "checkpoint ", ckpt.root().string(), " has no tensor ", name);
  const TensorView t = ckpt.tensor(name);
  const auto& sh = t.info->shape;
  TANDEM_CHECK(sh.size() == 3 && sh[0] == experts && sh[1] == rows && sh[2] == k, Errc::bad_format, name, " has shape ",
               shape_str(sh), ", the layer's fused experts need [", experts, ", ", rows, ", ", k,
               "] (a transposed layout is not supported)");
  WeightView v;
  v.n = n;
  v.k = k;
  v.name = t.info->name.c_str();
  v.file = ckpt.file_of(name).path().c_str();
  const size_t first = (static_cast<size_t>(e) * rows + row0) * static_cast<size_t>(k);  // in weights
  size_t elem = 0;
  switch (t.info->dtype) {
    case Dtype::F32: v.type = SourceType::f32; elem = 4; break;
    case Dtype::BF16: v.type = SourceType::bf16; elem = 2; break;
    case Dtype::F16: v.type = SourceType::f16; elem = 2; break;
    case Dtype::Q8_0:
    case Dtype::Q4_1:
      v.type = t.info->dtype == Dtype::Q8_0 ? SourceType::ggml_q8_0 : SourceType::ggml_q4_1;
      v.data = t.data + first / kGgmlBlock * static_cast<size_t>(ggml_block_bytes(v.type));
      return v;  // (the table's check: k, the last dimension, is whole blocks)
    case Dtype::Q4_0: {  // the expert's rows as a 4-bit source of their own (int4 keeps its numbers)
      auto q = std::make_shared<Q4Source>();
      q->layout = Q4Source::Layout::ggml_q4_0;
      q->scale_type = Q4Source::Scale::f16;
      q->qweight = q->scales = t.data + first / kGgmlBlock * Q4Source::kQ40Bytes;
      q->n = n;
      q->k = k;
      q->group = kGgmlBlock;
      v.type = SourceType::q4_gptq;
      v.data = q->qweight;
      v.q4 = q.get();
      keep.push_back(std::move(q));
      return v;
    }
    default:
      TANDEM_FAIL(Errc::unsupported, name, " (file ", ckpt.file_of(name).path().string(), ") has type ",
                  dtype_name(t.info->dtype), "; fused expert tensors must be F32, BF16 or F16, or GGUF's Q8_0, Q4_0 or "
                  "Q4_1 (FP8 and 4-bit experts of safetensors checkpoints are read per expert)");
  }
  v.data = t.data + first * elem;
  return v;
}

}  // namespace

bool ExpertNaming::fused() const {
  const bool g = gate.find("{E}") == std::string::npos, u = up.find("{E}") == std::string::npos,
             d = down.find("{E}") == std::string::npos;
  TANDEM_CHECK(g == u && u == d, Errc::invalid_argument, "expert naming (", gate, ", ", up, ", ", down,
               "): either every pattern names one expert ({E}), or none does (fused tensors: gate and up naming one "
               "gate_up tensor or a gate and an up tensor, down the down tensor)");
  return g;
}

ExpertSource checkpoint_expert(const Checkpoint& ckpt, int layer, int e, const ExpertNaming& naming, const MoeShape& shape) {
  ExpertSource s;
  if (naming.fused()) {
    TANDEM_CHECK(e >= 0 && e < shape.experts, Errc::invalid_argument, "expert ", e, " is outside [0, ", shape.experts, ")");
    const std::string gu = expand(naming.gate, layer, e), dn = expand(naming.down, layer, e);
    const int E = shape.experts, H = shape.hidden, I = shape.inter;
    if (naming.gate == naming.up) {
      s.gate = fused_view(ckpt, gu, E, e, 2 * I, 0, I, H, s.keep);  // transformers' chunk(2): gate first
      s.up = fused_view(ckpt, gu, E, e, 2 * I, I, I, H, s.keep);
    } else {  // a gate and an up tensor, [E, I, H] each (GGUF's ffn_gate_exps / ffn_up_exps)
      s.gate = fused_view(ckpt, gu, E, e, I, 0, I, H, s.keep);
      s.up = fused_view(ckpt, expand(naming.up, layer, e), E, e, I, 0, I, H, s.keep);
    }
    s.down = fused_view(ckpt, dn, E, e, H, 0, H, I, s.keep);
    return s;
  }
  s.gate = checkpoint_view(ckpt, expand(naming.gate, layer, e), shape.inter, shape.hidden, s.keep);
  s.up = checkpoint_view(ckpt, expand(naming.up, layer, e), shape.inter, shape.hidden, s.keep);
  s.down = checkpoint_view(ckpt, expand(naming.down, layer, e), shape.hidden, shape.inter, s.keep);
  return s;
}

std::vector<std::string> expert_tensor_names(const Checkpoint& ckpt, const std::string& name) {
  if (const Q4Tensors t = q4_tensors(ckpt, name); !t.parts.empty()) return t.parts;
  std::vector<std::string> out;
  for (const std::string& n : {name, name + "_scale_inv"})
    if (ckpt.contains(n)) out.push_back(n);
  return out;
}

void release_checkpoint_expert(const Checkpoint& ckpt, int layer, int e, const ExpertNaming& naming) {
  for (const std::string* p : {&naming.gate, &naming.up, &naming.down})
    for (const std::string& n : expert_tensor_names(ckpt, expand(*p, layer, e))) ckpt.release(n);
}

void check_checkpoint_experts(const Checkpoint& ckpt, const std::vector<int>& layers, const ExpertNaming& naming,
                              const MoeShape& shape) {
  for (int layer : layers)
    for (int e = 0; e < shape.experts; ++e) checkpoint_expert(ckpt, layer, e, naming, shape);
}

void load_checkpoint_layers(const Checkpoint& ckpt, const std::vector<int>& layers, const ExpertNaming& naming,
                            const MoeShape& shape, const LoadLayer& load_layer, const Progress& progress) {
  // Every tensor of every layer is checked before anything is packed.
  check_checkpoint_experts(ckpt, layers, naming, shape);
  const int E = shape.experts, L = static_cast<int>(layers.size());
  const int total = L * E;
  for (int i = 0; i < L; ++i) {
    const int model_layer = layers[i];
    Progress p;  // layers count (subpool, expert) items: rescale to experts
    if (progress) p = [&, i](int done, int of) { progress(i * E + (of > 0 ? static_cast<int>(int64_t{done} * E / of) : 0), total); };
    load_layer(i, [&](int e) { return checkpoint_expert(ckpt, model_layer, e, naming, shape); }, p);
    for (int e = 0; e < E; ++e) release_checkpoint_expert(ckpt, model_layer, e, naming);
  }
  if (progress) progress(total, total);
}

}  // namespace tandem
