// Expert shapes, sources and checkpoint naming (tandem/experts.h).
#include "tandem/experts.h"

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

WeightView checkpoint_view(const Checkpoint& ckpt, const std::string& name, int n, int k) {
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
  return {checkpoint_view(ckpt, expand(naming.gate, layer, e), shape.inter, shape.hidden),
          checkpoint_view(ckpt, expand(naming.up, layer, e), shape.inter, shape.hidden),
          checkpoint_view(ckpt, expand(naming.down, layer, e), shape.hidden, shape.inter)};
}

void release_checkpoint_expert(const Checkpoint& ckpt, int layer, int e, const ExpertNaming& naming) {
  for (const std::string* p : {&naming.gate, &naming.up, &naming.down}) {
    const std::string name = expand(*p, layer, e);
    if (ckpt.contains(name)) ckpt.release(name);
  }
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
