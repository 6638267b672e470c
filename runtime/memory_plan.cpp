#include "tandem/memory_plan.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <map>
#include <regex>
#include <set>

#include "tandem/error.h"
#include "tandem/kernels.h"
#include "tandem/safetensors.h"

namespace tandem {
namespace fs = std::filesystem;

namespace {

using J = nlohmann::json;

// The sizes HybridMoe and the CUDA stream allocate (runtime/hybrid.cpp, gpu/cuda_stream.cpp).
constexpr uint64_t kCublasWorkspace = 32ull << 20;

const ConfigSizeBound* bound_of(std::string_view key) {
  for (const ConfigSizeBound& b : config_size_bounds())
    if (key == b.key) return &b;
  return nullptr;
}

// A size in config.json: a JSON integer (a float such as 4096.0 is refused, as the Python
// loader refuses it) within its bound when it has one.
void check_size(const J& v, const fs::path& file, const char* key) {
  const ConfigSizeBound* b = bound_of(key);
  const int64_t lo = b ? b->min : 0, hi = b ? b->max : std::numeric_limits<int64_t>::max();
  const bool integer = v.is_number_integer() && !(v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(hi));
  TANDEM_CHECK(integer && v.get<int64_t>() >= lo && v.get<int64_t>() <= hi, Errc::bad_format, file.string(), ": ", key,
               " = ", v.dump(), " is not a valid size (expected an integer in [", lo, ", ", hi, "])");
}

int64_t get_int(const J& j, const fs::path& file, const char* key, int64_t fallback = -1) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    TANDEM_CHECK(fallback >= 0, Errc::bad_format, file.string(), ": no '", key, "' (needed to size the model)");
    return fallback;
  }
  check_size(*it, file, key);
  return it->get<int64_t>();
}

// The first of `keys` present (non-null) in j, else -1.
int64_t first_int(const J& j, const fs::path& file, std::initializer_list<const char*> keys) {
  for (const char* k : keys)
    if (j.contains(k) && !j[k].is_null()) return get_int(j, file, k);
  return -1;
}

// A checkpoint tensor holding a routed expert's weights (per-expert or fused layouts).
bool is_expert_tensor(const std::string& name) {
  static const std::regex re(R"(\.experts\.(\d+\.|gate_up_proj|down_proj))");
  return std::regex_search(name, re);
}

bool is_float(Dtype d) {
  switch (d) {
    case Dtype::F16: case Dtype::BF16: case Dtype::F32: case Dtype::F64: case Dtype::F8_E4M3: case Dtype::F8_E5M2:
      return true;
    default:
      return false;
  }
}

// Non-expert weights from config.json alone (no safetensors found): the usual decoder
// parameter count in elements, per the transformers modeling code of the supported types.
uint64_t non_expert_elements(const J& j, const fs::path& f, const ModelInfo& m) {
  const uint64_t H = m.shape.hidden, E = m.shape.experts, L = m.layers;
  const uint64_t V = get_int(j, f, "vocab_size");
  const bool tied = j.value("tie_word_embeddings", false);
  uint64_t n = V * H * (tied ? 1 : 2) + H;  // embeddings, lm_head, final norm
  const uint64_t heads = get_int(j, f, "num_attention_heads");
  uint64_t attn = 0;
  if (j.contains("kv_lora_rank") && !j["kv_lora_rank"].is_null()) {  // DeepSeek MLA
    const uint64_t q_lora = first_int(j, f, {"q_lora_rank"}) > 0 ? get_int(j, f, "q_lora_rank") : 0;
    const uint64_t kv_lora = get_int(j, f, "kv_lora_rank"), rope = get_int(j, f, "qk_rope_head_dim"),
                   nope = get_int(j, f, "qk_nope_head_dim"), v = get_int(j, f, "v_head_dim");
    attn += q_lora ? H * q_lora + q_lora + q_lora * heads * (nope + rope) : H * heads * (nope + rope);
    attn += H * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v) + heads * v * H;
  } else {
    const uint64_t kv = get_int(j, f, "num_key_value_heads", heads);
    const uint64_t hd = get_int(j, f, "head_dim", heads ? H / heads : 0);
    attn += H * heads * hd + 2 * H * kv * hd + heads * hd * H;
    if (j.value("attention_bias", false)) attn += heads * hd + 2 * kv * hd;
    if (m.model_type == "qwen3_moe") attn += 2 * hd;  // q_norm, k_norm
  }
  n += L * (attn + 2 * H);  // + input / post-attention norms
  const std::set<int> moe(m.moe_layers.begin(), m.moe_layers.end());
  const uint64_t dense_inter = std::max<int64_t>(0, first_int(j, f, {"intermediate_size"}));
  const uint64_t shared = std::max<int64_t>(0, first_int(j, f, {"n_shared_experts"})) * m.shape.inter +
                          std::max<int64_t>(0, first_int(j, f, {"shared_expert_intermediate_size"}));
  for (uint64_t l = 0; l < L; ++l) {
    if (moe.count(static_cast<int>(l))) {
      n += E * H + 3 * H * shared;                                   // router, shared experts
      if (m.model_type == "deepseek_v3") n += E;                     // e_score_correction_bias
      if (first_int(j, f, {"shared_expert_intermediate_size"}) > 0) n += H;  // shared_expert_gate
    } else {
      n += 3 * H * dense_inter;
    }
  }
  return n;
}

}  // namespace

