// The packed expert store (expert_store.h) and the column cuts it relies on (pack_cols,
// slice_cols, column_bytes in kernels.h).
//
// The store's contract is exactness: an engine loaded from a store holds, byte for byte,
// the packs an engine packing the checkpoint holds, whatever its subpool count, so every
// output is bit-identical too (the packing path itself is checked against fp64 references
// in test_engine.cpp and test_moe.cpp). The rest is refusal: every broken, foreign, stale or
// unfinished store fails naming the file and the field, and a failed conversion leaves
// nothing that loads.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "tandem/engine.h"
#include "tandem/error.h"
#include "tandem/expert_store.h"
#include "tandem/safetensors.h"
#include "test_util.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;
using test::test_seed;

bool same_bytes(const PackedWeight& a, const PackedWeight& b) {
  return a.bytes() == b.bytes() && a.panel_stride == b.panel_stride && a.panels == b.panels && a.k_pad == b.k_pad &&
         (a.bytes() == 0 || std::memcmp(a.data.data(), b.data.data(), a.bytes()) == 0);
}

std::vector<PackOptions> all_formats() {
  std::vector<PackOptions> f = {{WeightFormat::bf16}, {WeightFormat::int8}};
  for (int g : {32, 64, 128})
    for (bool sym : {true, false}) f.push_back({WeightFormat::int4, g, sym});
  f.push_back(pack_options("mxfp4", 32, false));
  return f;
}

std::string name_of(const PackOptions& o) {
  return std::string(format_name(o)) +
         (o.format == WeightFormat::int4 && !o.e2m1 ? "-g" + std::to_string(o.group) + (o.symmetric ? "" : "-zp") : "");
}

// ---- column cuts ---------------------------------------------------------------------

// A column range of a pack, cut from the whole pack, is the pack of those columns (int8 with
// whole-row scales); for bf16 and int4 that is also what packing the sub-view gives.
TEST(PackCols, EqualsTheColumnsOfTheWholePack) {
  std::mt19937_64 rng(test_seed());
  std::normal_distribution<float> nd(0.f, 1.f);
  const int n = 100, k = 384;  // a partial last panel
  std::vector<float> w(size_t(n) * k);
  for (auto& v : w) v = nd(rng);
  for (int r = 0; r < n; ++r) w[size_t(r) * k + (r * 37) % k] *= 9.0f;  // row maxima in different column ranges
  const WeightView view{w.data(), SourceType::f32, n, k};
  for (const PackOptions& o : all_formats()) {
    SCOPED_TRACE(name_of(o));
    const PackedWeight whole = pack(view, o);
    const int unit = std::max(column_unit(o), o.format == WeightFormat::int4 ? o.group : 64);
    for (int c0 = 0; c0 < k; c0 += unit)
      for (int c1 = c0 + unit; c1 <= k; c1 += unit) {
        const PackedWeight cut = slice_cols(whole, c0, c1 - c0);
        const PackedWeight direct = pack_cols(view, c0, c1 - c0, o);
        ASSERT_TRUE(same_bytes(cut, direct)) << "columns [" << c0 << ", " << c1 << ")";
        if (o.format != WeightFormat::int8) {
          const PackedWeight sub = pack(sub_view(view, 0, n, c0, c1 - c0), o);
          ASSERT_TRUE(same_bytes(cut, sub)) << "columns [" << c0 << ", " << c1 << ")";
        }
      }
  }
  // int8: the scales are the whole row's, so the cut's dequantized values equal the whole's.
  const PackOptions i8{WeightFormat::int8};
  const std::vector<float> full = unpack(pack(view, i8)), part = unpack(pack_cols(view, 128, 128, i8));
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < 128; ++c) ASSERT_EQ(part[size_t(r) * 128 + c], full[size_t(r) * k + 128 + c]);
}

