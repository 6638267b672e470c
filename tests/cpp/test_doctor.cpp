#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "tandem/cpu_features.h"
#include "tandem/doctor.h"
#include "tandem/engine.h"
#include "tandem/memory_plan.h"
#include "tandem/gpu_info.h"
#include "tandem/topology.h"
#include "test_util.h"

namespace tandem {
namespace {

TEST(Topology, CountsAreConsistent) {
  const Topology& t = topology();
  ASSERT_GE(t.nodes.size(), 1u);
  int cores = 0, pus = 0;
  for (const auto& n : t.nodes) {
    cores += static_cast<int>(n.cores.size());
    for (const auto& c : n.cores) {
      EXPECT_FALSE(c.pus.empty());
      pus += static_cast<int>(c.pus.size());
    }
  }
  EXPECT_EQ(cores, t.cores);
  EXPECT_EQ(pus, t.pus);
  EXPECT_GE(t.cores, 1);
  EXPECT_LE(t.pus, static_cast<int>(std::thread::hardware_concurrency()) * 2);
}

TEST(Gpu, ReportNeverThrowsAndExplainsAbsence) {
  gpu::GpuReport r = gpu::query_gpus(true);
  if (r.gpus.empty()) {
    EXPECT_FALSE(r.status.empty());
    EXPECT_NE(r.status, "ok");
  } else {
    for (const auto& g : r.gpus) EXPECT_TRUE(g.kernel_ok) << g.name << ": " << g.kernel_error;
  }
}

TEST(Doctor, ReportMatchesDetection) {
  DoctorReport r = run_doctor();
  auto j = nlohmann::json::parse(r.json);
  EXPECT_EQ(j["cpu"]["hardware_isa"], std::string(isa_name(hardware_isa())));
  EXPECT_EQ(j["cpu"]["features"]["avx512_bf16"], cpu_features().avx512_bf16);
  EXPECT_EQ(j["topology"]["cores"], topology().cores);
  EXPECT_EQ(j["ok"], r.ok);
  EXPECT_NE(r.text.find("Topology"), std::string::npos);
  EXPECT_NE(r.text.find("GPU"), std::string::npos);
}

TEST(Doctor, ValidatesConfig) {
  test::ScratchDir dir;
  test::write_file(dir / "bad.yaml", "cpu:\n  format: bf15\n");
  DoctorReport bad = run_doctor((dir / "bad.yaml").string(), false);
  EXPECT_FALSE(bad.ok);
  auto j = nlohmann::json::parse(bad.json);
  EXPECT_EQ(j["config"]["valid"], false);
  EXPECT_EQ(j["config"]["error"], (dir / "bad.yaml").string() + ":2:11: cpu.format: 'bf15' is not one of: bf16, int8, int4, mxfp4");

  test::write_file(dir / "misfit.yaml", "cpu:\n  numa_nodes: [0, 7]\nmodel:\n  path: nowhere\n");
  DoctorReport misfit = run_doctor((dir / "misfit.yaml").string(), false);
  auto m = nlohmann::json::parse(misfit.json);
  EXPECT_EQ(m["config"]["valid"], true);
  EXPECT_FALSE(misfit.ok);
  const auto problems = m["config"]["problems"].dump();
  EXPECT_NE(problems.find("cpu.numa_nodes: node 7 does not exist on this machine"), std::string::npos) << problems;
  EXPECT_NE(problems.find("model.path: '" + (dir / "nowhere").string() + "' does not exist"), std::string::npos) << problems;

  test::write_file(dir / "good.yaml", "cpu:\n  format: int8\ngpu:\n  device: none\n");
  DoctorReport good = run_doctor((dir / "good.yaml").string(), false);
  EXPECT_TRUE(good.ok) << good.text;
}

// ---- memory: `tandem doctor --config F` says "fits" only after estimating it ----------

nlohmann::json doctor_json(const std::filesystem::path& config) {
  return nlohmann::json::parse(run_doctor(config.string(), false).json);
}

// Without a model there is nothing to size: the report says memory was not checked.
TEST(DoctorMemory, NotCheckedWithoutAModel) {
  test::ScratchDir dir;
  test::write_file(dir / "c.yaml", "cpu:\n  format: int8\ngpu:\n  device: none\n");
  DoctorReport r = run_doctor((dir / "c.yaml").string(), false);
  auto j = nlohmann::json::parse(r.json);
  EXPECT_TRUE(r.ok) << r.text;
  ASSERT_TRUE(j["config"].contains("memory")) << r.json;
  EXPECT_EQ(j["config"]["memory"]["checked"], false);
  EXPECT_NE(j["config"]["memory"]["reason"].get<std::string>().find("no model.path"), std::string::npos);
  EXPECT_EQ(r.text.find("fits"), std::string::npos) << r.text;
  EXPECT_NE(r.text.find("memory not checked: no model.path"), std::string::npos) << r.text;
}

// A tiny Qwen3-MoE checkpoint (config.json + model.safetensors): 3 layers, layer 1 dense
// (mlp_only_layers), 6 experts of hidden 128 / intermediate 96 (not a multiple of 64, so
// packs are padded), and the non-expert tensors a loader would read.
constexpr int kE = 6, kH = 128, kI = 96, kV = 32;

std::string bf16_bytes(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.f, 0.1f);
  std::vector<bf16_t> v(n);
  for (auto& x : v) x = fp32_to_bf16(nd(rng));
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 2);
}

