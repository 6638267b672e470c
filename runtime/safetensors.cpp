#include "tandem/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "tandem/error.h"

namespace tandem {
namespace {

using nlohmann::json;

struct DtypeInfo {
  Dtype dtype;
  const char* name;
  size_t size;
};
constexpr DtypeInfo kDtypes[] = {
    {Dtype::BOOL, "BOOL", 1}, {Dtype::U8, "U8", 1},           {Dtype::I8, "I8", 1},
    {Dtype::I16, "I16", 2},   {Dtype::U16, "U16", 2},         {Dtype::I32, "I32", 4},
    {Dtype::U32, "U32", 4},   {Dtype::I64, "I64", 8},         {Dtype::U64, "U64", 8},
    {Dtype::F16, "F16", 2},   {Dtype::BF16, "BF16", 2},       {Dtype::F32, "F32", 4},
    {Dtype::F64, "F64", 8},   {Dtype::F8_E4M3, "F8_E4M3", 1}, {Dtype::F8_E5M2, "F8_E5M2", 1},
    {Dtype::F8_E8M0, "F8_E8M0", 1}, {Dtype::C64, "C64", 8},
};

// A short, safe description of an untrusted JSON value for an error message: scalars
// as written (strings cut at 64 bytes, invalid UTF-8 replaced), containers by type.
// Never dump() a hostile value whole: its recursion depth is the attacker's choice.
std::string brief(const json& v) {
  if (v.is_array() || v.is_object()) return str_cat("a JSON ", v.type_name());
  if (v.is_string()) {
    std::string s = v.get<std::string>();
    if (s.size() > 64) s = s.substr(0, 64) + "...";
    return json(s).dump(-1, ' ', false, json::error_handler_t::replace);
  }
  return v.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += str_cat(i ? ", " : "", shape[i]);
  return s + "]";
}

// Reads a JSON value that must be a non-negative integer (not a float, not a string).
uint64_t as_u64(const json& v, std::string_view origin, std::string_view key, std::string_view what) {
  TANDEM_CHECK(v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0),
               Errc::bad_format, origin, ": tensor '", key, "': ", what,
               " must be a non-negative integer, got ", brief(v));
  return v.get<uint64_t>();
}

// A shape whose entries all passed as_u64: safe to print in full.
std::string brief_shape(const json& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += str_cat(i ? ", " : "", shape[i].get<uint64_t>());
  return s + "]";
}

// JSON objects may repeat a key; nlohmann keeps the last one silently. A checkpoint
// with two entries for one tensor is ambiguous, so duplicates are an error.
json parse_json_strict(std::string_view text, std::string_view origin, std::string_view what) {
  std::vector<std::set<std::string>> keys;  // one set per open object
  std::string duplicate;
  auto cb = [&](int /*depth*/, json::parse_event_t ev, json& parsed) {
    switch (ev) {
      case json::parse_event_t::object_start: keys.emplace_back(); break;
      case json::parse_event_t::object_end: if (!keys.empty()) keys.pop_back(); break;
      case json::parse_event_t::key:
        if (!keys.empty() && !keys.back().insert(parsed.get<std::string>()).second && duplicate.empty())
          duplicate = parsed.get<std::string>();
        break;
      default: break;
    }
    return true;
  };
  json j;
  try {
    j = json::parse(text.begin(), text.end(), cb);
  } catch (const json::exception& e) {
    TANDEM_FAIL(Errc::bad_format, origin, ": ", what, " is not valid JSON: ", e.what());
  }
  TANDEM_CHECK(duplicate.empty(), Errc::bad_format, origin, ": ", what, " repeats the key '",
               duplicate, "'");
  return j;
}

std::string nearest_name(std::string_view want, const std::vector<std::string>& names) {
  std::string best;
  size_t best_len = 0;
  for (const auto& n : names) {
    size_t i = 0;
    while (i < n.size() && i < want.size() && n[i] == want[i]) ++i;
    if (i > best_len) best_len = i, best = n;
  }
  return best_len * 2 >= want.size() ? best : std::string();
}

[[noreturn]] void missing_tensor(std::string_view name, std::string_view where,
                                 const std::vector<std::string>& names) {
  std::string hint = nearest_name(name, names);
  TANDEM_FAIL(Errc::invalid_argument, "tensor '", name, "' not found in ", where, " (",
              names.size(), " tensors)", hint.empty() ? "" : str_cat("; nearest: '", hint, "'"));
}

}  // namespace