TEST(PackCols, RefusesCutsOffTheUnitAndNonFiniteRows) {
  std::vector<float> w(size_t(64) * 256, 0.5f);
  const WeightView view{w.data(), SourceType::f32, 64, 256};
  EXPECT_NE(test::error_of([&] { pack_cols(view, 32, 64, {WeightFormat::int8}); }).find("column unit 64"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { pack_cols(view, 32, 64, {WeightFormat::int4, 64}); }).find("column unit 64"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { pack_cols(view, 192, 128, {WeightFormat::bf16}); }).find("outside"), std::string::npos);
  // A NaN outside the columns still decides the row's int8 scale: refused, naming it.
  w[size_t(3) * 256 + 10] = std::nanf("");
  const std::string msg = test::error_of([&] { pack_cols(view, 128, 128, {WeightFormat::int8}); });
  EXPECT_NE(msg.find("[3, 10]"), std::string::npos) << msg;
}

// ---- a model: checkpoint, engines ----------------------------------------------------------

constexpr int kE = 6, kH = 128, kI = 256, kK = 3, kTokens = 11;
const std::vector<int> kLayers = {0, 2};

std::string key(int layer, int e, const char* proj) {
  return "model.layers." + std::to_string(layer) + ".mlp.experts." + std::to_string(e) + "." + proj + "_proj.weight";
}

// Random bf16 experts (and one dense tensor), as Qwen3 names them; intermediate size `inter`.
std::vector<test::Entry> entries(uint64_t seed, int inter = kI) {
  const int kI = inter;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  auto tensor = [&](size_t n, float sc) {
    std::vector<bf16_t> b(n);
    for (auto& v : b) v = fp32_to_bf16(nd(rng) * sc);
    return std::string(reinterpret_cast<const char*>(b.data()), b.size() * 2);
  };
  std::vector<test::Entry> out;
  out.push_back({"model.embed_tokens.weight", "BF16", {4, kH}, tensor(size_t(4) * kH, 1.f)});
  for (int l : kLayers)
    for (int e = 0; e < kE; ++e) {
      out.push_back({key(l, e, "gate"), "BF16", {kI, kH}, tensor(size_t(kI) * kH, 0.2f)});
      out.push_back({key(l, e, "up"), "BF16", {kI, kH}, tensor(size_t(kI) * kH, 0.2f)});
      out.push_back({key(l, e, "down"), "BF16", {kH, kI}, tensor(size_t(kH) * kI, 0.1f)});
    }
  return out;
}

void write_checkpoint(const fs::path& file, const std::vector<test::Entry>& es) {
  test::write_file(file, test::good_file(es));
}

Config config(const PackOptions& o, int subpools, const std::string& gpu = "") {
  std::string cpu = "format: " + std::string(format_name(o));
  if (o.format == WeightFormat::int4 && !o.e2m1)
    cpu += ", group_size: " + std::to_string(o.group) + ", zero_point: " + (o.symmetric ? "false" : "true");
  return parse_config("version: 1\ncpu: {" + cpu + ", virtual_subpools: " + std::to_string(subpools) +
                          ", threads: 1}\ngpu: {device: none" + gpu + "}\n",
                      "store.yaml");
}

StoreSpec store_spec(const PackOptions& o, int inter = kI) { return {{kE, kH, inter}, kLayers, o, ExpertNaming::qwen3()}; }
EngineSpec engine_spec(int inter = kI) { return {{kE, kH, inter}, kLayers}; }

// Runs both MoE layers of an engine on one fixed batch; the outputs concatenated.
std::vector<float> run(Engine& e, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> uw(0.05f, 1.f);
  std::vector<float> all;
  for (int i = 0; i < e.moe_layers(); ++i) {
    std::vector<float> x(size_t(kTokens) * kH), w(size_t(kTokens) * kK), out(x.size(), std::nanf(""));
    std::vector<int32_t> ids(size_t(kTokens) * kK);
    for (auto& v : x) v = nd(rng);
    for (int t = 0; t < kTokens; ++t)
      for (int k = 0; k < kK; ++k) {
        ids[size_t(t) * kK + k] = (t + 2 * k) % kE;
        w[size_t(t) * kK + k] = uw(rng);
      }
    e.forward(i, {x.data(), XType::f32, kTokens, ids.data(), false, w.data(), kK, out.data()});
    e.synchronize();
    all.insert(all.end(), out.begin(), out.end());
  }
  return all;
}