// Writes the checkpoint; returns the bytes of its non-expert tensors (bf16).
uint64_t write_tiny_model(const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  test::write_file(dir / "config.json", R"({"model_type": "qwen3_moe", "num_hidden_layers": 3, "hidden_size": 128,
    "num_experts": 6, "moe_intermediate_size": 96, "intermediate_size": 64, "num_experts_per_tok": 2,
    "mlp_only_layers": [1], "decoder_sparse_step": 1, "vocab_size": 32, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 64, "tie_word_embeddings": false, "torch_dtype": "bfloat16"})");
  std::mt19937_64 rng(7);
  std::vector<test::Entry> entries;
  uint64_t non_expert = 0;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, bool expert) {
    size_t n = 1;
    for (auto d : shape) n *= d;
    entries.push_back({name, "BF16", shape, bf16_bytes(n, rng)});
    if (!expert) non_expert += n * 2;
  };
  add("model.embed_tokens.weight", {kV, kH}, false);
  add("lm_head.weight", {kV, kH}, false);
  add("model.norm.weight", {kH}, false);
  for (int l = 0; l < 3; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "self_attn.q_proj.weight", {128, kH}, false);
    add(p + "self_attn.o_proj.weight", {kH, 128}, false);
    if (l == 1) {
      add(p + "mlp.gate_proj.weight", {64, kH}, false);
      continue;
    }
    add(p + "mlp.gate.weight", {kE, kH}, false);
    for (int e = 0; e < kE; ++e) {
      const std::string q = p + "mlp.experts." + std::to_string(e) + ".";
      add(q + "gate_proj.weight", {kI, kH}, true);
      add(q + "up_proj.weight", {kI, kH}, true);
      add(q + "down_proj.weight", {kH, kI}, true);
    }
  }
  test::write_file(dir / "model.safetensors", test::good_file(entries));
  return non_expert;
}

