#include "tandem/expert_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>

#include "expert_core.h"
#include "tandem/error.h"
#include "tandem/fileio.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace tandem {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr size_t kAlign = 4096;        // header size, and each pack's alignment in a layer file
constexpr char kMagic[8] = {'T', 'A', 'N', 'D', 'E', 'M', 'X', 'S'};
constexpr const char* kManifest = "manifest.json";

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

std::string layer_file_name(int model_layer) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "layer-%04d.tpk", model_layer);
  return buf;
}

// A streaming XXH3-128 of bytes, as 32 hex digits.
class Hasher {
 public:
  Hasher() : st_(XXH3_createState()) {
    TANDEM_CHECK(st_ != nullptr, Errc::io, "store: out of memory for a hash state");
    XXH3_128bits_reset(st_);
  }
  ~Hasher() { XXH3_freeState(st_); }
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;
  void update(const void* p, size_t n) { XXH3_128bits_update(st_, p, n); }
  std::string hex() const {
    const XXH128_hash_t h = XXH3_128bits_digest(st_);
    char buf[33];
    std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                  static_cast<unsigned long long>(h.low64));
    return buf;
  }

 private:
  XXH3_state_t* st_;
};

// A file descriptor that closes itself.
struct Fd {
  int fd = -1;
  Fd() = default;
  explicit Fd(int f) : fd(f) {}
  Fd(Fd&& o) noexcept : fd(std::exchange(o.fd, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      if (fd >= 0) ::close(fd);
      fd = std::exchange(o.fd, -1);
    }
    return *this;
  }
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

void pread_all(int fd, void* dst, size_t n, uint64_t off, const fs::path& path) {
  auto* p = static_cast<std::byte*>(dst);
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd, p + done, n - done, static_cast<off_t>(off + done));
    if (r < 0 && errno == EINTR) continue;
    TANDEM_CHECK(r >= 0, Errc::io, "store: reading ", path.string(), " at byte ", off + done, " failed: ",
                 std::strerror(errno));
    TANDEM_CHECK(r > 0, Errc::bad_format, "store: ", path.string(), " ends at byte ", off + done, ", before the ",
                 n, " bytes at ", off, " (the file was truncated)");
    done += static_cast<size_t>(r);
  }
}

// ---- what a store holds, as JSON --------------------------------------------------------

json spec_json(const StoreSpec& s) {
  return {{"format", std::string(format_name(s.format))},
          {"group", s.format.format == WeightFormat::int4 ? s.format.group : 0},
          {"zero_point", s.format.format == WeightFormat::int4 && !s.format.symmetric},
          {"experts", s.shape.experts},
          {"hidden", s.shape.hidden},
          {"intermediate", s.shape.inter},
          {"layers", s.layers},
          {"naming", {{"gate", s.naming.gate}, {"up", s.naming.up}, {"down", s.naming.down}}}};
}

struct PackSizes {
  size_t gate_up = 0, down = 0, stride = 0;
};
PackSizes pack_sizes(const StoreSpec& s) {
  PackSizes p;
  p.gate_up = packed_bytes(s.format, s.shape.inter, s.shape.hidden, true);
  p.down = packed_bytes(s.format, s.shape.hidden, s.shape.inter);
  p.stride = align_up(p.gate_up) + align_up(p.down);
  return p;
}
uint64_t layer_file_size(const StoreSpec& s) { return kAlign + uint64_t{pack_sizes(s).stride} * s.shape.experts; }

