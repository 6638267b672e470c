// The safetensors reader against valid files and hostile ones. Every rejection
// asserts the exact message a user would see.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "tandem/safetensors.h"
#include "test_util.h"

namespace tandem {
namespace {

using test::error_of;
using test::ScratchDir;
using test::write_file;

using test::Entry;
using test::good_file;
using test::le64;
using test::raw_file;

std::string pattern(size_t n, uint8_t seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(seed + 31 * i);
  return s;
}

class Safetensors : public ::testing::Test {
 protected:
  ScratchDir dir;
  std::string path(const std::string& name = "m.safetensors") const { return (dir / name).string(); }

  // The message SafetensorsFile gives for a file holding `bytes`.
  std::string reject(const std::string& bytes, Errc want = Errc::bad_format) {
    write_file(path(), bytes);
    Errc code{};
    std::string msg = error_of([&] { SafetensorsFile f(path()); }, &code);
    EXPECT_EQ(code, want) << msg;
    // The same bytes through the in-memory parser give the same verdict.
    if (want == Errc::bad_format) {
      std::string direct = error_of([&] {
        parse_safetensors_header({reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()}, path());
      });
      EXPECT_EQ(direct, msg);
    }
    return msg;
  }
};

TEST_F(Safetensors, ReadsEveryDtypeExactly) {
  std::vector<Entry> entries = {
      {"a.f32", "F32", {2, 3}, pattern(24, 1)},    {"b.bf16", "BF16", {4}, pattern(8, 2)},
      {"c.f16", "F16", {1, 1, 3}, pattern(6, 3)},  {"d.fp8", "F8_E4M3", {5}, pattern(5, 4)},
      {"e.i8", "I8", {3}, pattern(3, 5)},          {"f.u8", "U8", {2}, pattern(2, 6)},
      {"g.i32", "I32", {2}, pattern(8, 7)},        {"h.i64", "I64", {1}, pattern(8, 8)},
      {"i.scalar", "F32", {}, pattern(4, 9)},      {"j.empty", "BF16", {0, 7}, ""},
  };
  write_file(path(), good_file(entries, {{"format", "pt"}}));
  SafetensorsFile f(path());
  EXPECT_EQ(f.header().metadata.at("format"), "pt");
  EXPECT_EQ(f.names().size(), entries.size());
  for (const auto& e : entries) {
    TensorView v = f.tensor(e.name);
    EXPECT_EQ(dtype_name(v.info->dtype), e.dtype);
    EXPECT_EQ(v.info->shape, e.shape);
    ASSERT_EQ(v.nbytes, e.bytes.size()) << e.name;
    EXPECT_EQ(std::memcmp(v.data, e.bytes.data(), v.nbytes), 0) << e.name;
  }
  EXPECT_EQ(f.info("a.f32").numel(), 6u);
  EXPECT_EQ(f.info("i.scalar").numel(), 1u);
  EXPECT_EQ(f.info("j.empty").numel(), 0u);
}

TEST_F(Safetensors, MissingTensorNamesKeyFileAndNearest) {
  write_file(path(), good_file({{"model.layers.0.mlp.experts.gate_up_proj", "BF16", {2}, pattern(4, 1)}}));
  SafetensorsFile f(path());
  Errc code{};
  EXPECT_EQ(error_of([&] { f.tensor("model.layers.0.mlp.experts.gate_proj"); }, &code),
            "tensor 'model.layers.0.mlp.experts.gate_proj' not found in '" + path() +
                "' (1 tensors); nearest: 'model.layers.0.mlp.experts.gate_up_proj'");
  EXPECT_EQ(code, Errc::invalid_argument);
  EXPECT_EQ(error_of([&] { f.tensor("zzz"); }), "tensor 'zzz' not found in '" + path() + "' (1 tensors)");
}

TEST_F(Safetensors, RejectsEmptyFile) {
  EXPECT_EQ(reject(""), path() + ": file is 0 bytes; a safetensors file starts with an 8-byte header length");
}

TEST_F(Safetensors, RejectsShortFile) {
  EXPECT_EQ(reject("abc"), path() + ": file is 3 bytes; a safetensors file starts with an 8-byte header length");
}

TEST_F(Safetensors, RejectsHeaderPastEnd) {
  EXPECT_EQ(reject(raw_file("{}", "", 1000)),
            path() + ": header length 1000 runs past the end of the file (10 bytes); the file is truncated or not safetensors");
}

TEST_F(Safetensors, RejectsHugeHeaderLength) {
  EXPECT_EQ(reject(raw_file("{}", "", int64_t(1) << 40)),
            path() + ": header length 1099511627776 exceeds the limit of 100000000 bytes");
  EXPECT_EQ(reject(le64(~0ull) + "{}"),
            path() + ": header length 18446744073709551615 exceeds the limit of 100000000 bytes");
}

TEST_F(Safetensors, RejectsNonJsonHeader) {
  EXPECT_EQ(reject(raw_file("PK\x03\x04", "")),
            path() + ": header does not start with '{' (not a safetensors file?)");
  std::string msg = reject(raw_file("{\"a\": [1, 2", ""));
  EXPECT_EQ(msg.rfind(path() + ": header is not valid JSON: ", 0), 0u) << msg;
}

TEST_F(Safetensors, RejectsDuplicateTensor) {
  EXPECT_EQ(reject(raw_file(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})", "ab")),
            path() + ": header repeats the key 'w'");
}

TEST_F(Safetensors, RejectsUnknownDtype) {
  EXPECT_EQ(reject(raw_file(R"({"w":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}})", "a")),
            path() + ": tensor 'w': unknown dtype 'F4'; known: BOOL, U8, I8, I16, U16, I32, U32, I64, U64, F16, BF16, F32, F64, F8_E4M3, F8_E5M2, F8_E8M0, C64");
}

TEST_F(Safetensors, RejectsBadShapes) {
  EXPECT_EQ(reject(raw_file(R"({"w":{"dtype":"U8","shape":[-2],"data_offsets":[0,0]}})", "")),
            path() + ": tensor 'w': every shape entry must be a non-negative integer, got -2");
  EXPECT_EQ(reject(raw_file(R"({"w":{"dtype":"U8","shape":[1.5],"data_offsets":[0,0]}})", "")),
            path() + ": tensor 'w': every shape entry must be a non-negative integer, got 1.5");
  EXPECT_EQ(reject(raw_file(R"({"w":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", "")),
            path() + ": tensor 'w': shape [4294967296, 4294967296] overflows 64 bits");
  EXPECT_EQ(reject(raw_file(R"({"w":{"dtype":"U8","shape":"3","data_offsets":[0,3]}})", "abc")),
            path() + ": tensor 'w' needs an array 'shape'");
}

TEST_F(Safetensors, RejectsSizeMismatch) {
  EXPECT_EQ(reject(raw_file(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", pattern(20, 1))),
            path() + ": tensor 'w': shape [2, 3] x F32 needs 6 x 4 bytes but data_offsets [0, 20] hold 20");
  // numel x element size overflowing 64 bits must not wrap to a small, matching size.
  EXPECT_EQ(reject(raw_file(R"({"w":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]}})", "")),
            path() + ": tensor 'w': shape [2305843009213693952] x F64 needs 2305843009213693952 x 8 bytes but data_offsets [0, 0] hold 0");
}

TEST_F(Safetensors, RejectsOffsetsOutsideData) {
  EXPECT_EQ(reject(raw_file(R"({"w":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}})", "abcd")),
            path() + ": tensor 'w': data_offsets [0, 8] run past the data section (4 bytes); the file is truncated or corrupt");
  EXPECT_EQ(reject(raw_file(R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[3,2]}})", "abcd")),
            path() + ": tensor 'w': data_offsets [3, 2] end before they begin");
  EXPECT_EQ(reject(raw_file(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}})", "a")),
            path() + ": tensor 'w' needs 'data_offsets' = [begin, end]");
  EXPECT_EQ(reject(raw_file(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[-1,0]}})", "a")),
            path() + ": tensor 'w': data_offsets[0] must be a non-negative integer, got -1");
}

TEST_F(Safetensors, RejectsOverlap) {
  EXPECT_EQ(reject(raw_file(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})", "abcdef")),
            path() + ": tensors 'a' and 'b' overlap (bytes 2..4)");
}

TEST_F(Safetensors, RejectsHoleAndTrailingBytes) {
  EXPECT_EQ(reject(raw_file(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}})", "abcdef")),
            path() + ": bytes 2..4 of the data section belong to no tensor (a hole before 'b')");
  EXPECT_EQ(reject(raw_file(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", "abcdef")),
            path() + ": the data section has 6 bytes but the tensors cover 2 (4 trailing bytes belong to no tensor)");
}

TEST_F(Safetensors, RejectsBadEntries) {
  EXPECT_EQ(reject(raw_file(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"offset":0}})", "a")),
            path() + ": tensor 'w' has unknown field 'offset' (expected dtype, shape, data_offsets)");
  EXPECT_EQ(reject(raw_file(R"({"w":[1,2]})", "")), path() + ": tensor 'w' must be an object");
  EXPECT_EQ(reject(raw_file(R"({"__metadata__":{"format":3}})", "")),
            path() + ": __metadata__['format'] must be a string, got 3");
  EXPECT_EQ(reject(raw_file(R"({"":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "a")),
            path() + ": a tensor has an empty name");
  EXPECT_EQ(reject(raw_file(R"({"w":{"shape":[1],"data_offsets":[0,1]}})", "a")),
            path() + ": tensor 'w' needs a string 'dtype'");
}

TEST_F(Safetensors, RejectsNulInHeader) {
  // Bytes after a NUL would be invisible to the JSON parser and to every check.
  const std::string h = std::string(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})") + '\0' + "HIDDEN";
  EXPECT_EQ(reject(raw_file(h, "a")), path() + ": header holds a NUL byte at offset 61; a safetensors header is UTF-8 JSON padded with spaces");
}

// Deeply nested values in places that end in an error message must not recurse
// (a printed value is described, never dumped whole).
TEST_F(Safetensors, DeepNestingInErrorPaths) {
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  EXPECT_EQ(reject(raw_file(R"({"__metadata__":{"a":)" + deep + "}}", "")),
            path() + ": __metadata__['a'] must be a string, got a JSON array");
  EXPECT_EQ(reject(raw_file(R"({"w":{"dtype":"U8","shape":[)" + deep + R"(],"data_offsets":[0,0]}})", "")),
            path() + ": tensor 'w': every shape entry must be a non-negative integer, got a JSON array");
}

TEST_F(Safetensors, FifoIsRejectedNotWaitedOn) {
  ASSERT_EQ(mkfifo(path().c_str(), 0600), 0);
  Errc code{};
  EXPECT_EQ(error_of([&] { SafetensorsFile f(path()); }, &code), "'" + path() + "' is not a regular file");
  EXPECT_EQ(code, Errc::io);
}

TEST_F(Safetensors, MissingFileIsIoError) {
  Errc code{};
  std::string msg = error_of([&] { SafetensorsFile f(path("nope.safetensors")); }, &code);
  EXPECT_EQ(code, Errc::io);
  EXPECT_EQ(msg, "cannot open '" + path("nope.safetensors") + "': No such file or directory");
}

// Every truncation of a valid file is rejected cleanly (never read out of bounds).
TEST_F(Safetensors, EveryTruncationRejected) {
  const std::string full = good_file({{"a", "F32", {3}, pattern(12, 1)}, {"b", "BF16", {2, 2}, pattern(8, 2)}});
  for (size_t n = 0; n < full.size(); ++n) {
    const std::string cut = full.substr(0, n);
    EXPECT_THROW(parse_safetensors_header({reinterpret_cast<const std::byte*>(cut.data()), cut.size()}, "cut"), Error) << n;
  }
  EXPECT_NO_THROW(parse_safetensors_header({reinterpret_cast<const std::byte*>(full.data()), full.size()}, "full"));
}

// Random single-byte corruptions of a valid file: either rejected with tandem::Error
// or accepted with every tensor inside the file; nothing else.
TEST_F(Safetensors, RandomCorruptionsStayInBounds) {
  const uint64_t seed = test::test_seed();
  std::mt19937_64 rng(seed);
  const std::string full = good_file({{"a", "F32", {3}, pattern(12, 1)}, {"bb", "I64", {2}, pattern(16, 2)}});
  for (int trial = 0; trial < 3000; ++trial) {
    std::string bad = full;
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits; ++e) bad[rng() % bad.size()] = static_cast<char>(rng() & 0xff);
    try {
      auto h = parse_safetensors_header({reinterpret_cast<const std::byte*>(bad.data()), bad.size()}, "x");
      for (const auto& t : h.tensors) ASSERT_LE(h.data_offset + t.end, bad.size()) << "trial " << trial;
    } catch (const Error&) {
    }
  }
}

class Sharded : public Safetensors {
 protected:
  void SetUp() override {
    write_file(dir / "model-00001-of-00002.safetensors", good_file({{"x.a", "F32", {2}, pattern(8, 1)}, {"x.b", "U8", {3}, pattern(3, 2)}}));
    write_file(dir / "model-00002-of-00002.safetensors", good_file({{"x.c", "BF16", {2, 2}, pattern(8, 3)}}));
  }
  void index(const std::string& weight_map) {
    write_file(dir / "model.safetensors.index.json", R"({"metadata":{"total_size":19},"weight_map":)" + weight_map + "}");
  }
  std::string idx() const { return (dir / "model.safetensors.index.json").string(); }
};

TEST_F(Sharded, IndexResolvesEveryTensor) {
  index(R"({"x.a":"model-00001-of-00002.safetensors","x.b":"model-00001-of-00002.safetensors","x.c":"model-00002-of-00002.safetensors"})");
  for (const auto& p : {dir.path(), dir / "model.safetensors.index.json"}) {
    Checkpoint c = Checkpoint::open(p);
    EXPECT_EQ(c.num_files(), 2u);
    EXPECT_EQ(c.names(), (std::vector<std::string>{"x.a", "x.b", "x.c"}));
    TensorView v = c.tensor("x.c");
    EXPECT_EQ(std::memcmp(v.data, pattern(8, 3).data(), 8), 0);
    EXPECT_EQ(c.file_of("x.c").path().filename(), "model-00002-of-00002.safetensors");
  }
}

TEST_F(Sharded, DirectoryWithoutIndexMergesFiles) {
  Checkpoint c = Checkpoint::open(dir.path());
  EXPECT_EQ(c.names().size(), 3u);
  EXPECT_EQ(std::memcmp(c.tensor("x.b").data, pattern(3, 2).data(), 3), 0);
}

TEST_F(Sharded, DuplicateAcrossFilesWithoutIndex) {
  write_file(dir / "extra.safetensors", good_file({{"x.a", "U8", {1}, "z"}}));
  EXPECT_EQ(error_of([&] { Checkpoint::open(dir.path()); }),
            "tensor 'x.a' appears in both '" + (dir / "extra.safetensors").string() + "' and '" +
                (dir / "model-00001-of-00002.safetensors").string() + "'");
}

TEST_F(Sharded, IndexNamingMissingShard) {
  index(R"({"x.a":"model-00001-of-00002.safetensors","x.z":"model-00003-of-00002.safetensors"})");
  Errc code{};
  EXPECT_EQ(error_of([&] { Checkpoint::open(dir.path()); }, &code),
            idx() + " names shard 'model-00003-of-00002.safetensors', which does not exist in '" + dir.path().string() + "'");
  EXPECT_EQ(code, Errc::io);
}

TEST_F(Sharded, IndexWithTensorNotInShard) {
  index(R"({"x.a":"model-00002-of-00002.safetensors"})");
  EXPECT_EQ(error_of([&] { Checkpoint::open(dir.path()); }),
            idx() + ": weight_map says tensor 'x.a' is in 'model-00002-of-00002.safetensors', but that file does not hold it");
}

TEST_F(Sharded, IndexCannotEscapeDirectory) {
  index(R"({"x.a":"../../etc/passwd"})");
  EXPECT_EQ(error_of([&] { Checkpoint::open(dir.path()); }),
            idx() + ": weight_map['x.a'] = '../../etc/passwd' must be a plain file name in the same directory");
}

TEST_F(Sharded, IndexMalformed) {
  write_file(dir / "model.safetensors.index.json", R"({"weight_map":["x.a"]})");
  EXPECT_EQ(error_of([&] { Checkpoint::open(dir.path()); }),
            idx() + ": expected an object with a 'weight_map' object (tensor name -> shard file)");
  index(R"({"x.a":7})");
  EXPECT_EQ(error_of([&] { Checkpoint::open(dir.path()); }), idx() + ": weight_map['x.a'] must be a file name, got 7");
}

TEST_F(Sharded, IndexThatIsAFifo) {
  ASSERT_EQ(mkfifo((dir / "model.safetensors.index.json").c_str(), 0600), 0);
  EXPECT_EQ(error_of([&] { Checkpoint::open(dir.path()); }), "cannot read '" + idx() + "': not a regular file");
}

TEST_F(Sharded, MissingPath) {
  Errc code{};
  EXPECT_EQ(error_of([&] { Checkpoint::open(dir / "absent"); }, &code),
            "checkpoint path '" + (dir / "absent").string() + "' does not exist");
  EXPECT_EQ(code, Errc::io);
}

TEST(Dtype, NamesAndSizes) {
  EXPECT_EQ(parse_dtype("BF16"), Dtype::BF16);
  EXPECT_EQ(dtype_size(Dtype::BF16), 2u);
  EXPECT_EQ(dtype_size(Dtype::F8_E4M3), 1u);
  EXPECT_EQ(dtype_size(Dtype::I64), 8u);
  EXPECT_EQ(dtype_name(Dtype::F8_E4M3), "F8_E4M3");
}

}  // namespace
}  // namespace tandem