struct Model {
  test::ScratchDir dir;
  fs::path file = dir / "model.safetensors";
  uint64_t seed = test_seed();
  explicit Model(int inter = kI) { write_checkpoint(file, entries(seed, inter)); }
  Checkpoint open() const { return Checkpoint::open(file); }
  fs::path store(const PackOptions& o) const { return dir / store_dir_name(o); }
};

// ---- round trips -----------------------------------------------------------------------------

// Converted once per format; loaded by engines of 1, 2 and 3 subpools (3: one slice empty
// for 64-wide units, uneven ones otherwise), each against the same engine packing the
// checkpoint: every pack and every output equal.
TEST(ExpertStore, LoadsTheVeryPacksOfTheCheckpointAtAnySubpoolCount) {
  // 256, and a ragged 200 (bf16, int8: a partial last panel and column range) or 192 (int4
  // of groups 32 and 64: three 64-wide units over two or three subpools).
  for (const int inter : {kI, 200, 192})
  for (const PackOptions& o : all_formats()) {
    if (inter == 200 && o.format == WeightFormat::int4) continue;
    if (inter == 192 && (o.format != WeightFormat::int4 || o.group == 128)) continue;
    SCOPED_TRACE(name_of(o) + ", intermediate " + std::to_string(inter));
    Model m(inter);
    const Checkpoint ckpt = m.open();
    int reported = -1, total = -1;
    const ConvertReport rep =
        convert_experts(ckpt, store_spec(o, inter), m.store(o), [&](int d, int t) { reported = d, total = t; });
    EXPECT_EQ(rep.layers_written, 2);
    EXPECT_EQ(rep.layers_kept, 0);
    EXPECT_EQ(reported, kE * 2);
    EXPECT_EQ(total, kE * 2);
    const ExpertStore store = ExpertStore::open(m.store(o));
    EXPECT_EQ(store.bytes(), rep.bytes);
    store.check(store_spec(o, inter), ckpt);
    store.verify();
    for (int subpools : {1, 2, 3}) {
      SCOPED_TRACE(std::to_string(subpools) + " subpools");
      Engine a(config(o, subpools), engine_spec(inter)), b(config(o, subpools), engine_spec(inter));
      a.load(ckpt, ExpertNaming::qwen3());
      b.load_store(store, ckpt, ExpertNaming::qwen3());
      ASSERT_TRUE(b.loaded());
      EXPECT_EQ(a.cpu_bytes(), b.cpu_bytes());
      for (int i = 0; i < 2; ++i)
        for (int s = 0; s < subpools; ++s)
          for (int e = 0; e < kE; ++e) {
            ASSERT_TRUE(same_bytes(a.layer(i).gate_up_pack(s, e), b.layer(i).gate_up_pack(s, e)))
                << "gate_up, layer " << i << " subpool " << s << " expert " << e;
            ASSERT_TRUE(same_bytes(a.layer(i).down_pack(s, e), b.layer(i).down_pack(s, e)))
                << "down, layer " << i << " subpool " << s << " expert " << e;
          }
      const std::vector<float> ya = run(a, m.seed + 1), yb = run(b, m.seed + 1);
      ASSERT_EQ(std::memcmp(ya.data(), yb.data(), ya.size() * 4), 0);
      for (float v : yb) ASSERT_TRUE(std::isfinite(v));
    }
  }
}