constexpr DtypeInfo kGgufOnly[] = {{Dtype::Q4_0, "Q4_0", 18}, {Dtype::Q4_1, "Q4_1", 20}, {Dtype::Q8_0, "Q8_0", 34},
                                    {Dtype::GGML, "GGML", 0}};  // size: bytes per block of 32

std::string_view dtype_name(Dtype d) noexcept {
  for (const auto& i : kDtypes)
    if (i.dtype == d) return i.name;
  for (const auto& i : kGgufOnly)
    if (i.dtype == d) return i.name;
  return "?";
}

Dtype parse_gguf_dtype(std::string_view name) {
  for (Dtype d : {Dtype::F32, Dtype::F16, Dtype::BF16})
    if (name == dtype_name(d)) return d;
  for (const auto& i : kGgufOnly)
    if (name == i.name) return i.dtype;
  TANDEM_FAIL(Errc::invalid_argument, "GGUF table: unknown dtype '", name, "' (F32, F16, BF16, Q4_0, Q4_1, Q8_0, GGML)");
}

bool block_bytes(Dtype d, uint64_t row, uint64_t numel, uint64_t& bytes) noexcept {
  for (const auto& i : kGgufOnly) {
    if (i.dtype != d || !i.size || row == 0 || row % 32 || numel % row) continue;
    return !__builtin_mul_overflow(numel / 32, static_cast<uint64_t>(i.size), &bytes);
  }
  return false;
}

size_t dtype_size(Dtype d) noexcept {
  for (const auto& i : kDtypes)  // (kGgufOnly's sizes are per block: 0 here)
    if (i.dtype == d) return i.size;
  return 0;
}

Dtype parse_dtype(std::string_view name) {
  for (const auto& i : kDtypes)
    if (name == i.name) return i.dtype;
  std::string known;
  for (const auto& i : kDtypes) known += str_cat(known.empty() ? "" : ", ", i.name);
  TANDEM_FAIL(Errc::bad_format, "unknown dtype '", name, "'; known: ", known);
}

uint64_t TensorInfo::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