// The estimate equals what the engine really packs, per format, subpool split and hot set.
TEST(DoctorMemory, EstimateEqualsTheEnginesPackedBytes) {
  test::ScratchDir dir;
  const uint64_t non_expert = write_tiny_model(dir / "model");
  const std::vector<std::string> placements = {
      "cpu: {format: bf16, virtual_subpools: 2, threads: 1}\ngpu: {device: none, hot_experts: 2}\n",
      "cpu: {format: int8, virtual_subpools: 3, threads: 1}\ngpu: {device: none, hot_experts: {layers: {0: [1], 2: [0, 3, 5]}}}\n",
      "cpu: {format: int4, group_size: 32, zero_point: true, virtual_subpools: 2, threads: 1}\ngpu: {device: none}\n",
      "cpu: {format: int4, group_size: 32, virtual_subpools: 1, threads: 1}\ngpu: {device: none, hot_experts: 1, deferred_experts: 1}\n",
  };
  for (const std::string& placement : placements) {
    SCOPED_TRACE(placement);
    const auto yaml = dir / "c.yaml";
    test::write_file(yaml, "model:\n  path: model\n" + placement + "buffers: {pinned_slots: 2, max_tokens: 64}\n");
    const auto j = doctor_json(yaml);
    const auto& mem = j["config"]["memory"];
    ASSERT_TRUE(mem.is_object() && mem["checked"] == true) << j["config"].dump(2);

    Engine engine(load_config(yaml), {{kE, kH, kI}, {0, 2}});
    const Checkpoint ckpt = Checkpoint::open(dir / "model");
    engine.load(ckpt, ExpertNaming::detect(ckpt, 0));
    EXPECT_EQ(mem["cpu_expert_bytes"].get<uint64_t>(), engine.cpu_bytes());
    EXPECT_EQ(mem["hot_expert_bytes"].get<uint64_t>(), engine.device_bytes());
    EXPECT_EQ(mem["subpools"].get<int>(), engine.pool().subpools());
    EXPECT_EQ(mem["model"]["non_expert_bytes"].get<uint64_t>(), non_expert);
    EXPECT_EQ(mem["model"]["non_expert_exact"], true);
    std::printf("[ estimate ] %s: cpu experts %llu bytes (engine %zu), hot %llu (engine %zu)\n",
                placement.substr(0, placement.find('\n')).c_str(),
                (unsigned long long)mem["cpu_expert_bytes"].get<uint64_t>(), engine.cpu_bytes(),
                (unsigned long long)mem["hot_expert_bytes"].get<uint64_t>(), engine.device_bytes());

    // RAM: the parts add up; the host stream keeps the hot experts and the scheduler's
    // "device" buffers in RAM too; the pinned slots are what HybridMoe allocates for a
    // batch of max_tokens (x bf16, 3 id lists, weights, output, + deferred output).
    uint64_t sum = 0, pinned = 0;
    for (const auto& p : mem["ram"]["parts"]) {
      sum += p["bytes"].get<uint64_t>();
      if (p["what"] == "pinned buffers") pinned = p["bytes"].get<uint64_t>();
    }
    EXPECT_EQ(mem["ram"]["needed_bytes"].get<uint64_t>(), sum);
    EXPECT_GE(sum, engine.cpu_bytes() + engine.device_bytes() + non_expert);
    const bool deferred = placement.find("deferred_experts: 1") != std::string::npos;
    const uint64_t T = 64, K = 2;
    EXPECT_EQ(pinned, 2 * (T * kH * 2 + 3 * T * K * 4 + T * K * 4 + T * kH * 4 + (deferred ? T * kH * 4 : 0)));
    EXPECT_FALSE(mem.contains("gpu"));
    EXPECT_EQ(mem["fits"], true);
  }
}