// int8 row scales span the whole row however the down projection is split, so the engine's
// numbers do not depend on the subpool (NUMA node) count.
TEST(ExpertStore, Int8ResultsDoNotDependOnTheSubpoolCount) {
  Model m;
  const Checkpoint ckpt = m.open();
  const PackOptions o{WeightFormat::int8};
  Engine one(config(o, 1), engine_spec()), two(config(o, 2), engine_spec());
  one.load(ckpt, ExpertNaming::qwen3());
  two.load(ckpt, ExpertNaming::qwen3());
  for (int e = 0; e < kE; ++e) {
    const PackedWeight& whole = one.layer(0).down_pack(0, e);
    EXPECT_TRUE(same_bytes(two.layer(0).down_pack(0, e), slice_cols(whole, 0, kI / 2))) << "expert " << e;
    EXPECT_TRUE(same_bytes(two.layer(0).down_pack(1, e), slice_cols(whole, kI / 2, kI / 2))) << "expert " << e;
  }
}

// Hot experts come from the checkpoint (the device wants the source's values); the cold ones
// from the store, and the result is the packing engine's.
TEST(ExpertStore, HotExpertsLoadFromTheCheckpoint) {
  Model m;
  const Checkpoint ckpt = m.open();
  const PackOptions o{WeightFormat::int4, 64, true};
  convert_experts(ckpt, store_spec(o), m.store(o));
  const ExpertStore store = ExpertStore::open(m.store(o));
  const std::string hot = ", hot_experts: {layers: {0: [1, 4], 2: [0]}}";
  Engine a(config(o, 2, hot), engine_spec()), b(config(o, 2, hot), engine_spec());
  a.load(ckpt, ExpertNaming::qwen3());
  int last = -1, of = -1;
  b.load_store(store, ckpt, ExpertNaming::qwen3(), [&](int d, int t) { last = d, of = t; });
  EXPECT_EQ(last, kE * 2);
  EXPECT_EQ(of, kE * 2);
  EXPECT_EQ(b.hot(0), (std::vector<int>{1, 4}));
  EXPECT_TRUE(b.layer(0).excluded(4));
  EXPECT_EQ(a.cpu_bytes(), b.cpu_bytes());
  EXPECT_EQ(a.device_bytes(), b.device_bytes());
  const std::vector<float> ya = run(a, 7), yb = run(b, 7);
  ASSERT_EQ(std::memcmp(ya.data(), yb.data(), ya.size() * 4), 0);
}

// ---- unfinished and resumed conversions ---------------------------------------------------------

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(ExpertStore, AnInterruptedConversionNeverLoadsAndResumes) {
  Model m;
  const Checkpoint ckpt = m.open();
  const PackOptions o{WeightFormat::int8};
  const fs::path dir = m.store(o);
  convert_experts(ckpt, store_spec(o), dir);
  const std::string layer0 = read_all(dir / "layer-0000.tpk"), layer2 = read_all(dir / "layer-0002.tpk");
  // What a kill after layer 0 leaves: layer 0 finished, layer 2 half written, no manifest.
  fs::remove(dir / "manifest.json");
  fs::remove(dir / "layer-0002.tpk");
  test::write_file(dir / "layer-0002.tpk.tmp.12345", layer2.substr(0, 5000));
  std::string msg = test::error_of([&] { ExpertStore::open(dir); });
  EXPECT_NE(msg.find("did not finish"), std::string::npos) << msg;
  EXPECT_NE(msg.find("manifest.json"), std::string::npos) << msg;

  const ConvertReport rep = convert_experts(ckpt, store_spec(o), dir);
  EXPECT_EQ(rep.layers_kept, 1);
  EXPECT_EQ(rep.layers_written, 1);
  EXPECT_FALSE(fs::exists(dir / "layer-0002.tpk.tmp.12345"));
  EXPECT_EQ(read_all(dir / "layer-0000.tpk"), layer0);
  EXPECT_EQ(read_all(dir / "layer-0002.tpk"), layer2);  // the same bytes as an uninterrupted run
  ExpertStore::open(dir).verify();

  // Once finished, converting again does nothing.
  const ConvertReport again = convert_experts(ckpt, store_spec(o), dir);
  EXPECT_TRUE(again.up_to_date);
  EXPECT_EQ(again.layers_written, 0);

  // A finished store of another format is never overwritten.
  msg = test::error_of([&] { convert_experts(ckpt, store_spec({WeightFormat::bf16}), dir); });
  EXPECT_NE(msg.find("already holds a finished store"), std::string::npos) << msg;
  EXPECT_NE(msg.find("format"), std::string::npos) << msg;
  EXPECT_EQ(read_all(dir / "layer-0000.tpk"), layer0);

  // A directory that was never a store.
  fs::create_directories(m.dir / "empty");
  msg = test::error_of([&] { ExpertStore::open(m.dir / "empty"); });
  EXPECT_NE(msg.find("not a tandem expert store"), std::string::npos) << msg;
}