const std::vector<ConfigSizeBound>& config_size_bounds() {
  static const std::vector<ConfigSizeBound> bounds = {
      {"num_hidden_layers", 1, 4096},      {"hidden_size", 1, 1 << 18},
      {"intermediate_size", 0, 1 << 20},   {"moe_intermediate_size", 0, 1 << 20},
      {"vocab_size", 1, 1 << 24},          {"num_attention_heads", 1, 4096},
      {"num_key_value_heads", 0, 4096},    {"head_dim", 0, 1 << 14},
      {"num_experts", 0, 1 << 16},         {"n_routed_experts", 0, 1 << 16},
      {"num_local_experts", 0, 1 << 16},   {"num_experts_per_tok", 0, 1 << 16},
      {"moe_num_experts", 0, 1 << 16},    {"moe_k", 0, 1 << 16},
      {"moe_topk", 0, 1 << 16},
      {"n_shared_experts", 0, 1 << 10},    {"max_position_embeddings", 0, 1 << 24},
      {"first_k_dense_replace", 0, 4096},  {"num_nextn_predict_layers", 0, 64},
      {"shared_expert_intermediate_size", 0, 1 << 20}, {"decoder_sparse_step", 0, 4096},
      {"q_lora_rank", 0, 1 << 16},         {"kv_lora_rank", 0, 1 << 16},
      {"qk_rope_head_dim", 0, 1 << 14},    {"qk_nope_head_dim", 0, 1 << 14},
      {"v_head_dim", 0, 1 << 14},
  };
  return bounds;
}