SafetensorsHeader parse_safetensors_header(std::span<const std::byte> file, std::string_view origin) {
  const uint64_t size = file.size();
  TANDEM_CHECK(size >= 8, Errc::bad_format, origin, ": file is ", size,
               " bytes; a safetensors file starts with an 8-byte header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(file[i]);  // little-endian
  TANDEM_CHECK(n <= kMaxSafetensorsHeader, Errc::bad_format, origin, ": header length ", n,
               " exceeds the limit of ", kMaxSafetensorsHeader, " bytes");
  TANDEM_CHECK(n <= size - 8, Errc::bad_format, origin, ": header length ", n,
               " runs past the end of the file (", size, " bytes); the file is truncated or not safetensors");
  TANDEM_CHECK(n >= 2 && static_cast<char>(file[8]) == '{', Errc::bad_format, origin,
               ": header does not start with '{' (not a safetensors file?)");

  std::string_view text(reinterpret_cast<const char*>(file.data()) + 8, n);
  // The JSON parser stops at a NUL; bytes after it would escape every check below.
  const size_t nul = text.find('\0');
  TANDEM_CHECK(nul == std::string_view::npos, Errc::bad_format, origin, ": header holds a NUL byte at offset ",
               8 + nul, "; a safetensors header is UTF-8 JSON padded with spaces");
  json j = parse_json_strict(text, origin, "header");
  TANDEM_CHECK(j.is_object(), Errc::bad_format, origin, ": header must be a JSON object");

  SafetensorsHeader h;
  h.data_offset = h.header_bytes = 8 + n;
  const uint64_t data_size = size - h.data_offset;
  for (auto& [key, v] : j.items()) {
    if (key == "__metadata__") {
      TANDEM_CHECK(v.is_object(), Errc::bad_format, origin, ": __metadata__ must be an object of strings");
      for (auto& [mk, mv] : v.items()) {
        TANDEM_CHECK(mv.is_string(), Errc::bad_format, origin, ": __metadata__['", mk,
                     "'] must be a string, got ", brief(mv));
        h.metadata.emplace(mk, mv.get<std::string>());
      }
      continue;
    }
    TANDEM_CHECK(!key.empty(), Errc::bad_format, origin, ": a tensor has an empty name");
    TANDEM_CHECK(v.is_object(), Errc::bad_format, origin, ": tensor '", key, "' must be an object");
    for (auto& [field, fv] : v.items()) {
      (void)fv;
      TANDEM_CHECK(field == "dtype" || field == "shape" || field == "data_offsets", Errc::bad_format,
                   origin, ": tensor '", key, "' has unknown field '", field,
                   "' (expected dtype, shape, data_offsets)");
    }
    TANDEM_CHECK(v.contains("dtype") && v["dtype"].is_string(), Errc::bad_format, origin,
                 ": tensor '", key, "' needs a string 'dtype'");
    TANDEM_CHECK(v.contains("shape") && v["shape"].is_array(), Errc::bad_format, origin,
                 ": tensor '", key, "' needs an array 'shape'");
    TANDEM_CHECK(v.contains("data_offsets") && v["data_offsets"].is_array() &&
                     v["data_offsets"].size() == 2,
                 Errc::bad_format, origin, ": tensor '", key, "' needs 'data_offsets' = [begin, end]");

    TensorInfo t;
    t.name = key;
    try {
      t.dtype = parse_dtype(v["dtype"].get<std::string>());
    } catch (const Error& e) {
      TANDEM_FAIL(Errc::bad_format, origin, ": tensor '", key, "': ", e.message());
    }
    uint64_t numel = 1;
    for (const auto& d : v["shape"]) {
      uint64_t dim = as_u64(d, origin, key, "every shape entry");
      TANDEM_CHECK(dim <= static_cast<uint64_t>(INT64_MAX) && !__builtin_mul_overflow(numel, dim, &numel),
                   Errc::bad_format, origin, ": tensor '", key, "': shape ", brief_shape(v["shape"]),
                   " overflows 64 bits");
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    t.begin = as_u64(v["data_offsets"][0], origin, key, "data_offsets[0]");
    t.end = as_u64(v["data_offsets"][1], origin, key, "data_offsets[1]");
    TANDEM_CHECK(t.begin <= t.end, Errc::bad_format, origin, ": tensor '", key, "': data_offsets [",
                 t.begin, ", ", t.end, "] end before they begin");
    TANDEM_CHECK(t.end <= data_size, Errc::bad_format, origin, ": tensor '", key, "': data_offsets [",
                 t.begin, ", ", t.end, "] run past the data section (", data_size,
                 " bytes); the file is truncated or corrupt");
    uint64_t want = 0;
    TANDEM_CHECK(!__builtin_mul_overflow(numel, dtype_size(t.dtype), &want) && want == t.end - t.begin,
                 Errc::bad_format, origin, ": tensor '", key, "': shape ", shape_str(t.shape), " x ",
                 dtype_name(t.dtype), " needs ", numel, " x ", dtype_size(t.dtype), " bytes but data_offsets [",
                 t.begin, ", ", t.end, "] hold ", t.end - t.begin);
    h.tensors.push_back(std::move(t));
  }

  // The data section must be covered exactly once: no overlaps (aliasing) and no
  // holes (hidden payloads), as the format's specification requires.
  std::sort(h.tensors.begin(), h.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t cursor = 0;
  const TensorInfo* prev = nullptr;
  for (const auto& t : h.tensors) {
    TANDEM_CHECK(t.begin >= cursor, Errc::bad_format, origin, ": tensors '", prev ? prev->name : "",
                 "' and '", t.name, "' overlap (bytes ", t.begin, "..", cursor, ")");
    TANDEM_CHECK(t.begin == cursor, Errc::bad_format, origin, ": bytes ", cursor, "..", t.begin,
                 " of the data section belong to no tensor (a hole before '", t.name, "')");
    cursor = t.end;
    prev = &t;
  }
  TANDEM_CHECK(cursor == data_size, Errc::bad_format, origin, ": the data section has ", data_size,
               " bytes but the tensors cover ", cursor, " (", data_size - cursor,
               " trailing bytes belong to no tensor)");
  return h;
}

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path) : path_(path) {
  map();
  const std::string p = path.string();
  try {
    header_ = parse_safetensors_header({base_, size_}, p);
  } catch (...) {
    if (base_) ::munmap(const_cast<std::byte*>(base_), size_);
    throw;
  }
  for (size_t i = 0; i < header_.tensors.size(); ++i) index_.emplace(header_.tensors[i].name, i);
}

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path, std::vector<TensorInfo> tensors,
                                 std::string_view format)
    : path_(path) {
  map();
  const std::string p = path.string();
  try {
    std::sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    uint64_t cursor = 0;
    const TensorInfo* prev = nullptr;
    for (const auto& t : tensors) {
      TANDEM_CHECK(!t.name.empty(), Errc::bad_format, p, ": a ", format, " tensor has an empty name");
      TANDEM_CHECK(t.begin <= t.end && t.end <= size_, Errc::bad_format, p, ": ", format, " tensor '", t.name,
                   "' at bytes [", t.begin, ", ", t.end, ") runs past the end of the file (", size_,
                   " bytes); the file is truncated or corrupt");
      uint64_t numel = 1;
      for (int64_t d : t.shape)
        TANDEM_CHECK(d >= 0 && !__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel), Errc::bad_format, p,
                     ": ", format, " tensor '", t.name, "' has shape ", shape_str(t.shape));
      if (t.dtype != Dtype::GGML) {
        uint64_t want = 0;
        const bool ok = dtype_size(t.dtype)
                            ? !__builtin_mul_overflow(numel, dtype_size(t.dtype), &want)
                            : block_bytes(t.dtype, t.shape.empty() ? 0 : static_cast<uint64_t>(t.shape.back()), numel, want);
        TANDEM_CHECK(ok && want == t.nbytes(), Errc::bad_format, p, ": ", format, " tensor '", t.name, "': shape ",
                     shape_str(t.shape), " of ", dtype_name(t.dtype), " needs ", ok ? str_cat(want) : "whole blocks of 32",
                     " bytes, the file gives it ", t.nbytes());
      }
      TANDEM_CHECK(t.begin >= cursor, Errc::bad_format, p, ": ", format, " tensors '", prev ? prev->name : "", "' and '",
                   t.name, "' overlap (bytes ", t.begin, "..", cursor, ")");
      cursor = t.end;
      prev = &t;
    }
    header_.data_offset = 0;
    header_.header_bytes = tensors.empty() ? size_ : tensors.front().begin;
    header_.tensors = std::move(tensors);
    for (size_t i = 0; i < header_.tensors.size(); ++i)
      TANDEM_CHECK(index_.emplace(header_.tensors[i].name, i).second, Errc::bad_format, p, ": ", format, " tensor '",
                   header_.tensors[i].name, "' appears twice");
  } catch (...) {
    if (base_) ::munmap(const_cast<std::byte*>(base_), size_);
    throw;
  }
}