// A finished store that no longer loads is finished again by converting again: a truncated
// layer file is rewritten, the rest kept; a changed checkpoint rewrites every layer. The store
// of a checkpoint elsewhere is never replaced, and two conversions never share a directory.
TEST(ExpertStore, ConvertingAgainRepairsAStaleStore) {
  Model m;
  const PackOptions o{WeightFormat::int8};
  const fs::path dir = m.store(o);
  {
    const Checkpoint ckpt = m.open();
    convert_experts(ckpt, store_spec(o), dir);
    const std::string layer2 = read_all(dir / "layer-0002.tpk");
    test::write_file(dir / "layer-0002.tpk", layer2.substr(0, 9000));
    const ConvertReport rep = convert_experts(ckpt, store_spec(o), dir);
    EXPECT_NE(rep.replaced.find("truncated"), std::string::npos) << rep.replaced;
    EXPECT_EQ(rep.layers_kept, 1);
    EXPECT_EQ(rep.layers_written, 1);
    EXPECT_EQ(read_all(dir / "layer-0002.tpk"), layer2);
    // Another conversion holding the directory.
    const int fd = ::open((dir / ".convert.lock").c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::flock(fd, LOCK_EX), 0);
    const std::string msg = test::error_of([&] { convert_experts(ckpt, store_spec(o), dir); });
    EXPECT_NE(msg.find("another conversion is writing"), std::string::npos) << msg;
    ::close(fd);
  }
  auto es = entries(m.seed);
  es[8].bytes[3] ^= 1;  // layer 0, expert 2, up
  write_checkpoint(m.file, es);
  struct timespec ts[2] = {{0, UTIME_NOW}, {2, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, m.file.c_str(), ts, 0), 0);
  {
    const Checkpoint changed = m.open();
    const ConvertReport rep = convert_experts(changed, store_spec(o), dir);
    EXPECT_NE(rep.replaced.find("differ from those"), std::string::npos) << rep.replaced;
    EXPECT_EQ(rep.layers_written, 2);  // the source's times changed: nothing is kept
    ExpertStore::open(dir).check(store_spec(o), changed);
  }
  fs::create_directories(m.dir / "elsewhere");
  write_checkpoint(m.dir / "elsewhere" / "model.safetensors", entries(m.seed + 1));
  const Checkpoint other = Checkpoint::open(m.dir / "elsewhere" / "model.safetensors");
  const std::string msg = test::error_of([&] { convert_experts(other, store_spec(o), dir); });
  EXPECT_NE(msg.find("holds the store of"), std::string::npos) << msg;
  ExpertStore::open(dir).check(store_spec(o), m.open());  // untouched
}