ModelInfo read_model_info(const fs::path& model_path) {
  ModelInfo m;
  // A GGUF model's sizes are in its file's metadata, which only the Python side reads (the gguf
  // package): never plan from a config.json that happens to sit beside it.
  TANDEM_CHECK(model_path.extension() != ".gguf", Errc::unsupported, model_path.string(),
               ": a GGUF model; the memory plan reads a checkpoint directory's config.json (load the model, or "
               "point model.path at the original checkpoint, to see its memory)");
  const fs::path dir = fs::is_directory(model_path) ? model_path : model_path.parent_path();
  m.config_json = dir / "config.json";
  std::ifstream in(m.config_json);
  TANDEM_CHECK(in.good(), Errc::io, m.config_json.string(), ": cannot open (a Hugging Face checkpoint directory has one)");
  J j;
  try {
    j = J::parse(in);
  } catch (const J::exception& e) {
    TANDEM_FAIL(Errc::bad_format, m.config_json.string(), ": not valid JSON: ", e.what());
  }
  TANDEM_CHECK(j.is_object(), Errc::bad_format, m.config_json.string(), ": expected a JSON object");
  const fs::path& f = m.config_json;
  if (j.contains("text_config") && j["text_config"].is_object()) j = j["text_config"];  // multimodal wrappers
  for (const ConfigSizeBound& b : config_size_bounds())  // every bounded size, before anything is sized from one
    if (j.contains(b.key) && !j[b.key].is_null()) check_size(j[b.key], f, b.key);
  m.model_type = j.value("model_type", std::string());
  m.layers = static_cast<int>(get_int(j, f, "num_hidden_layers"));
  m.shape.hidden = static_cast<int>(get_int(j, f, "hidden_size"));
  const int64_t experts = first_int(j, f, {"num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"});
  TANDEM_CHECK(experts > 0, Errc::bad_format, f.string(),
               ": no routed experts (none of num_experts, n_routed_experts, num_local_experts, moe_num_experts is positive)");
  m.shape.experts = static_cast<int>(experts);
  // Mixtral's experts use intermediate_size; the others name the expert width moe_intermediate_size.
  int64_t inter = first_int(j, f, {"moe_intermediate_size"});
  if (inter <= 0) inter = get_int(j, f, "intermediate_size");
  m.shape.inter = static_cast<int>(inter);
  const int64_t top_k = first_int(j, f, {"num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk"});
  TANDEM_CHECK(top_k > 0, Errc::bad_format, f.string(),
               ": no positive num_experts_per_tok (nor num_experts_per_token, moe_k, moe_topk): how many experts route "
               "each token");
  m.top_k = static_cast<int>(top_k);
  TANDEM_CHECK(m.shape.hidden > 0 && m.shape.inter > 0, Errc::bad_format, f.string(),
               ": hidden_size and the expert intermediate size must be positive");
  TANDEM_CHECK(m.top_k <= m.shape.experts, Errc::bad_format, f.string(), ": num_experts_per_tok = ", m.top_k,
               " is more than the ", m.shape.experts, " experts");
  // Which layers route (the transformers modeling code): Qwen MoE skips mlp_only_layers and
  // uses decoder_sparse_step; DeepSeek's first first_k_dense_replace layers are dense.
  const int64_t first_dense = std::max<int64_t>(0, first_int(j, f, {"first_k_dense_replace"}));
  const int64_t step = std::max<int64_t>(1, first_int(j, f, {"decoder_sparse_step"}));
  std::set<int> mlp_only;
  if (j.contains("mlp_only_layers") && j["mlp_only_layers"].is_array())
    for (const auto& v : j["mlp_only_layers"])
      if (v.is_number_integer()) mlp_only.insert(v.get<int>());
  const auto& types = j.contains("mlp_layer_types") ? j["mlp_layer_types"] : J();
  if (types.is_array() && static_cast<int>(types.size()) == m.layers) {
    // The newer configs say it per layer (AXK, Beam, DeepSeek-V3.2/V4, HY-V4...): "dense" or
    // a routed kind ("sparse", "hash_moe").
    for (int l = 0; l < m.layers; ++l)
      if (!(types[l].is_string() && types[l].get<std::string>() == "dense")) m.moe_layers.push_back(l);
  } else {
    for (int l = 0; l < m.layers; ++l)
      if (l >= first_dense && !mlp_only.count(l) && (l + 1) % step == 0) m.moe_layers.push_back(l);
  }
  TANDEM_CHECK(!m.moe_layers.empty(), Errc::bad_format, f.string(), ": no layer has routed experts");

  if (j.contains("swiglu_limit") && j["swiglu_limit"].is_number())
    m.expert_math = str_cat("a clamped SwiGLU (config.json: swiglu_limit ", j["swiglu_limit"].get<double>(), ")");

  std::string dtype = j.value("dtype", std::string());
  if (dtype.empty()) dtype = j.value("torch_dtype", std::string());
  if (dtype.empty()) dtype = "float32";
  m.dtype = dtype;
  m.dtype_bytes = (dtype == "bfloat16" || dtype == "float16" || dtype == "half") ? 2 : dtype == "float64" ? 8 : 4;

  // Non-expert weights: the checkpoint's own tensors when it has safetensors files.
  bool have_files = false;
  if (fs::is_directory(model_path)) {
    for (const auto& e : fs::directory_iterator(model_path))
      have_files = have_files || e.path().extension() == ".safetensors";
    have_files = have_files || fs::exists(model_path / "model.safetensors.index.json");
  } else {
    have_files = fs::exists(model_path);
  }
  if (have_files) {
    const Checkpoint ckpt = Checkpoint::open(model_path);
    // The routed experts as the checkpoint holds them (what load_model will pack), where it
    // stores them one tensor per expert: which layers route, how many experts, their width.
    // config.json's keys for these differ by family (ERNIE's moe_layer_start_index, ...); the
    // checkpoint's names do not.
    {
      static const std::regex expert_re(R"(^model\.layers\.(\d+)\..*\.experts\.(\d+)\.(gate_proj|w1)\.weight$)");
      std::map<int, int> experts_of;  // layer -> highest expert index + 1
      std::string first;
      for (const std::string& name : ckpt.names()) {
        std::smatch mm;
        if (!std::regex_match(name, mm, expert_re)) continue;
        const int layer = std::stoi(mm[1]), e = std::stoi(mm[2]);
        if (layer >= m.layers) continue;  // multi-token-prediction layers
        experts_of[layer] = std::max(experts_of[layer], e + 1);
        if (first.empty() && e == 0) first = name;
      }
      if (!experts_of.empty() && !first.empty()) {
        m.moe_layers.clear();
        for (const auto& [layer, n] : experts_of) m.moe_layers.push_back(layer);
        const int n = experts_of.begin()->second;
        TANDEM_CHECK(n == m.shape.experts, Errc::bad_format, f.string(), ": says ", m.shape.experts,
                     " routed experts, the checkpoint holds ", n, " in layer ", experts_of.begin()->first);
        const TensorInfo& g = ckpt.info(first);
        TANDEM_CHECK(g.shape.size() == 2 && g.shape[1] == m.shape.hidden, Errc::bad_format, first, " has shape [",
                     g.shape.size() ? g.shape[0] : 0, ", ...], the experts of a hidden size ", m.shape.hidden, " need [I, ",
                     m.shape.hidden, "]");
        m.shape.inter = static_cast<int>(g.shape[0]);
      }
    }
    {  // experts with biases (gpt-oss: fused gate_up_proj_bias / down_proj_bias)
      static const std::regex bias_re(R"(\.experts\.(\d+\.[A-Za-z0-9_]+\.bias|[A-Za-z0-9_]+_bias)$)");
      for (const std::string& name : ckpt.names())
        if (std::regex_search(name, bias_re)) {
          m.expert_math += str_cat(m.expert_math.empty() ? "" : "; ", "experts with biases (checkpoint: ", name, ")");
          break;
        }
    }
    uint64_t bytes = 0;
    int counted = 0;
    static const std::regex layer_re(R"(^model\.layers\.(\d+)\.)");
    for (const std::string& name : ckpt.names()) {
      if (is_expert_tensor(name)) continue;
      std::smatch mm;
      if (std::regex_search(name, mm, layer_re) && std::stoi(mm[1]) >= m.layers) continue;  // e.g. DeepSeek MTP
      if (name.size() > 10 && name.ends_with("_scale_inv") && ckpt.contains(name.substr(0, name.size() - 10)))
        continue;  // FP8 block scales: the weight is dequantized to the model dtype
      if (name.ends_with("rotary_emb.inv_freq")) continue;
      const TensorInfo& t = ckpt.info(name);
      bytes += is_float(t.dtype) ? t.numel() * m.dtype_bytes : t.nbytes();
      ++counted;
    }
    m.non_expert_bytes = bytes;
    m.non_expert_exact = true;
    m.non_expert_source = str_cat("safetensors headers: ", counted, " tensor(s) as ", dtype);
  } else {
    m.non_expert_bytes = non_expert_elements(j, f, m) * m.dtype_bytes;
    m.non_expert_source = str_cat("estimated from config.json shapes (no safetensors files), as ", dtype);
  }
  return m;
}

