// tandem/safetensors.h: a bounds-checked, zero-copy reader for safetensors checkpoints.
//
// A file is mapped read-only; its JSON header is parsed and every entry validated
// before any tensor is handed out (known dtype, shape x element size == byte range,
// ranges inside the file, no overlaps and no holes, header length sane, no
// duplicate keys). A file that fails any check throws tandem::Error (bad_format or
// io) naming the file, the tensor key and the offending values. Tensor data is
// returned as a pointer into the mapping: it stays valid while the file (or the
// Checkpoint that owns it) lives, and it is NOT necessarily aligned.
//
//   auto ckpt = tandem::Checkpoint::open("/models/qwen3");  // dir, index json or file
//   auto t = ckpt.tensor("model.layers.0.mlp.experts.0.up_proj.weight");
//   // t.info->dtype, t.info->shape, t.data, t.nbytes
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tandem {

enum class Dtype : uint8_t {
  BOOL, U8, I8, I16, U16, I32, U32, I64, U64, F16, BF16, F32, F64, F8_E4M3, F8_E5M2,
  F8_E8M0,  // MX block scales
  C64,      // complex64
  // (sub-byte F4/F6 types are not accepted: tandem does not read them)
  // GGUF's block types, in tables made from GGUF files only (parse_dtype does not accept
  // them): blocks of 32 weights along the last dimension (kernels.h: SourceType, Q4Source).
  // GGML: any other GGUF type; tandem's C++ side holds its bytes but never decodes them.
  Q4_0, Q4_1, Q8_0, GGML,
};
std::string_view dtype_name(Dtype d) noexcept;  // the safetensors spelling: "BF16"; "Q4_0", "GGML"
size_t dtype_size(Dtype d) noexcept;             // bytes per element; 0 for the GGUF block types
// Throws tandem::Error (bad_format) listing the known names (safetensors' dtypes).
Dtype parse_dtype(std::string_view name);
// A GGUF table's dtype: "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", or "GGML" (another type).
Dtype parse_gguf_dtype(std::string_view name);
// Bytes of `numel` weights of a block type (Q4_0 / Q4_1 / Q8_0), whose last dimension is
// `row` (a multiple of 32: false otherwise, or for another dtype).
bool block_bytes(Dtype d, uint64_t row, uint64_t numel, uint64_t& bytes) noexcept;

struct TensorInfo {
  std::string name;
  Dtype dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range relative to the start of the data section
  uint64_t numel() const;
  uint64_t nbytes() const { return end - begin; }
};

struct SafetensorsHeader {
  uint64_t data_offset = 0;  // 8 + header length: where the data section starts (0 for a table's file)
  uint64_t header_bytes = 0;  // the file's bytes before its tensors (its format's header)
  std::map<std::string, std::string> metadata;  // "__metadata__"
  std::vector<TensorInfo> tensors;              // in data order (ascending begin)
};

// Largest header accepted (the reference implementation's limit).
inline constexpr uint64_t kMaxSafetensorsHeader = 100'000'000;

// Parses and validates the header of a whole safetensors file held in `file`.
// Never reads outside `file`; `origin` names the file in error messages.
SafetensorsHeader parse_safetensors_header(std::span<const std::byte> file,
                                           std::string_view origin);

struct TensorView {
  const TensorInfo* info = nullptr;
  const std::byte* data = nullptr;  // unaligned in general
  size_t nbytes = 0;
};

// One mapped, validated .safetensors file, or a file of another format (GGUF) mapped with
// the tensor table its format's reader made (see Checkpoint::from_tables).
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::filesystem::path& path);
  // `tensors`' byte ranges are from the start of the file; each is checked: inside the
  // file, the size its dtype and shape need (any size for GGML), no two overlapping. Gaps
  // are allowed (GGUF aligns its tensors).
  SafetensorsFile(const std::filesystem::path& path, std::vector<TensorInfo> tensors, std::string_view format);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  uint64_t file_size() const { return size_; }
  bool contains(std::string_view name) const;
  // Throws tandem::Error (invalid_argument) naming the key, the file and a near match.
  const TensorInfo& info(std::string_view name) const;
  TensorView tensor(std::string_view name) const;
  std::vector<std::string> names() const;
  // Drops the whole pages inside a tensor's bytes from this process's resident set
  // (madvise DONTNEED on the read-only mapping: a later read faults them in again).
  void release(std::string_view name) const;

 private:
  void map();
  std::filesystem::path path_;
  const std::byte* base_ = nullptr;
  uint64_t size_ = 0;
  SafetensorsHeader header_;
  std::map<std::string, size_t, std::less<>> index_;
};

// A checkpoint: one .safetensors file, a sharded one described by
// model.safetensors.index.json ("weight_map": name -> shard file), or a directory
// holding either (or several .safetensors files without an index, merged).
class Checkpoint {
 public:
  static Checkpoint open(const std::filesystem::path& path);
  // A checkpoint of files in another format (`format`, e.g. "GGUF") whose tensor tables a
  // reader of that format made (names as the model calls them): files[i] with tables[i].
  // A name in two tables is an error.
  static Checkpoint from_tables(const std::filesystem::path& root, const std::vector<std::filesystem::path>& files,
                                std::vector<std::vector<TensorInfo>> tables, std::string_view format);

  const std::filesystem::path& root() const { return root_; }
  bool contains(std::string_view name) const;
  const TensorInfo& info(std::string_view name) const;
  TensorView tensor(std::string_view name) const;
  // The shard holding a tensor (for error messages and locality decisions).
  const SafetensorsFile& file_of(std::string_view name) const;
  std::vector<std::string> names() const;  // sorted
  void release(std::string_view name) const { file_of(name).release(name); }
  size_t num_files() const { return files_.size(); }
  const SafetensorsFile& file(size_t i) const { return *files_[i]; }

 private:
  std::filesystem::path root_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t, std::less<>> where_;  // tensor name -> files_ index
};

}  // namespace tandem