// A config.json alone sizes the model (the experts always come from its shapes; with no
// safetensors the rest is estimated): DeepSeek-V3's published 671B parameters and
// Qwen3-30B-A3B's 30.5B come out of the estimate at bf16.
TEST(DoctorMemory, SizesPublishedModelsFromConfigJsonAlone) {
  test::ScratchDir dir;
  std::filesystem::create_directories(dir / "dsv3");
  test::write_file(dir / "dsv3" / "config.json", R"({"model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "num_experts_per_tok": 8, "tie_word_embeddings": false,
    "torch_dtype": "bfloat16"})");
  std::filesystem::create_directories(dir / "qwen");
  test::write_file(dir / "qwen" / "config.json", R"({"model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": false,
    "torch_dtype": "bfloat16"})");
  struct Want {
    const char* dir;
    int moe_layers;
    uint64_t experts_bytes;
    double params;
  };
  for (const Want& w : {Want{"dsv3", 58, 58ull * 256 * 3 * 7168 * 2048 * 2, 671e9},
                        Want{"qwen", 48, 48ull * 128 * 3 * 2048 * 768 * 2, 30.5e9}}) {
    test::write_file(dir / "c.yaml", std::string("model: {path: ") + w.dir + "}\ngpu: {device: none}\n");
    const auto j = doctor_json(dir / "c.yaml");
    const auto& mem = j["config"]["memory"];
    ASSERT_TRUE(mem.is_object() && mem["checked"] == true) << j["config"].dump(2);
    EXPECT_EQ(mem["model"]["moe_layers"], w.moe_layers);
    EXPECT_EQ(mem["model"]["non_expert_exact"], false);
    EXPECT_EQ(mem["cpu_expert_bytes"].get<uint64_t>(), w.experts_bytes) << w.dir;
    const double params = double(mem["cpu_expert_bytes"].get<uint64_t>() + mem["model"]["non_expert_bytes"].get<uint64_t>()) / 2;
    EXPECT_NEAR(params / w.params, 1.0, 0.01) << w.dir << ": " << params;
    std::printf("[ estimate ] %s: %.2fB parameters (published %.1fB); RAM needed %.1f GiB\n", w.dir, params / 1e9,
                w.params / 1e9, mem["ram"]["needed_bytes"].get<uint64_t>() / double(1ull << 30));
    // Whether it fits follows the numbers, on any machine.
    const bool short_of_ram = mem["ram"]["needed_bytes"].get<uint64_t>() > mem["ram"]["available_bytes"].get<uint64_t>();
    EXPECT_EQ(mem["fits"].get<bool>(), !short_of_ram);
    EXPECT_EQ(j["ok"].get<bool>(), !short_of_ram);
  }
}

// A model no machine holds (config.json claims 2000 DeepSeek-V3 layers; the checkpoint
// itself has a single small file): "does not fit", with the need, the machine's RAM
// and the shortfall, in the text and the JSON; the doctor fails.
TEST(DoctorMemory, HugeModelDoesNotFit) {
  test::ScratchDir dir;
  std::filesystem::create_directories(dir / "huge");
  test::write_file(dir / "huge" / "config.json", R"({"model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 2000,
    "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "first_k_dense_replace": 3, "num_experts_per_tok": 8, "torch_dtype": "bfloat16"})");
  test::write_file(dir / "huge" / "model.safetensors",
                   test::good_file({{"model.norm.weight", "BF16", {7168}, std::string(7168 * 2, '\0')}}));
  test::write_file(dir / "c.yaml", "model:\n  path: huge\ncpu:\n  format: int4\ngpu:\n  device: none\n");
  DoctorReport r = run_doctor((dir / "c.yaml").string(), false);
  EXPECT_FALSE(r.ok);
  const auto j = nlohmann::json::parse(r.json);
  const auto& mem = j["config"]["memory"];
  ASSERT_TRUE(mem.is_object() && mem["checked"] == true) << j["config"].dump(2);
  EXPECT_EQ(mem["fits"], false);
  // int4 group 128, symmetric: per 64 rows x 128 k, 4 KiB of nibbles + 128 bytes of scales.
  const uint64_t per_matrix = 7168ull * 2048 / 2 * (4096 + 128) / 4096;
  EXPECT_EQ(mem["cpu_expert_bytes"].get<uint64_t>(), 1997ull * 256 * 3 * per_matrix);
  EXPECT_EQ(mem["model"]["non_expert_bytes"].get<uint64_t>(), 7168u * 2);  // the checkpoint's one tensor
  const uint64_t need = mem["ram"]["needed_bytes"].get<uint64_t>(), have = mem["ram"]["available_bytes"].get<uint64_t>();
  EXPECT_GT(need, have);
  const std::string problems = j["config"]["problems"].dump();
  EXPECT_NE(problems.find("does not fit: needs "), std::string::npos) << problems;
  EXPECT_NE(problems.find(" of RAM for cpu experts "), std::string::npos) << problems;
  EXPECT_NE(problems.find("this machine has "), std::string::npos) << problems;
  EXPECT_NE(problems.find("(short by "), std::string::npos) << problems;
  EXPECT_NE(r.text.find("valid, but cannot run here"), std::string::npos) << r.text;
  EXPECT_NE(r.text.find("does not fit: needs "), std::string::npos) << r.text;
  std::printf("%s", r.text.substr(r.text.find("Config")).c_str());
}