// A disk that fills up mid-conversion (here: a file size limit, the same failed write): the
// error names the file and the cause; no temporary and no manifest stay behind.
TEST(ExpertStore, AWriteFailureLeavesNothingThatLoads) {
  Model m;
  const Checkpoint ckpt = m.open();
  const PackOptions o{WeightFormat::bf16};
  const fs::path dir = m.store(o);
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  const auto prev = ::signal(SIGXFSZ, SIG_IGN);  // the write fails with EFBIG instead of a signal
  rlimit small = old;
  small.rlim_cur = 300 << 10;  // a layer file is about 1.2 MB
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string msg;
  try {
    convert_experts(ckpt, store_spec(o), dir);
  } catch (const Error& e) {
    msg = e.message();
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, prev);
  EXPECT_NE(msg.find("layer-0000.tpk"), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::strerror(EFBIG)), std::string::npos) << msg;
  for (const auto& entry : fs::directory_iterator(dir))  // the (empty) lock file may stay
    if (entry.path().filename() != ".convert.lock") ADD_FAILURE() << "left behind: " << entry.path();
  EXPECT_NE(test::error_of([&] { ExpertStore::open(dir); }).find("manifest.json"), std::string::npos);
}

// ---- refusals ---------------------------------------------------------------------------------

TEST(ExpertStore, RefusesBrokenForeignAndStaleStores) {
  Model m;
  const PackOptions o{WeightFormat::int4, 128, true};
  const fs::path dir = m.store(o);
  {
    const Checkpoint ckpt = m.open();
    convert_experts(ckpt, store_spec(o), dir);
    const ExpertStore store = ExpertStore::open(dir);
    // Another format, group, zero point, shape or layer list: the field is named.
    auto refused = [&](StoreSpec want, const std::string& field) {
      const std::string msg = test::error_of([&] { store.check(want, ckpt); });
      EXPECT_NE(msg.find(field), std::string::npos) << msg;
      EXPECT_NE(msg.find("does not hold these experts"), std::string::npos) << msg;
    };
    refused(store_spec({WeightFormat::int8}), "format");
    refused(store_spec({WeightFormat::int4, 64, true}), "group");
    refused(store_spec({WeightFormat::int4, 128, false}), "zero_point");
    StoreSpec s = store_spec(o);
    s.layers = {0, 1};
    refused(s, "layers");
    s = store_spec(o);
    s.naming = ExpertNaming::mixtral();
    refused(s, "naming");
  }
  const std::string manifest = read_all(dir / "manifest.json"), layer2 = read_all(dir / "layer-0002.tpk");

  // Truncated and padded layer files; a file from another conversion; bit rot.
  test::write_file(dir / "layer-0002.tpk", layer2.substr(0, layer2.size() - 4096));
  std::string msg = test::error_of([&] { ExpertStore::open(dir); });
  EXPECT_NE(msg.find("layer-0002.tpk"), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  test::write_file(dir / "layer-0002.tpk", layer2 + std::string(8, 'x'));
  msg = test::error_of([&] { ExpertStore::open(dir); });
  EXPECT_NE(msg.find("the manifest says"), std::string::npos) << msg;
  test::write_file(dir / "layer-0002.tpk", read_all(dir / "layer-0000.tpk"));
  msg = test::error_of([&] { ExpertStore::open(dir); });
  EXPECT_NE(msg.find("header field 'layer'"), std::string::npos) << msg;
  std::string rotten = layer2;
  rotten[rotten.size() / 2] ^= 0x10;
  test::write_file(dir / "layer-0002.tpk", rotten);
  msg = test::error_of([&] { ExpertStore::open(dir).verify(); });
  EXPECT_NE(msg.find("layer-0002.tpk"), std::string::npos) << msg;
  EXPECT_NE(msg.find("contents differ"), std::string::npos) << msg;
  test::write_file(dir / "layer-0002.tpk", layer2);

  // A manifest that is not JSON, lacks a field, or comes from another pack version.
  test::write_file(dir / "manifest.json", manifest.substr(0, manifest.size() / 2));
  msg = test::error_of([&] { ExpertStore::open(dir); });
  EXPECT_NE(msg.find("not valid JSON"), std::string::npos) << msg;
  std::string edited = manifest;
  edited.replace(edited.find("\"pack_version\""), 14, "\"pack_versioX\"");
  test::write_file(dir / "manifest.json", edited);
  msg = test::error_of([&] { ExpertStore::open(dir); });
  EXPECT_NE(msg.find("has no 'pack_version'"), std::string::npos) << msg;
  edited = manifest;
  const size_t at = edited.find("\"pack_version\": ") + 16;
  edited.replace(at, 1, "7");
  test::write_file(dir / "manifest.json", edited);
  msg = test::error_of([&] { ExpertStore::open(dir); });
  EXPECT_NE(msg.find("pack version 7"), std::string::npos) << msg;
  test::write_file(dir / "manifest.json", manifest);
  ExpertStore::open(dir);

  // The source changed: one weight edited in place (same size and header, new mtime), then
  // a tensor list that differs, then another model's file name.
  auto es = entries(m.seed);
  es[5].bytes[10] ^= 1;  // layer 0, expert 1, up
  write_checkpoint(m.file, es);
  {
    struct timespec ts[2] = {{0, UTIME_NOW}, {1, 0}};  // an mtime that differs from the store's for sure
    ASSERT_EQ(::utimensat(AT_FDCWD, m.file.c_str(), ts, 0), 0);
    const Checkpoint changed = m.open();
    msg = test::error_of([&] { ExpertStore::open(dir).check(store_spec(o), changed); });
    EXPECT_NE(msg.find("model layer 0's expert tensors"), std::string::npos) << msg;
    EXPECT_NE(msg.find("convert again"), std::string::npos) << msg;
  }
  es = entries(m.seed);
  write_checkpoint(m.file, es);
  {
    // The original bytes again, with a new mtime: the contents decide, and they match.
    const Checkpoint same = m.open();
    ExpertStore::open(dir).check(store_spec(o), same);
  }
  es.push_back({"lm_head.weight", "BF16", {4, kH}, std::string(size_t(8) * kH, '\0')});
  write_checkpoint(m.file, es);
  {
    const Checkpoint grown = m.open();
    msg = test::error_of([&] { ExpertStore::open(dir).check(store_spec(o), grown); });
    EXPECT_NE(msg.find("model.safetensors changed"), std::string::npos) << msg;
  }
  fs::create_directories(m.dir / "other");
  write_checkpoint(m.dir / "other" / "other.safetensors", entries(m.seed));
  {
    const Checkpoint foreign = Checkpoint::open(m.dir / "other" / "other.safetensors");
    msg = test::error_of([&] { ExpertStore::open(dir).check(store_spec(o), foreign); });
    EXPECT_NE(msg.find("model.safetensors"), std::string::npos) << msg;
    EXPECT_NE(msg.find("another model"), std::string::npos) << msg;
  }
}

// An engine refuses a store for another shape or format before reading anything.
TEST(ExpertStore, TheEngineRefusesAStoreForOtherExperts) {
  Model m;
  const Checkpoint ckpt = m.open();
  const PackOptions o{WeightFormat::int8};
  convert_experts(ckpt, store_spec(o), m.store(o));
  const ExpertStore store = ExpertStore::open(m.store(o));
  Engine bf(config({WeightFormat::bf16}, 1), engine_spec());
  std::string msg = test::error_of([&] { bf.load_store(store, ckpt, ExpertNaming::qwen3()); });
  EXPECT_NE(msg.find("holds other experts"), std::string::npos) << msg;
  EXPECT_FALSE(bf.loaded(0));
  Engine other(config(o, 1), {{kE, kH, kI}, {0, 1}});
  msg = test::error_of([&] { other.load_store(store, ckpt, ExpertNaming::qwen3()); });
  EXPECT_NE(msg.find("other MoE layers"), std::string::npos) << msg;
}

}  // namespace
}  // namespace tandem