void SafetensorsFile::map() {
  const std::string p = path_.string();
  // O_NONBLOCK: opening a FIFO must not wait for a writer (it is rejected just below).
  int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  TANDEM_CHECK(fd >= 0, Errc::io, "cannot open '", p, "': ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    TANDEM_FAIL(Errc::io, "cannot stat '", p, "': ", std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    TANDEM_FAIL(Errc::io, "'", p, "' is not a regular file");
  }
  size_ = static_cast<uint64_t>(st.st_size);
  if (size_ > 0) {
    void* m = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    int err = errno;
    ::close(fd);
    TANDEM_CHECK(m != MAP_FAILED, Errc::io, "cannot map '", p, "' (", size_, " bytes): ", std::strerror(err));
    base_ = static_cast<const std::byte*>(m);
  } else {
    ::close(fd);
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (base_) ::munmap(const_cast<std::byte*>(base_), size_);
}

bool SafetensorsFile::contains(std::string_view name) const { return index_.find(name) != index_.end(); }

const TensorInfo& SafetensorsFile::info(std::string_view name) const {
  auto it = index_.find(name);
  if (it == index_.end()) missing_tensor(name, str_cat("'", path_.string(), "'"), names());
  return header_.tensors[it->second];
}

TensorView SafetensorsFile::tensor(std::string_view name) const {
  const TensorInfo& t = info(name);
  return {&t, base_ + header_.data_offset + t.begin, static_cast<size_t>(t.nbytes())};
}

void SafetensorsFile::release(std::string_view name) const {
  const TensorView t = tensor(name);
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t b = (reinterpret_cast<uintptr_t>(t.data) + page - 1) / page * page;
  const uintptr_t e = (reinterpret_cast<uintptr_t>(t.data) + t.nbytes) / page * page;
  if (e > b) ::madvise(reinterpret_cast<void*>(b), e - b, MADV_DONTNEED);  // advice: failure changes nothing
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> v;
  for (const auto& [k, i] : index_) v.push_back(k);
  return v;
}

Checkpoint Checkpoint::open(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  Checkpoint c;
  std::error_code ec;
  const auto st = fs::status(path, ec);
  TANDEM_CHECK(st.type() != fs::file_type::not_found, Errc::io, "checkpoint path '", path.string(), "' does not exist");
  TANDEM_CHECK(!ec, Errc::io, "cannot access checkpoint path '", path.string(), "': ", ec.message());
  auto exists = [](const fs::path& p) {
    std::error_code e;
    return fs::exists(p, e);
  };
  fs::path index;
  std::vector<fs::path> shards;
  if (fs::is_directory(st)) {
    c.root_ = path;
    if (exists(path / "model.safetensors.index.json")) {
      index = path / "model.safetensors.index.json";
    } else if (exists(path / "model.safetensors")) {
      shards.push_back(path / "model.safetensors");
    } else {
      fs::directory_iterator it(path, ec);
      TANDEM_CHECK(!ec, Errc::io, "cannot list checkpoint directory '", path.string(), "': ", ec.message());
      for (; it != fs::directory_iterator(); it.increment(ec)) {
        TANDEM_CHECK(!ec, Errc::io, "cannot list checkpoint directory '", path.string(), "': ", ec.message());
        std::error_code fe;
        if (it->path().extension() == ".safetensors" && it->is_regular_file(fe)) shards.push_back(it->path());
      }
      TANDEM_CHECK(!ec, Errc::io, "cannot list checkpoint directory '", path.string(), "': ", ec.message());
      std::sort(shards.begin(), shards.end());
      TANDEM_CHECK(!shards.empty(), Errc::io, "checkpoint directory '", path.string(),
                   "' has no model.safetensors.index.json and no .safetensors files");
    }
  } else if (path.extension() == ".json") {
    c.root_ = path.parent_path();
    index = path;
  } else {
    c.root_ = path.parent_path();
    shards.push_back(path);
  }

  if (!index.empty()) {
    // Checked before opening: an ifstream on a FIFO would wait for a writer.
    TANDEM_CHECK(fs::is_regular_file(index, ec), Errc::io, "cannot read '", index.string(), "': not a regular file");
    std::ifstream in(index, std::ios::binary);
    TANDEM_CHECK(in.good(), Errc::io, "cannot read '", index.string(), "'");
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string text = ss.str();
    TANDEM_CHECK(text.size() <= kMaxSafetensorsHeader, Errc::bad_format, index.string(), ": ", text.size(),
                 " bytes is larger than any index should be (limit ", kMaxSafetensorsHeader, ")");
    const std::string origin = index.string();
    json j = parse_json_strict(text, origin, "index");
    TANDEM_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(), Errc::bad_format,
                 origin, ": expected an object with a 'weight_map' object (tensor name -> shard file)");
    std::map<std::string, size_t> file_ids;
    std::vector<std::pair<std::string, size_t>> entries;
    for (auto& [name, file] : j["weight_map"].items()) {
      TANDEM_CHECK(file.is_string(), Errc::bad_format, origin, ": weight_map['", name,
                   "'] must be a file name, got ", brief(file));
      const std::string f = file.get<std::string>();
      // Shards live beside the index: no directories, so no path can escape it.
      TANDEM_CHECK(!f.empty() && f.find_first_of(std::string_view("/\\\0", 3)) == std::string::npos &&
                       f != "." && f != "..",
                   Errc::bad_format, origin, ": weight_map['", name, "'] = '", f,
                   "' must be a plain file name in the same directory");
      auto [it, added] = file_ids.emplace(f, file_ids.size());
      if (added) shards.push_back(c.root_ / f);
      entries.emplace_back(name, it->second);
    }
    for (const auto& s : shards) {
      TANDEM_CHECK(exists(s), Errc::io, origin, " names shard '", s.filename().string(),
                   "', which does not exist in '", c.root_.string(), "'");
      c.files_.push_back(std::make_unique<SafetensorsFile>(s));
    }
    for (const auto& [name, id] : entries) {
      TANDEM_CHECK(c.files_[id]->contains(name), Errc::bad_format, origin, ": weight_map says tensor '",
                   name, "' is in '", shards[id].filename().string(), "', but that file does not hold it");
      c.where_.emplace(name, id);
    }
  } else {
    for (const auto& s : shards) {
      c.files_.push_back(std::make_unique<SafetensorsFile>(s));
      const size_t id = c.files_.size() - 1;
      for (const auto& t : c.files_.back()->header().tensors) {
        auto [it, added] = c.where_.emplace(t.name, id);
        TANDEM_CHECK(added, Errc::bad_format, "tensor '", t.name, "' appears in both '",
                     c.files_[it->second]->path().string(), "' and '", s.string(), "'");
      }
    }
  }
  return c;
}

