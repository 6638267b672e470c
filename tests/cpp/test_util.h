// Helpers shared by the C++ tests: scratch directories, files, seeded randomness.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>

#include <map>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "tandem/error.h"
#include "tandem/experts.h"
#include "tandem/kernels.h"

namespace tandem::test {

// Sets (or, with v null, unsets) an environment variable for one scope.
struct ScopedEnv {
  ScopedEnv(const char* k, const char* v) : key(k) {
    if (const char* old = std::getenv(k)) had = true, prev = old;
    if (v) setenv(k, v, 1); else unsetenv(k);
  }
  ~ScopedEnv() {
    if (had) setenv(key, prev.c_str(), 1); else unsetenv(key);
  }
  const char* key;
  bool had = false;
  std::string prev;
};

// A fresh directory per test, removed afterwards.
class ScratchDir {
 public:
  ScratchDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() /
            str_cat("tandem_", ::getpid(), "_", info ? info->test_suite_name() : "x", "_", info ? info->name() : "y");
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() { std::filesystem::remove_all(path_); }
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

inline void write_file(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << p;
}

// The seed for a test's random inputs: TANDEM_TEST_SEED when set (to replay a
// failure), else a fixed default. Printed so every failure can be reproduced.
inline uint64_t test_seed() {
  const char* env = std::getenv("TANDEM_TEST_SEED");
  const uint64_t seed = env ? std::stoull(env) : 20261121ull;
  ::testing::Test::RecordProperty("seed", std::to_string(seed));
  std::printf("[ seed     ] TANDEM_TEST_SEED=%llu\n", static_cast<unsigned long long>(seed));
  return seed;
}

// Runs f and returns the tandem::Error message it throws (fails the test if none).
template <typename F>
std::string error_of(F&& f, Errc* code = nullptr) {
  try {
    f();
  } catch (const Error& e) {
    if (code) *code = e.code();
    return e.message();
  }
  ADD_FAILURE() << "expected a tandem::Error";
  return {};
}

// safetensors files built in memory.
inline std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

// A file from a raw header text and data bytes, optionally lying about the length.
inline std::string raw_file(const std::string& header, const std::string& data, int64_t length = -1) {
  return le64(length < 0 ? header.size() : static_cast<uint64_t>(length)) + header + data;
}

struct Entry {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

// The bad checkpoints every expert loader must refuse by name, made from a good entry
// list: `missing` removed, `reshaped` (bf16) given rows x cols where the layer needs
// need_rows x cols, `retyped` given dtype I16, then (the same tensor) dtype F8_E4M3 without
// its `_scale_inv` block scales. `needle` is what the error must contain.
struct CheckpointDefect {
  std::string what, needle;
  Errc code;
  std::function<void(std::vector<Entry>&)> edit;
};
inline std::vector<CheckpointDefect> checkpoint_defects(const std::string& missing, const std::string& reshaped,
                                                        int64_t rows, int64_t need_rows, int64_t cols,
                                                        const std::string& retyped) {
  auto find = [](std::vector<Entry>& es, const std::string& name) {
    return std::find_if(es.begin(), es.end(), [&](const Entry& x) { return x.name == name; });
  };
  return {
      {"missing", "has no tensor " + missing, Errc::bad_format, [=](auto& es) { es.erase(find(es, missing)); }},
      {"wrong shape",
       str_cat(reshaped, " has shape [", rows, ", ", cols, "], the layer needs [", need_rows, ", ", cols, "]"),
       Errc::bad_format,
       [=](auto& es) {
         auto it = find(es, reshaped);
         it->shape = {rows, cols};
         it->bytes.resize(static_cast<size_t>(rows * cols) * 2);
       }},
      {"wrong dtype", retyped + " has dtype I16", Errc::unsupported, [=](auto& es) { find(es, retyped)->dtype = "I16"; }},
      {"fp8 without its scales", retyped + "_scale_inv (its block scales)", Errc::bad_format,
       [=](auto& es) {
         auto it = find(es, retyped);
         it->dtype = "F8_E4M3";
         it->bytes.resize(it->bytes.size() / 2, '\x38');  // 1.0 in E4M3
       }},
  };
}

// A well-formed file, laid out as the reference writer does (header padded to 8).
inline std::string good_file(const std::vector<Entry>& entries, const std::map<std::string, std::string>& meta = {}) {
  nlohmann::ordered_json h;
  if (!meta.empty()) h["__metadata__"] = meta;
  std::string data;
  for (const auto& e : entries) {
    h[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {data.size(), data.size() + e.bytes.size()}}};
    data += e.bytes;
  }
  std::string text = h.dump();
  while (text.size() % 8) text += ' ';
  return raw_file(text, data);
}

// Kernel arguments for C[m x ldc] = A[m x lda] . W^T, A bf16 or fp32.
inline GemmArgs gemm_args(const bf16_t* a, int m, int lda, float* c, int ldc) {
  GemmArgs g;
  g.a = a;
  g.m = m;
  g.lda = lda;
  g.c = c;
  g.ldc = ldc;
  return g;
}
inline GemmArgs gemm_args(const float* a, int m, int lda, float* c, int ldc) {
  GemmArgs g = gemm_args(static_cast<const bf16_t*>(nullptr), m, lda, c, ldc);
  g.a_f32 = a;
  return g;
}

// n gate and n up biases, N(0, 3) (drawn in pairs, gate then up).
// One expert's fp32 weights in nn.Linear layout (gate, up [inter x hidden], down
// [hidden x inter]) as a weight source, with its fp32 biases when given (gate, up [inter],
// down [hidden]).
inline ExpertSource f32_expert(const float* g, const float* u, const float* d, int hidden, int inter,
                               const float* gate_bias = nullptr, const float* up_bias = nullptr,
                               const float* down_bias = nullptr) {
  ExpertSource src{{g, SourceType::f32, inter, hidden}, {u, SourceType::f32, inter, hidden},
                   {d, SourceType::f32, hidden, inter}};
  if (gate_bias) {
    src.gate_bias = {gate_bias, SourceType::f32, 1, inter};
    src.up_bias = {up_bias, SourceType::f32, 1, inter};
    src.down_bias = {down_bias, SourceType::f32, 1, hidden};
  }
  return src;
}

inline std::pair<std::vector<float>, std::vector<float>> random_biases(int n, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0.f, 3.f);
  std::vector<float> bg(n), bu(n);
  for (int j = 0; j < n; ++j) {
    bg[j] = d(rng);
    bu[j] = d(rng);
  }
  return {std::move(bg), std::move(bu)};
}

// Runs gate_up of variant v on w twice, into h (fp32) and hb (bf16), from bf16 rows a
// (m x lda), outputs n wide, with activation act and the biases (null: none).
inline void gate_up_both(const KernelVariant& v, const PackedWeight& w, const bf16_t* a, int m, int lda,
                         std::vector<float>& h, std::vector<bf16_t>& hb, int n, const GateAct& act = {},
                         const float* gate_bias = nullptr, const float* up_bias = nullptr) {
  h.assign(static_cast<size_t>(m) * n, 0.0f);
  hb.assign(h.size(), 0);
  GateUpArgs args;
  args.act = act;
  args.gate_bias = gate_bias;
  args.up_bias = up_bias;
  args.a = a;
  args.m = m;
  args.lda = lda;
  args.h = h.data();
  args.ldh = n;
  v.gate_up(w, args);
  args.h = nullptr;
  args.h_bf16 = hb.data();
  v.gate_up(w, args);
}

}  // namespace tandem::test