uint64_t moe_layer_cpu_bytes(const MoeShape& shape, const PackOptions& format, int subpools, int cpu_experts) {
  TANDEM_CHECK(subpools >= 1, Errc::invalid_argument, "moe_layer_cpu_bytes: subpools = ", subpools);
  if (cpu_experts <= 0) return 0;
  const std::vector<int> slices = intermediate_slices(shape.inter, subpools, format);
  uint64_t per_expert = 0;
  for (int s = 0; s < subpools; ++s) {
    const int width = slices[s + 1] - slices[s];
    if (width == 0) continue;  // MoeLayer::load packs nothing for an empty slice
    per_expert += packed_bytes(format, width, shape.hidden, true) + packed_bytes(format, shape.hidden, width);
  }
  return per_expert * static_cast<uint64_t>(cpu_experts);
}

int hot_expert_count(const HotExpertsConfig& hot, int layer, int experts) {
  using P = HotExpertsConfig::Policy;
  switch (hot.policy) {
    case P::none: return 0;
    case P::uniform:
    case P::statistics: return std::min(hot.count, experts);
    case P::explicit_lists: {
      const auto it = hot.layers.find(layer);
      return it == hot.layers.end() ? 0 : static_cast<int>(it->second.size());
    }
  }
  return 0;
}

uint64_t MemoryPlan::ram_bytes() const {
  uint64_t b = 0;
  for (const auto& p : ram) b += p.bytes;
  return b;
}