// The source checkpoint's files: name (relative to the checkpoint's directory), size,
// modification time and a hash of the file's header (safetensors' or GGUF's: tensor names,
// dtypes, shapes, offsets; GGUF's metadata). Cheap: no tensor data is read.
json source_files(const Checkpoint& ckpt) {
  const fs::path base = fs::is_directory(ckpt.root()) ? ckpt.root() : ckpt.root().parent_path();
  json files = json::array();
  for (size_t i = 0; i < ckpt.num_files(); ++i) {
    const SafetensorsFile& f = ckpt.file(i);
    struct stat st {};
    TANDEM_CHECK(::stat(f.path().c_str(), &st) == 0, Errc::io, "store: cannot stat ", f.path().string(), ": ",
                 std::strerror(errno));
    Fd fd(::open(f.path().c_str(), O_RDONLY | O_CLOEXEC));
    TANDEM_CHECK(fd.fd >= 0, Errc::io, "store: cannot open ", f.path().string(), ": ", std::strerror(errno));
    std::vector<std::byte> head(f.header().header_bytes);
    pread_all(fd.fd, head.data(), head.size(), 0, f.path());
    Hasher h;
    h.update(head.data(), head.size());
    files.push_back({{"name", f.path().lexically_relative(base).generic_string()},
                     {"size", static_cast<uint64_t>(st.st_size)},
                     {"mtime_ns", static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec},
                     {"header_xxh3", h.hex()}});
  }
  std::sort(files.begin(), files.end(), [](const json& a, const json& b) { return a["name"] < b["name"]; });
  return files;
}

// The files' fingerprint (names, sizes, header hashes and modification times): what a layer
// file's header records, so that a resumed conversion keeps only layers made from the same,
// untouched source.
std::string files_key(const json& files) {
  Hasher h;
  for (const json& f : files) {
    const std::string s = f.at("name").get<std::string>() + "\n" + std::to_string(f.at("size").get<uint64_t>()) + "\n" +
                          f.at("header_xxh3").get<std::string>() + "\n" +
                          std::to_string(f.at("mtime_ns").get<int64_t>()) + "\n";
    h.update(s.data(), s.size());
  }
  return h.hex();
}

// Adds one expert's tensors as they are in the checkpoint (block scales and quantization
// tensors included) to a layer's source hash, and gives their pages back.
void hash_expert_source(const Checkpoint& ckpt, const StoreSpec& s, int model_layer, int e, Hasher& h) {
  if (s.naming.fused()) {  // expert e's slice of the layer's fused gate_up (or gate and up) and down tensors
    for (const std::string* p : {&s.naming.gate, &s.naming.up, &s.naming.down}) {
      if (p == &s.naming.up && s.naming.up == s.naming.gate) continue;
      const std::string n = ExpertNaming::name(*p, model_layer, e);
      const TensorView t = ckpt.tensor(n);
      const size_t per = t.nbytes / s.shape.experts;
      h.update(t.data + e * per, per);
      if (e + 1 == s.shape.experts) ckpt.release(n);  // the whole tensor serves every expert
    }
    return;
  }
  for (const std::string* p : {&s.naming.gate, &s.naming.up, &s.naming.down})
    for (const std::string& n : expert_tensor_names(ckpt, ExpertNaming::name(*p, model_layer, e))) {
      const TensorView t = ckpt.tensor(n);
      h.update(t.data, t.nbytes);
      ckpt.release(n);
    }
}

// The hash of one model layer's expert tensors.
std::string source_layer_hash(const Checkpoint& ckpt, const StoreSpec& s, int model_layer) {
  Hasher h;
  for (int e = 0; e < s.shape.experts; ++e) hash_expert_source(ckpt, s, model_layer, e, h);
  return h.hex();
}

json header_json(const StoreSpec& s, int index) {
  const PackSizes ps = pack_sizes(s);
  json h = spec_json(s);
  h.erase("layers");
  h["store_version"] = kStoreVersion;
  h["pack_version"] = kPackVersion;
  h["layer"] = s.layers[index];
  h["gate_up_bytes"] = ps.gate_up;
  h["down_bytes"] = ps.down;
  h["expert_stride"] = ps.stride;
  h["data_offset"] = kAlign;
  return h;
}

