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
}

std::string ExpertNaming::name(const std::string& pattern, int layer, int expert) { return expand(pattern, layer, expert); }

namespace {

// The GPTQ base name of `name` ("x.weight" -> "x") when the checkpoint holds x.qweight.
std::string gptq_base(const Checkpoint& ckpt, const std::string& name) {
  const std::string suffix = ".weight";
  if (ckpt.contains(name) || name.size() <= suffix.size() || name.compare(name.size() - suffix.size(), suffix.size(), suffix))
    return {};
  const std::string base = name.substr(0, name.size() - suffix.size());
  return ckpt.contains(base + ".qweight") ? base : std::string();
}

WeightView gptq_view(const Checkpoint& ckpt, const std::string& base, int n, int k,
                     std::vector<std::shared_ptr<const Q4Source>>& keep) {
  auto tensor = [&](const std::string& suffix, Dtype dtype, std::vector<int64_t> shape) {
    const std::string t = base + suffix;
    TANDEM_CHECK(ckpt.contains(t), Errc::bad_format, "checkpoint ", ckpt.root().string(), ": ", base,
                 ".qweight is GPTQ-quantized but ", t, " is missing");
    const TensorView v = ckpt.tensor(t);
    TANDEM_CHECK(v.info->dtype == dtype && v.info->shape == shape, Errc::bad_format, t, " (file ",
                 ckpt.file_of(t).path().string(), ") is ", dtype_name(v.info->dtype), " ", shape_str(v.info->shape),
                 "; a 4-bit GPTQ weight of [", n, " x ", k, "] needs ", dtype_name(dtype), " ", shape_str(shape));
    return v;
  };
  TANDEM_CHECK(n % 8 == 0 && k % 8 == 0, Errc::unsupported, base, ": a GPTQ weight of [", n, " x ", k,
               "] needs both sizes multiples of 8");
  const TensorView qw = ckpt.tensor(base + ".qweight");
  TANDEM_CHECK(qw.info->dtype == Dtype::I32 && qw.info->shape.size() == 2, Errc::bad_format, base, ".qweight is ",
               dtype_name(qw.info->dtype), " ", shape_str(qw.info->shape), "; GPTQ stores I32 [k / 8, n]");
  TANDEM_CHECK(qw.info->shape[0] * 8 == k && qw.info->shape[1] == n, Errc::bad_format, base, ".qweight has shape ",
               shape_str(qw.info->shape), ": 4-bit GPTQ of [", n, " x ", k, "] is [", k / 8, ", ", n,
               "] (other bit widths are not supported)");
  const std::string sname = base + ".scales";
  TANDEM_CHECK(ckpt.contains(sname), Errc::bad_format, "checkpoint ", ckpt.root().string(), ": ", base,
               ".qweight is GPTQ-quantized but ", sname, " is missing");
  const auto& sshape = ckpt.info(sname).shape;
  TANDEM_CHECK(sshape.size() == 2 && sshape[0] > 0 && k % sshape[0] == 0, Errc::bad_format, sname, " has shape ",
               shape_str(sshape), ": its rows must divide k = ", k, " into groups");
  const int groups = static_cast<int>(sshape[0]), group = k / groups;
  auto q = std::make_shared<Q4Source>();
  q->qweight = qw.data;
  q->scales = tensor(".scales", Dtype::F16, {groups, n}).data;
  q->qzeros = tensor(".qzeros", Dtype::I32, {groups, n / 8}).data;
  q->n = n;
  q->k = k;
  q->group = group;
  q->zero_offset = 1;
  if (ckpt.contains(base + ".g_idx")) {
    const TensorView g = tensor(".g_idx", Dtype::I32, {k});
    for (int c = 0; c < k; ++c) {
      int32_t v;
      std::memcpy(&v, g.data + 4 * static_cast<size_t>(c), 4);
      TANDEM_CHECK(v == c / group, Errc::unsupported, base, ".g_idx[", c, "] is ", v, ", not ", c / group,
                   ": act-order (desc_act) GPTQ weights, whose groups are permuted along k, are not supported "
                   "(quantize without desc_act, or load a bf16 / FP8 checkpoint)");
    }
  }
  WeightView v;
  v.type = SourceType::q4_gptq;
  v.data = q->qweight;
  v.n = n;
  v.k = k;
  v.q4 = q.get();
  v.name = qw.info->name.c_str();
  v.file = ckpt.file_of(base + ".qweight").path().c_str();
  keep.push_back(std::move(q));
  return v;
}

WeightView checkpoint_view(const Checkpoint& ckpt, const std::string& name, int n, int k,
                           std::vector<std::shared_ptr<const Q4Source>>& keep) {
  if (const std::string base = gptq_base(ckpt, name); !base.empty()) return gptq_view(ckpt, base, n, k, keep);
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

}  // namespace

ExpertSource checkpoint_expert(const Checkpoint& ckpt, int layer, int e, const ExpertNaming& naming, const MoeShape& shape) {
  ExpertSource s;
  s.gate = checkpoint_view(ckpt, expand(naming.gate, layer, e), shape.inter, shape.hidden, s.keep);
  s.up = checkpoint_view(ckpt, expand(naming.up, layer, e), shape.inter, shape.hidden, s.keep);
  s.down = checkpoint_view(ckpt, expand(naming.down, layer, e), shape.hidden, shape.inter, s.keep);
  return s;
}

std::vector<std::string> expert_tensor_names(const Checkpoint& ckpt, const std::string& name) {
  if (const std::string base = gptq_base(ckpt, name); !base.empty()) {
    std::vector<std::string> out;
    for (const char* s : {".qweight", ".scales", ".qzeros", ".g_idx"})
      if (ckpt.contains(base + s)) out.push_back(base + s);
    return out;
  }
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