// An int4 group that does not divide the model's intermediate size cannot be packed:
// the doctor says so instead of estimating.
TEST(DoctorMemory, Int4GroupMustDivideTheModel) {
  test::ScratchDir dir;
  write_tiny_model(dir / "model");  // intermediate 96
  test::write_file(dir / "c.yaml", "model: {path: model}\ncpu: {format: int4, group_size: 64}\ngpu: {device: none}\n");
  DoctorReport r = run_doctor((dir / "c.yaml").string(), false);
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.text.find("cpu.group_size: 64 does not divide"), std::string::npos) << r.text;
}

// With a CUDA stream the hot experts (bf16, unpadded, as gpu/cuda_stream.cpp uploads them),
// the scheduler's device buffers, each hot layer's grouped-GEMM scratch for a max_tokens
// batch and the non-expert weights count against the GPU; the CPU packs and the pinned
// slots against RAM. configs/qwen3-30b-a3b.yaml's placement for Qwen3-30B-A3B, as numbers.
TEST(DoctorMemory, CudaPlacementCountsDeviceMemory) {
  ModelInfo m;
  m.model_type = "qwen3_moe";
  m.layers = 48;
  for (int l = 0; l < 48; ++l) m.moe_layers.push_back(l);
  m.shape = {128, 2048, 768};
  m.top_k = 8;
  m.dtype = "bfloat16";
  m.dtype_bytes = 2;
  m.non_expert_bytes = 1'000'000'000;
  const Config c = load_config(std::filesystem::path(TANDEM_SOURCE_DIR) / "configs" / "qwen3-30b-a3b.yaml");
  ASSERT_EQ(c.gpu.hot_experts.count, 16);
  const MemoryPlan p = plan_memory(c, m, 1, true);
  auto part = [](const std::vector<MemoryPart>& parts, const std::string& what) -> uint64_t {
    for (const auto& x : parts)
      if (x.what == what) return x.bytes;
    return 0;
  };
  const uint64_t T = c.buffers.max_tokens, H = 2048, I = 768, nh = 16, K = 8;
  EXPECT_EQ(p.hot_expert_bytes, 48 * nh * 3 * I * H * 2);
  EXPECT_EQ(part(p.gpu, "hot experts"), p.hot_expert_bytes);
  EXPECT_EQ(part(p.ram, "hot experts"), 0u);
  EXPECT_EQ(p.cpu_expert_bytes, 48 * (128 - nh) * 3 * I * H * 2);  // bf16, 768 and 2048 need no padding
  EXPECT_EQ(part(p.gpu, "hot expert scratch"), 48 * (T * H * 2 + T * nh * 4 + T * nh * 2 * I * 4 + T * nh * I * 2));
  EXPECT_EQ(part(p.gpu, "non-expert weights"), m.non_expert_bytes);
  const uint64_t dout = c.gpu.deferred_experts > 0 ? T * H * 4 : 0;
  EXPECT_EQ(part(p.ram, "pinned buffers"),
            uint64_t(c.buffers.pinned_slots) * (T * H * 2 + 3 * T * K * 4 + T * K * 4 + T * H * 4 + dout));
  std::printf("[ estimate ] qwen3-30b-a3b.yaml on cuda: GPU %.1f GiB (hot experts %.1f, scratch for %llu tokens %.1f), "
              "RAM %.1f GiB\n", p.gpu_bytes() / double(1ull << 30), p.hot_expert_bytes / double(1ull << 30),
              (unsigned long long)T, part(p.gpu, "hot expert scratch") / double(1ull << 30),
              p.ram_bytes() / double(1ull << 30));
}

}  // namespace
}  // namespace tandem