uint64_t MemoryPlan::gpu_bytes() const {
  uint64_t b = 0;
  for (const auto& p : gpu) b += p.bytes;
  return b;
}

MemoryPlan plan_memory(const Config& config, const ModelInfo& model, int subpools, bool on_gpu) {
  MemoryPlan p;
  p.on_gpu = on_gpu;
  p.subpools = subpools;
  const PackOptions fmt = pack_options(config.cpu.format, config.cpu.group_size, config.cpu.zero_point);
  const MoeShape& sh = model.shape;
  if (fmt.format == WeightFormat::int4)
    TANDEM_CHECK(sh.hidden % fmt.group == 0 && sh.inter % fmt.group == 0, Errc::invalid_argument,
                 "cpu.group_size: ", fmt.group, " does not divide the model's hidden size ", sh.hidden,
                 " and expert intermediate size ", sh.inter, " (int4 needs whole groups)");
  const uint64_t H = sh.hidden, I = sh.inter, E = sh.experts, L = model.moe_layers.size();
  const uint64_t T = config.buffers.max_tokens, K = model.top_k;
  const bool deferred = config.gpu.deferred_experts > 0;

  // Routed experts: the pools' packs of every non-hot expert; the hot ones on the device.
  // Experts other than plain SwiGLU stay on the CPU (Engine: auto places none, a count or a
  // list is refused).
  HotExpertsConfig hot = config.gpu.hot_experts;
  if (!model.expert_math.empty()) hot.keep_on_cpu(config.source, model.expert_math);
  uint64_t hot_bytes = 0, hot_scratch = 0, slot_maps = 0;
  for (int layer : model.moe_layers) {
    const int nh = hot_expert_count(hot, layer, sh.experts);
    p.hot_experts += nh;
    p.cpu_expert_bytes += moe_layer_cpu_bytes(sh, fmt, subpools, sh.experts - nh);
    if (nh == 0) continue;
    if (on_gpu) {  // CudaExperts: bf16 [nh*2I x H] + [H x nh*I]; scratch per token count
      hot_bytes += uint64_t(nh) * 3 * I * H * 2;
      slot_maps += E * 4;
      hot_scratch += T * H * 2 + T * nh * 4 + T * nh * 2 * I * 4 + T * nh * I * 2;
    } else {  // HostExperts: BF16 packs of whole experts
      hot_bytes += uint64_t(nh) * (packed_bytes({WeightFormat::bf16}, sh.inter, sh.hidden, true) +
                                   packed_bytes({WeightFormat::bf16}, sh.hidden, sh.inter));
    }
  }
  p.hot_expert_bytes = hot_bytes;

  // HybridMoe's buffers for one batch of max_tokens tokens.
  const uint64_t xs = model.dtype == "bfloat16" ? 2 : 4;  // the layer input: bf16 as is, any other dtype as fp32
  const uint64_t per_slot = T * H * xs + 3 * T * K * 4 + T * K * 4 + T * H * 4 + (deferred ? T * H * 4 : 0);
  const uint64_t pinned = uint64_t(config.buffers.pinned_slots) * per_slot;
  const uint64_t dev_buffers = 3 * T * K * 4 + T * H * 4 + (deferred ? T * H * 4 : 0) + L * E;

  auto& dev = on_gpu ? p.gpu : p.ram;
  p.ram.push_back({"cpu experts", p.cpu_expert_bytes,
                   str_cat(L, " MoE layers x ", sh.experts, " experts (", p.hot_experts, " hot in all) as ",
                           config.cpu.format, " on ", subpools, " subpool(s)")});
  if (p.hot_experts > 0)
    dev.push_back({"hot experts", hot_bytes,
                   str_cat(p.hot_experts, " experts as bf16", on_gpu ? "" : " packs on the host stream")});
  p.ram.push_back({"pinned buffers", pinned,
                   str_cat(config.buffers.pinned_slots, " slot(s) x ", T, " tokens (buffers.max_tokens)")});
  dev.push_back({"scheduler buffers", dev_buffers + slot_maps + (on_gpu ? kCublasWorkspace : 0),
                 str_cat("ids, outputs and masks for ", T, " tokens", on_gpu ? ", cuBLAS workspace" : "")});
  if (hot_scratch) dev.push_back({"hot expert scratch", hot_scratch, str_cat("per layer with hot experts, for ", T, " tokens")});
  dev.push_back({"non-expert weights", model.non_expert_bytes, model.non_expert_source});
  return p;
}

}  // namespace tandem