// A layer file's header: magic, version, JSON length, JSON (within 4 KiB).
json read_header(int fd, const fs::path& path) {
  std::vector<char> buf(kAlign);
  pread_all(fd, buf.data(), kAlign, 0, path);
  TANDEM_CHECK(std::memcmp(buf.data(), kMagic, 8) == 0, Errc::bad_format, "store: ", path.string(),
               " is not a tandem store layer file (no TANDEMXS magic)");
  uint32_t version = 0, len = 0;
  std::memcpy(&version, buf.data() + 8, 4);
  std::memcpy(&len, buf.data() + 12, 4);
  TANDEM_CHECK(version == kStoreVersion, Errc::unsupported, "store: ", path.string(), " has store version ", version,
               "; this tandem reads version ", kStoreVersion, " (convert the checkpoint again)");
  TANDEM_CHECK(len > 0 && len <= kAlign - 16, Errc::bad_format, "store: ", path.string(), ": header length ", len,
               " is outside (0, ", kAlign - 16, "]");
  try {
    return json::parse(buf.begin() + 16, buf.begin() + 16 + len);
  } catch (const json::exception& e) {
    TANDEM_FAIL(Errc::bad_format, "store: ", path.string(), ": header is not valid JSON: ", e.what());
  }
}

// A layer file's 4 KiB header block: magic, version, JSON length, JSON.
std::vector<char> header_block(const json& h, const fs::path& path) {
  const std::string text = h.dump();
  TANDEM_CHECK(text.size() <= kAlign - 16, Errc::internal, "store: header of ", path.string(), " is ", text.size(),
               " bytes, above ", kAlign - 16);
  std::vector<char> buf(kAlign, 0);
  std::memcpy(buf.data(), kMagic, 8);
  const uint32_t version = kStoreVersion, len = static_cast<uint32_t>(text.size());
  std::memcpy(buf.data() + 8, &version, 4);
  std::memcpy(buf.data() + 12, &len, 4);
  std::memcpy(buf.data() + 16, text.data(), text.size());
  return buf;
}

// The first field where two spec JSONs differ, as "name: stored vs wanted"; empty if none.
std::string spec_difference(const json& stored, const json& want) {
  for (const char* k : {"format", "group", "zero_point", "experts", "hidden", "intermediate", "layers", "naming"})
    if (stored.contains(k) && want.contains(k) && stored[k] != want[k])
      return std::string(k) + ": the store has " + stored[k].dump() + ", wanted " + want[k].dump();
  return {};
}

// The header of the finished layer file at `path` when it is the one this conversion would
// write (resume); nothing otherwise.
std::optional<json> finished_layer_header(const fs::path& path, const StoreSpec& s, int index,
                                          const std::string& source_key) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.fd < 0) return std::nullopt;
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != layer_file_size(s)) return std::nullopt;
  try {
    json h = read_header(fd.fd, path);
    const json want = header_json(s, index);
    for (auto it = want.begin(); it != want.end(); ++it)
      if (!h.contains(it.key()) || h[it.key()] != it.value()) return std::nullopt;
    if (h.value("source_files", "") == source_key && h.contains("data_xxh3") && h.contains("source_xxh3")) return h;
  } catch (const Error&) {
  } catch (const json::exception&) {
  }
  return std::nullopt;
}

}  // namespace

std::string store_dir_name(const PackOptions& f) {
  std::string n = "tandem-" + std::string(format_name(f));
  if (f.format == WeightFormat::int4 && !f.e2m1) {
    n += "-g" + std::to_string(f.group);
    if (!f.symmetric) n += "-zp";
  }
  return n;
}

// ---- conversion ---------------------------------------------------------------------------

