// GGUF's block types as expert sources (issue 19): Q4_0 (a Q4Source of layout ggml_q4_0,
// packed into int4 groups of 32 by copying), Q8_0 and Q4_1 (SourceType ggml_q8_0 / ggml_q4_1,
// decoded exactly), and checkpoints made from a GGUF reader's tensor table
// (Checkpoint::from_tables). The reference is each type's formula written out here from
// llama.cpp's block layouts: Q4_0 w = d * (q - 8), Q8_0 w = d * q, Q4_1 w = d * q + m, with
// weight j of a 4-bit block in byte j % 16, low nibble for j < 16.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tandem/error.h"
#include "tandem/experts.h"
#include "tandem/kernels.h"
#include "tandem/safetensors.h"
#include "test_util.h"

namespace tandem {
namespace {

using test::test_seed;

enum class Block { q4_0, q8_0, q4_1 };

int block_bytes_of(Block b) { return b == Block::q4_0 ? 18 : b == Block::q8_0 ? 34 : 20; }

// One weight [n x k] in a block type: its bytes (rows of k / 32 blocks) and its values.
struct Blocks {
  Block type;
  int n, k;
  std::string bytes;
  std::vector<float> w;
  Blocks(std::mt19937_64& rng, Block t, int n_, int k_) : type(t), n(n_), k(k_), w(size_t(n_) * k_) {
    std::uniform_real_distribution<float> scale(-3e-2f, 3e-2f), lo(-0.2f, 0.0f);
    std::uniform_int_distribution<int> nib(0, 15), i8(-128, 127);
    for (int r = 0; r < n; ++r)
      for (int b = 0; b < k / 32; ++b) {
        std::string blk(size_t(block_bytes_of(t)), '\0');
        const uint16_t d = fp32_to_fp16(scale(rng));
        std::memcpy(blk.data(), &d, 2);
        float* out = &w[size_t(r) * k + size_t(b) * 32];
        if (t == Block::q8_0) {
          for (int j = 0; j < 32; ++j) {
            const int q = i8(rng);
            blk[2 + j] = static_cast<char>(static_cast<int8_t>(q));
            out[j] = fp16_to_fp32(d) * float(q);
          }
        } else {
          const int at = t == Block::q4_0 ? 2 : 4;
          const uint16_t m = fp32_to_fp16(lo(rng));
          if (t == Block::q4_1) std::memcpy(blk.data() + 2, &m, 2);
          for (int j = 0; j < 32; ++j) {
            const int q = nib(rng);
            auto& byte = reinterpret_cast<uint8_t&>(blk[at + j % 16]);
            byte = static_cast<uint8_t>(byte | (j < 16 ? q : q << 4));
            out[j] = t == Block::q4_0 ? fp16_to_fp32(d) * float(q - 8) : fp16_to_fp32(d) * float(q) + fp16_to_fp32(m);
          }
        }
        bytes += blk;
      }
  }
  // A view of these bytes (q4: the Q4Source a Q4_0 view needs, kept by the caller).
  WeightView view(Q4Source& q4) const {
    WeightView v;
    v.n = n;
    v.k = k;
    if (type == Block::q4_0) {
      q4.layout = Q4Source::Layout::ggml_q4_0;
      q4.qweight = q4.scales = reinterpret_cast<const std::byte*>(bytes.data());
      q4.n = n;
      q4.k = k;
      q4.group = 32;
      v.type = SourceType::q4_gptq;
      v.data = q4.qweight;
      v.q4 = &q4;
    } else {
      v.type = type == Block::q8_0 ? SourceType::ggml_q8_0 : SourceType::ggml_q4_1;
      v.data = bytes.data();
    }
    return v;
  }
};

const char* name_of(Block b) { return b == Block::q4_0 ? "Q4_0" : b == Block::q8_0 ? "Q8_0" : "Q4_1"; }

TEST(GgufBlocks, DecodeToTheFormulasValues) {
  std::mt19937_64 rng(test_seed());
  for (Block t : {Block::q4_0, Block::q8_0, Block::q4_1}) {
    SCOPED_TRACE(name_of(t));
    const Blocks b(rng, t, 24, 128);
    Q4Source q4;
    const WeightView v = b.view(q4);
    std::vector<float> rows(size_t(b.n) * b.k);
    decode_rows(v, 0, b.n, rows.data());
    ASSERT_EQ(rows, b.w);
    // A sub-view (whole blocks) decodes the same elements; a cut through a block is refused.
    const WeightView sub = sub_view(v, 5, 7, 32, 64);
    std::vector<float> part(size_t(7) * 64);
    decode_rows(sub, 0, 7, part.data());
    for (int r = 0; r < 7; ++r)
      for (int c = 0; c < 64; ++c) ASSERT_EQ(part[size_t(r) * 64 + c], b.w[size_t(5 + r) * b.k + 32 + c]);
    if (t != Block::q4_0) EXPECT_THROW(sub_view(v, 0, 1, 16, 32), Error);
  }
}

TEST(GgufBlocks, PacksHoldTheirValues) {
  std::mt19937_64 rng(test_seed());
  for (Block t : {Block::q4_0, Block::q8_0, Block::q4_1}) {
    SCOPED_TRACE(name_of(t));
    const Blocks b(rng, t, 72, 256);
    Q4Source q4;
    const WeightView v = b.view(q4);
    // bf16 rounds each value once: exactly the bf16 pack of the decoded values.
    EXPECT_EQ(unpack(pack(v, {WeightFormat::bf16})), unpack(pack({b.w.data(), SourceType::f32, b.n, b.k}, {})));
    // int8 quantizes the decoded values: the same pack as from them.
    const PackOptions i8{WeightFormat::int8};
    EXPECT_EQ(unpack(pack(v, i8)), unpack(pack({b.w.data(), SourceType::f32, b.n, b.k}, i8)));
  }
  // Q4_0 into int4 groups of 32 copies nibbles and scales: the pack holds the file's values.
  const Blocks b(rng, Block::q4_0, 72, 256);
  Q4Source q4;
  EXPECT_EQ(unpack(pack(b.view(q4), {WeightFormat::int4, 32, true})), b.w);
}

TEST(GgufBlocks, FromTablesChecksEveryRange) {
  test::ScratchDir dir;
  std::mt19937_64 rng(test_seed());
  const Blocks q4(rng, Block::q4_0, 8, 64), q8(rng, Block::q8_0, 8, 64);
  const std::string header(100, 'h');  // stands for GGUF's header
  test::write_file(dir / "m.gguf", header + q4.bytes + std::string(12, '\0') + q8.bytes + "tail");
  const uint64_t a = header.size(), b = a + q4.bytes.size() + 12;
  auto table = [&](std::vector<TensorInfo> t) { return std::vector<std::vector<TensorInfo>>{std::move(t)}; };
  const TensorInfo t4{"a.weight", Dtype::Q4_0, {8, 64}, a, a + q4.bytes.size()};
  const TensorInfo t8{"b.weight", Dtype::Q8_0, {8, 64}, b, b + q8.bytes.size()};
  const Checkpoint c = Checkpoint::from_tables(dir.path(), {dir / "m.gguf"}, table({t8, t4}), "GGUF");
  EXPECT_EQ(c.names(), (std::vector<std::string>{"a.weight", "b.weight"}));
  EXPECT_EQ(std::memcmp(c.tensor("b.weight").data, q8.bytes.data(), q8.bytes.size()), 0);
  EXPECT_EQ(c.file(0).header().header_bytes, a);  // what a store fingerprints
  auto refused = [&](std::vector<TensorInfo> t, const std::string& what) {
    try {
      Checkpoint::from_tables(dir.path(), {dir / "m.gguf"}, table(std::move(t)), "GGUF");
      ADD_FAILURE() << "accepted: " << what;
    } catch (const Error& e) {
      EXPECT_NE(e.message().find(what), std::string::npos) << e.message();
    }
  };
  TensorInfo past = t8;
  past.end += 100;
  refused({t4, past}, "tensor 'b.weight' at bytes [");
  TensorInfo wide = t4;
  wide.shape = {8, 96};
  refused({wide}, "shape [8, 96] of Q4_0 needs 432 bytes, the file gives it 288");
  TensorInfo cut = t4;
  cut.shape = {16, 36};
  refused({cut}, "needs whole blocks of 32");
  TensorInfo over = t8;
  over.name = "c.weight";
  over.begin = t4.end - 18;
  over.end = over.begin + q8.bytes.size();
  refused({t4, over}, "tensors 'a.weight' and 'c.weight' overlap");
  TensorInfo twice = t8;
  twice.name = "a.weight";
  refused({t4, twice}, "tensor 'a.weight' appears twice");
  // GGML (a type the C++ side never decodes): any byte count.
  TensorInfo other{"c.weight", Dtype::GGML, {3, 5}, b, b + 7};
  EXPECT_NO_THROW(Checkpoint::from_tables(dir.path(), {dir / "m.gguf"}, table({t4, other}), "GGUF"));
}

// A layer's experts as a GGUF file holds them: gate, up [E, I, H] and down [E, H, I], each
// one tensor of every expert, read through the separate fused naming.
TEST(GgufBlocks, ExpertsOfEveryBlockTypeReadInPlace) {
  test::ScratchDir dir;
  std::mt19937_64 rng(test_seed());
  const int E = 3, H = 64, I = 32;
  const Blocks gate(rng, Block::q4_0, E * I, H), up(rng, Block::q8_0, E * I, H), down(rng, Block::q4_1, E * H, I);
  test::write_file(dir / "m.gguf", std::string(64, 'h') + gate.bytes + up.bytes + down.bytes);
  uint64_t at = 64;
  auto next = [&](const char* name, Dtype d, std::vector<int64_t> shape, const Blocks& b) {
    TensorInfo t{name, d, std::move(shape), at, at + b.bytes.size()};
    at = t.end;
    return t;
  };
  std::vector<TensorInfo> t;
  t.push_back(next("model.layers.0.mlp.experts.gate_proj", Dtype::Q4_0, {E, I, H}, gate));
  t.push_back(next("model.layers.0.mlp.experts.up_proj", Dtype::Q8_0, {E, I, H}, up));
  t.push_back(next("model.layers.0.mlp.experts.down_proj", Dtype::Q4_1, {E, H, I}, down));
  const Checkpoint c = Checkpoint::from_tables(dir.path(), {dir / "m.gguf"}, {t}, "GGUF");
  const ExpertNaming naming{"model.layers.{L}.mlp.experts.gate_proj", "model.layers.{L}.mlp.experts.up_proj",
                            "model.layers.{L}.mlp.experts.down_proj"};
  ASSERT_TRUE(naming.fused());
  const MoeShape shape{E, H, I};
  for (int e = 0; e < E; ++e) {
    const ExpertSource s = checkpoint_expert(c, 0, e, naming, shape);
    for (const auto& [v, b, rows, cols] : {std::tuple{&s.gate, &gate, I, H}, std::tuple{&s.up, &up, I, H},
                                           std::tuple{&s.down, &down, H, I}}) {
      std::vector<float> got(size_t(rows) * cols);
      decode_rows(*v, 0, rows, got.data());
      ASSERT_EQ(0, std::memcmp(got.data(), b->w.data() + size_t(e) * rows * cols, got.size() * 4)) << "expert " << e;
    }
    // The Q4_0 gate packs into int4 groups of 32 by copying.
    EXPECT_EQ(unpack(pack(s.gate, {WeightFormat::int4, 32, true})),
              std::vector<float>(gate.w.begin() + size_t(e) * I * H, gate.w.begin() + size_t(e + 1) * I * H));
  }
  // A layer's tensor of another shape is refused naming it.
  t[2].shape = {E, I, H};
  const Checkpoint wrong = Checkpoint::from_tables(dir.path(), {dir / "m.gguf"}, {t}, "GGUF");
  try {
    checkpoint_expert(wrong, 0, 0, naming, shape);
    ADD_FAILURE() << "accepted a down tensor of the gate's shape";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("model.layers.0.mlp.experts.down_proj has shape [3, 32, 64]"), std::string::npos)
        << e.message();
  }
}

}  // namespace
}  // namespace tandem