Checkpoint Checkpoint::from_tables(const std::filesystem::path& root, const std::vector<std::filesystem::path>& files,
                                   std::vector<std::vector<TensorInfo>> tables, std::string_view format) {
  TANDEM_CHECK(files.size() == tables.size() && !files.empty(), Errc::invalid_argument, "Checkpoint::from_tables: ",
               files.size(), " files with ", tables.size(), " tables");
  Checkpoint c;
  c.root_ = root;
  for (size_t i = 0; i < files.size(); ++i) {
    c.files_.push_back(std::make_unique<SafetensorsFile>(files[i], std::move(tables[i]), format));
    for (const auto& t : c.files_.back()->header().tensors) {
      auto [it, added] = c.where_.emplace(t.name, i);
      TANDEM_CHECK(added, Errc::bad_format, "tensor '", t.name, "' appears in both '", c.files_[it->second]->path().string(),
                   "' and '", files[i].string(), "'");
    }
  }
  return c;
}

bool Checkpoint::contains(std::string_view name) const { return where_.find(name) != where_.end(); }

const SafetensorsFile& Checkpoint::file_of(std::string_view name) const {
  auto it = where_.find(name);
  if (it == where_.end()) missing_tensor(name, str_cat("checkpoint '", root_.string(), "'"), names());
  return *files_[it->second];
}

const TensorInfo& Checkpoint::info(std::string_view name) const { return file_of(name).info(name); }
TensorView Checkpoint::tensor(std::string_view name) const { return file_of(name).tensor(name); }

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> v;
  for (const auto& [k, i] : where_) v.push_back(k);
  return v;
}

}  // namespace tandem