ConvertReport convert_experts(const Checkpoint& ckpt, const StoreSpec& spec, const fs::path& dir,
                              const Progress& progress) {
  TANDEM_CHECK(!spec.layers.empty(), Errc::invalid_argument, "convert: the model has no MoE layers");
  TANDEM_CHECK(spec.shape.experts > 0 && spec.shape.hidden > 0 && spec.shape.inter > 0, Errc::invalid_argument,
               "convert: shape (experts ", spec.shape.experts, ", hidden ", spec.shape.hidden, ", intermediate ",
               spec.shape.inter, ") must be positive");
  packed_bytes(spec.format, spec.shape.inter, spec.shape.hidden, true);  // refuses a bad format / group
  packed_bytes(spec.format, spec.shape.hidden, spec.shape.inter);
  // Every expert tensor is checked before anything is written.
  check_checkpoint_experts(ckpt, spec.layers, spec.naming, spec.shape);

  ConvertReport report;
  const json files = source_files(ckpt);
  const std::string source_key = files_key(files);
  std::error_code ec;
  fs::create_directories(dir, ec);
  TANDEM_CHECK(!ec, Errc::io, "convert: cannot create the store directory ", dir.string(), ": ", ec.message());
  // One conversion per directory at a time (another one's temporaries are not stale).
  Fd lock(::open((dir / ".convert.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
  TANDEM_CHECK(lock.fd >= 0, Errc::io, "convert: cannot create ", (dir / ".convert.lock").string(), ": ",
               std::strerror(errno));
  TANDEM_CHECK(::flock(lock.fd, LOCK_EX | LOCK_NB) == 0, Errc::io, "convert: another conversion is writing ",
               dir.string(), " (", std::strerror(errno), ")");

  const fs::path manifest = dir / kManifest;
  if (fs::exists(manifest)) {
    // A finished store: the same one is up to date; one of other experts is never overwritten;
    // one that no longer loads (a changed source, a truncated file, another pack version) is
    // finished again: its manifest goes first, then every layer that does not match is rewritten.
    std::optional<ExpertStore> existing;
    try {
      existing.emplace(ExpertStore::open(dir));
    } catch (const Error& e) {
      report.replaced = e.message();
    }
    if (existing) {
      const std::string diff = spec_difference(spec_json(existing->spec()), spec_json(spec));
      TANDEM_CHECK(diff.empty(), Errc::invalid_argument, "convert: ", dir.string(),
                   " already holds a finished store of other experts (", diff,
                   "); choose another output directory or remove that one");
      try {
        existing->check(spec, ckpt);  // the same source
        report.up_to_date = true;
        report.layers_kept = static_cast<int>(spec.layers.size());
        report.bytes = existing->bytes();
        if (progress) progress(spec.shape.experts * static_cast<int>(spec.layers.size()),
                               spec.shape.experts * static_cast<int>(spec.layers.size()));
        return report;
      } catch (const Error& e) {
        if (e.code() == Errc::io) throw;
        // Only the store of this very checkpoint (same place) is finished again when it changed.
        TANDEM_CHECK(existing->source_path() == fs::absolute(ckpt.root()).string(), Errc::invalid_argument, "convert: ",
                     dir.string(), " holds the store of ", existing->source_path(), ", not of ",
                     fs::absolute(ckpt.root()).string(), " (", e.message(),
                     "); choose another output directory or remove that one");
        report.replaced = e.message();
      }
    }
    existing.reset();
    fs::remove(manifest, ec);
    TANDEM_CHECK(!ec, Errc::io, "convert: cannot remove the stale ", manifest.string(), ": ", ec.message());
    fsync_directory(dir);
  }
  // Temporaries of an interrupted run.
  for (const auto& entry : fs::directory_iterator(dir, ec))
    if (entry.path().filename().string().find(".tmp.") != std::string::npos) fs::remove(entry.path(), ec);

  const int E = spec.shape.experts, L = static_cast<int>(spec.layers.size());
  const PackSizes ps = pack_sizes(spec);
  json entries = json::array();
  int done = 0;
  auto report_progress = [&] {
    if (progress) progress(done, E * L);
  };
  report_progress();
  const std::vector<std::byte> zeros(kAlign);
  for (int i = 0; i < L; ++i) {
    const int layer = spec.layers[i];
    const fs::path path = dir / layer_file_name(layer);
    if (const std::optional<json> h = finished_layer_header(path, spec, i, source_key)) {
      entries.push_back({{"layer", layer}, {"name", path.filename().string()}, {"size", layer_file_size(spec)},
                         {"data_xxh3", h->at("data_xxh3")}, {"source_xxh3", h->at("source_xxh3")}});
      ++report.layers_kept;
      report.bytes += layer_file_size(spec);
      done += E;
      report_progress();
      continue;
    }
    AtomicFile file(path, "convert: store layer");
    core::ExpertPacks one(spec.shape, spec.format, 1, core::ExpertPacks::Layout::fused, layer);
    Hasher data, source;  // the file's data as written; the source tensors while they are hot
    uint64_t off = kAlign;
    auto put = [&](const std::byte* p, size_t n) {
      file.write_at(off, p, n);
      data.update(p, n);
      off += n;
      if (const size_t pad = align_up(n) - n) {
        file.write_at(off, zeros.data(), pad);
        data.update(zeros.data(), pad);
        off += pad;
      }
    };
    for (int e = 0; e < E; ++e) {
      one.pack_slice(0, e, checkpoint_expert(ckpt, layer, e, spec.naming, spec.shape));
      const PackedWeight& gu = one.gate_up(0, e);
      const PackedWeight& dn = one.down(0, e);
      TANDEM_CHECK(gu.bytes() == ps.gate_up && dn.bytes() == ps.down, Errc::internal, "convert: layer ", layer,
                   " expert ", e, ": packs of ", gu.bytes(), " + ", dn.bytes(), " bytes, planned ", ps.gate_up, " + ",
                   ps.down);
      put(gu.data.data(), gu.bytes());
      put(dn.data.data(), dn.bytes());
      one.drop(e);
      hash_expert_source(ckpt, spec, layer, e, source);
      ++done;
      report_progress();
    }
    json h = header_json(spec, i);
    h["source_files"] = source_key;
    h["source_xxh3"] = source.hex();
    h["data_xxh3"] = data.hex();
    file.write_at(0, header_block(h, path).data(), kAlign);
    file.commit();
    entries.push_back({{"layer", layer}, {"name", path.filename().string()}, {"size", layer_file_size(spec)},
                       {"data_xxh3", h["data_xxh3"]}, {"source_xxh3", h["source_xxh3"]}});
    ++report.layers_written;
    report.bytes += layer_file_size(spec);
  }
  json m = spec_json(spec);
  m["tandem_store"] = kStoreVersion;
  m["pack_version"] = kPackVersion;
  m["source"] = {{"path", fs::absolute(ckpt.root()).string()}, {"files", files}};
  m["files"] = entries;
  m["bytes"] = report.bytes;
  write_file_atomic(manifest, m.dump(1) + "\n", "store manifest");  // its directory fsynced too
  return report;
}

// ---- reading ---------------------------------------------------------------------------------

struct ExpertStore::Impl {
  fs::path dir;
  StoreSpec spec;
  json manifest;
  PackSizes sizes;
  struct File {
    fs::path path;
    Fd fd;
    uint64_t size = 0;
    std::string data_hash, source_hash;
  };
  std::vector<File> files;  // per MoE index
};

ExpertStore::ExpertStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ExpertStore::ExpertStore(ExpertStore&&) noexcept = default;
ExpertStore& ExpertStore::operator=(ExpertStore&&) noexcept = default;
ExpertStore::~ExpertStore() = default;
const fs::path& ExpertStore::dir() const { return impl_->dir; }
const StoreSpec& ExpertStore::spec() const { return impl_->spec; }

std::string ExpertStore::source_path() const {
  return impl_->manifest.at("source").value("path", std::string());
}

uint64_t ExpertStore::bytes() const {
  uint64_t b = 0;
  for (const auto& f : impl_->files) b += f.size;
  return b;
}

ExpertStore ExpertStore::open(const fs::path& dir) {
  auto impl = std::make_unique<Impl>();
  impl->dir = dir;
  const fs::path mpath = dir / kManifest;
  TANDEM_CHECK(fs::is_directory(dir), Errc::io, "store: ", dir.string(), " is not a directory");
  if (!fs::exists(mpath)) {
    bool partial = false;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(dir, ec))
      partial |= entry.path().extension() == ".tpk" || entry.path().filename().string().find(".tpk.tmp.") != std::string::npos;
    TANDEM_FAIL(Errc::io, "store: ", dir.string(), " has no ", kManifest,
                partial ? ": its conversion did not finish (run tandem convert again: it resumes)"
                        : ": not a tandem expert store (make one with tandem convert)");
  }
  std::string text;
  {
    Fd fd(::open(mpath.c_str(), O_RDONLY | O_CLOEXEC));
    TANDEM_CHECK(fd.fd >= 0, Errc::io, "store: cannot open ", mpath.string(), ": ", std::strerror(errno));
    struct stat st {};
    TANDEM_CHECK(::fstat(fd.fd, &st) == 0 && st.st_size <= (64 << 20), Errc::bad_format, "store: ", mpath.string(),
                 " is larger than 64 MiB: not a store manifest");
    text.resize(static_cast<size_t>(st.st_size));
    pread_all(fd.fd, text.data(), text.size(), 0, mpath);
  }
  json& m = impl->manifest;
  try {
    m = json::parse(text);
  } catch (const json::exception& e) {
    TANDEM_FAIL(Errc::bad_format, "store: ", mpath.string(), " is not valid JSON: ", e.what());
  }
  auto field = [&](const char* key) -> const json& {
    TANDEM_CHECK(m.is_object() && m.contains(key), Errc::bad_format, "store: ", mpath.string(), " has no '", key, "'");
    return m[key];
  };
  try {
    TANDEM_CHECK(field("tandem_store").get<int>() == kStoreVersion, Errc::unsupported, "store: ", mpath.string(),
                 ": store version ", m["tandem_store"].dump(), ", this tandem reads ", kStoreVersion,
                 " (convert the checkpoint again)");
    TANDEM_CHECK(field("pack_version").get<int>() == kPackVersion, Errc::unsupported, "store: ", mpath.string(),
                 ": pack version ", m["pack_version"].dump(), ", this tandem's packs are version ", kPackVersion,
                 " (convert the checkpoint again)");
    StoreSpec& s = impl->spec;
    const std::string fname = field("format").get<std::string>();
    s.format = pack_options(fname, 32, false);
    if (s.format.format == WeightFormat::int4 && !s.format.e2m1) {
      s.format.group = field("group").get<int>();
      s.format.symmetric = !field("zero_point").get<bool>();
    }
    s.shape = {field("experts").get<int>(), field("hidden").get<int>(), field("intermediate").get<int>()};
    s.layers = field("layers").get<std::vector<int>>();
    const json& n = field("naming");
    s.naming = {n.at("gate").get<std::string>(), n.at("up").get<std::string>(), n.at("down").get<std::string>()};
    TANDEM_CHECK(s.shape.experts > 0 && s.shape.hidden > 0 && s.shape.inter > 0 && !s.layers.empty(),
                 Errc::bad_format, "store: ", mpath.string(), ": shape or layers are empty");
    impl->sizes = pack_sizes(s);  // refuses an impossible format / group
    const json& entries = field("files");
    TANDEM_CHECK(entries.is_array() && entries.size() == s.layers.size(), Errc::bad_format, "store: ", mpath.string(),
                 ": 'files' lists ", entries.is_array() ? entries.size() : 0, " layer files for ", s.layers.size(),
                 " MoE layers");
    const json& sf = field("source").at("files");
    TANDEM_CHECK(sf.is_array(), Errc::bad_format, "store: ", mpath.string(), ": source.files is not a list");
    for (const json& f : sf)
      for (const char* k : {"name", "size", "mtime_ns", "header_xxh3"})
        TANDEM_CHECK(f.is_object() && f.contains(k), Errc::bad_format, "store: ", mpath.string(),
                     ": an entry of source.files has no '", k, "'");
    const uint64_t want_size = layer_file_size(s);
    for (size_t i = 0; i < entries.size(); ++i) {
      const json& en = entries[i];
      TANDEM_CHECK(en.at("layer").get<int>() == s.layers[i], Errc::bad_format, "store: ", mpath.string(), ": files[",
                   i, "] is model layer ", en.at("layer").dump(), ", expected ", s.layers[i]);
      const std::string name = en.at("name").get<std::string>();
      TANDEM_CHECK(name == layer_file_name(s.layers[i]), Errc::bad_format, "store: ", mpath.string(), ": files[", i,
                   "] is named '", name, "', expected ", layer_file_name(s.layers[i]));
      Impl::File f;
      f.path = dir / name;
      f.size = en.at("size").get<uint64_t>();
      f.data_hash = en.at("data_xxh3").get<std::string>();
      f.source_hash = en.at("source_xxh3").get<std::string>();
      TANDEM_CHECK(f.size == want_size, Errc::bad_format, "store: ", mpath.string(), ": ", name, " is listed with ",
                   f.size, " bytes, its shape and format need ", want_size);
      f.fd = Fd(::open(f.path.c_str(), O_RDONLY | O_CLOEXEC));
      TANDEM_CHECK(f.fd.fd >= 0, Errc::io, "store: cannot open ", f.path.string(), ": ", std::strerror(errno));
      struct stat st {};
      TANDEM_CHECK(::fstat(f.fd.fd, &st) == 0, Errc::io, "store: cannot stat ", f.path.string());
      TANDEM_CHECK(static_cast<uint64_t>(st.st_size) == want_size, Errc::bad_format, "store: ", f.path.string(),
                   " is ", static_cast<uint64_t>(st.st_size), " bytes, the manifest says ", want_size,
                   static_cast<uint64_t>(st.st_size) < want_size ? " (truncated)" : "");
      const json h = read_header(f.fd.fd, f.path);
      const json want = header_json(s, static_cast<int>(i));
      for (auto it = want.begin(); it != want.end(); ++it)
        TANDEM_CHECK(h.contains(it.key()) && h[it.key()] == it.value(), Errc::bad_format, "store: ", f.path.string(),
                     ": header field '", it.key(), "' is ", h.contains(it.key()) ? h[it.key()].dump() : "missing",
                     ", the manifest needs ", it.value().dump());
      TANDEM_CHECK(h.value("data_xxh3", "") == f.data_hash, Errc::bad_format, "store: ", f.path.string(),
                   ": its data hash differs from the manifest's (a file from another conversion)");
      ::posix_fadvise(f.fd.fd, 0, 0, POSIX_FADV_SEQUENTIAL);
      impl->files.push_back(std::move(f));
    }
  } catch (const json::exception& e) {
    TANDEM_FAIL(Errc::bad_format, "store: ", mpath.string(), ": ", e.what());
  }
  return ExpertStore(std::move(impl));
}

void ExpertStore::check(const StoreSpec& want, const Checkpoint& ckpt, const Progress& progress) const {
  const std::string diff = spec_difference(spec_json(impl_->spec), spec_json(want));
  TANDEM_CHECK(diff.empty(), Errc::invalid_argument, "store: ", impl_->dir.string(), " does not hold these experts (",
               diff, "); convert the checkpoint for this configuration or use another store");
  const json& stored = impl_->manifest["source"]["files"];
  const json now = source_files(ckpt);
  auto by_name = [](const json& files) {
    std::map<std::string, json> m;
    for (const json& f : files) m[f.at("name").get<std::string>()] = f;
    return m;
  };
  const auto a = by_name(stored), b = by_name(now);
  try {
  for (const auto& [name, f] : a)
    TANDEM_CHECK(b.count(name), Errc::invalid_argument, "store: ", impl_->dir.string(), " was made from a checkpoint with ",
                 name, ", which ", ckpt.root().string(), " does not have (another model?)");
  bool touched = false;
  for (const auto& [name, f] : b) {
    TANDEM_CHECK(a.count(name), Errc::invalid_argument, "store: ", impl_->dir.string(), " was made from a checkpoint without ",
                 name, ", which ", ckpt.root().string(), " has (another model?)");
    const json& s = a.at(name);
    TANDEM_CHECK(s.at("size") == f.at("size"), Errc::invalid_argument, "store: source file ", name, " changed since ",
                 impl_->dir.string(), " was made (size ", f["size"].dump(), ", was ", s["size"].dump(),
                 "); convert again");
    TANDEM_CHECK(s.at("header_xxh3") == f.at("header_xxh3"), Errc::invalid_argument, "store: source file ", name,
                 " changed since ", impl_->dir.string(), " was made (its tensor list differs); convert again");
    touched |= s.at("mtime_ns") != f.at("mtime_ns");
  }
  if (!touched) return;
  } catch (const json::exception& e) {
    TANDEM_FAIL(Errc::bad_format, "store: ", (impl_->dir / kManifest).string(), ": source.files: ", e.what());
  }
  // Same names, sizes and headers, another modification time (a copy, or an edit in place):
  // the expert tensors themselves decide.
  const int L = static_cast<int>(impl_->spec.layers.size());
  for (int i = 0; i < L; ++i) {
    const std::string h = source_layer_hash(ckpt, impl_->spec, impl_->spec.layers[i]);
    TANDEM_CHECK(h == impl_->files[i].source_hash, Errc::invalid_argument, "store: model layer ",
                 impl_->spec.layers[i], "'s expert tensors in ", ckpt.root().string(), " differ from those ",
                 impl_->dir.string(), " was made from (the checkpoint changed); convert again");
    if (progress) progress(i + 1, L);
  }
}

void ExpertStore::verify(const Progress& progress) const {
  std::vector<std::byte> buf(size_t{8} << 20);
  const int L = static_cast<int>(impl_->files.size());
  for (int i = 0; i < L; ++i) {
    const Impl::File& f = impl_->files[i];
    Hasher h;
    for (uint64_t off = kAlign; off < f.size;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), f.size - off));
      pread_all(f.fd.fd, buf.data(), n, off, f.path);
      h.update(buf.data(), n);
      off += n;
    }
    TANDEM_CHECK(h.hex() == f.data_hash, Errc::bad_format, "store: ", f.path.string(),
                 ": its contents differ from what was written (hash ", h.hex(), ", written ", f.data_hash,
                 "); convert again");
    if (progress) progress(i + 1, L);
  }
}

void ExpertStore::read(int i, int e, int i0, int i1, PackedWeight& gate_up, PackedWeight& down) const {
  const StoreSpec& s = impl_->spec;
  TANDEM_CHECK(i >= 0 && i < static_cast<int>(impl_->files.size()) && e >= 0 && e < s.shape.experts,
               Errc::invalid_argument, "store: MoE layer ", i, " expert ", e, " is outside the store");
  const int unit = intermediate_unit(s.format);
  TANDEM_CHECK(0 <= i0 && i0 < i1 && i1 <= s.shape.inter && i0 % unit == 0 && (i1 == s.shape.inter || i1 % unit == 0),
               Errc::invalid_argument, "store: slice [", i0, ", ", i1, ") of ", s.shape.inter, " is not on a multiple of ",
               unit);
  const Impl::File& f = impl_->files[i];
  const uint64_t base = kAlign + uint64_t{impl_->sizes.stride} * e;
  // gate/up: stored panels 2p, 2p + 1 for gate (= up) panels p of the slice: one run.
  const size_t gu_stride = pack_layout(s.format, s.shape.inter, s.shape.hidden, true).panel_stride;
  TANDEM_CHECK(gate_up.panel_stride == gu_stride && gate_up.bytes() == gu_stride * 2 * gate_up.panels &&
                   gate_up.panels == (i1 - i0 + kPanel - 1) / kPanel,
               Errc::internal, "store: gate_up pack for [", i0, ", ", i1, ") has the wrong layout");
  pread_all(f.fd.fd, gate_up.data.data(), gate_up.bytes(), base + uint64_t{gu_stride} * 2 * (i0 / kPanel), f.path);
  // down: the whole pack, or the columns of each panel.
  const uint64_t dbase = base + align_up(impl_->sizes.gate_up);
  if (i0 == 0 && i1 == s.shape.inter) {
    TANDEM_CHECK(down.bytes() == impl_->sizes.down, Errc::internal, "store: down pack has the wrong size");
    pread_all(f.fd.fd, down.data.data(), down.bytes(), dbase, f.path);
    return;
  }
  const PackedWeight whole = pack_layout(s.format, s.shape.hidden, s.shape.inter);  // the stored pack, no data
  const ColumnBytes cb = column_bytes(whole, i0, i1 - i0);
  TANDEM_CHECK(down.panel_stride == cb.bytes + cb.tail_bytes && down.panels == whole.panels, Errc::internal,
               "store: down pack for [", i0, ", ", i1, ") has the wrong layout");
  for (int p = 0; p < whole.panels; ++p) {
    std::byte* dst = down.data.data() + static_cast<size_t>(p) * down.panel_stride;
    const uint64_t src = dbase + uint64_t{whole.panel_stride} * p;
    pread_all(f.fd.fd, dst, cb.bytes, src + cb.offset, f.path);
    if (cb.tail_bytes) pread_all(f.fd.fd, dst + cb.bytes, cb.tail_bytes, src + cb.tail_offset, f.path);
  }
}

}  // namespace tandem
