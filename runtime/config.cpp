#include "tandem/config.h"

#include <yaml-cpp/yaml.h>

#include <charconv>
#include <fstream>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "tandem/cpu_features.h"
#include "tandem/error.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;

struct Ctx {
  std::string origin;
  fs::path base_dir;
};

std::string where(const Ctx& c, const YAML::Mark& m) {
  if (m.line < 0) return c.origin;
  return str_cat(c.origin, ":", m.line + 1, ":", m.column + 1);
}

[[noreturn]] void fail(const Ctx& c, const YAML::Node& n, std::string_view key, std::string_view what) {
  TANDEM_FAIL(Errc::invalid_argument, where(c, n.Mark()), ": ", key, ": ", what);
}

std::string join(std::initializer_list<const char*> items) {
  std::string s;
  for (const char* i : items) s += str_cat(s.empty() ? "" : ", ", i);
  return s;
}

std::string show(const YAML::Node& n) {
  if (n.IsScalar()) return str_cat("'", n.Scalar(), "'");
  if (n.IsSequence()) return "a list";
  if (n.IsMap()) return "a mapping";
  return "nothing";
}

// One mapping of the file: rejects unknown and repeated keys up front, then hands
// out values by name.
class Section {
 public:
  Section(const YAML::Node& node, std::string path, const Ctx& ctx,
          std::initializer_list<const char*> allowed)
      : node_(node), path_(std::move(path)), ctx_(ctx) {
    if (!node || node.IsNull()) return;
    if (!node.IsMap()) fail(ctx, node, path_.empty() ? "top level" : path_, str_cat("expected a mapping with keys ", join(allowed), ", got ", show(node)));
    std::set<std::string> seen;
    for (auto it = node.begin(); it != node.end(); ++it) {
      const std::string k = it->first.Scalar();
      bool ok = false;
      for (const char* a : allowed) ok |= k == a;
      if (!ok) fail(ctx, it->first, key(k), str_cat("unknown key; allowed here: ", join(allowed)));
      if (!seen.insert(k).second) fail(ctx, it->first, key(k), "given twice");
    }
  }
  std::string key(std::string_view k) const { return path_.empty() ? std::string(k) : str_cat(path_, ".", k); }
  // A nested mapping (may be absent or empty).
  YAML::Node get(const char* k) const {
    if (!node_ || !node_.IsMap()) return YAML::Node();
    return node_[k];
  }
  // A leaf value: absent gives an undefined node; a key with no value, or with an
  // explicit YAML tag (!!binary, !!null, ...), is an error rather than a silent default.
  YAML::Node value(const char* k) const {
    if (!node_ || !node_.IsMap()) return YAML::Node(YAML::NodeType::Undefined);
    const YAML::Node& m = node_;  // const lookup: a missing key stays undefined
    YAML::Node n = m[k];
    if (!n.IsDefined()) return n;
    if (n.IsNull()) {  // an empty value has no position of its own: point at its key
      for (auto it = node_.begin(); it != node_.end(); ++it)
        if (it->first.Scalar() == k) fail(ctx_, it->first, key(k), "has no value (remove the key to use the default)");
      fail(ctx_, n, key(k), "has no value (remove the key to use the default)");
    }
    if (n.Tag() != "?" && n.Tag() != "!") fail(ctx_, n, key(k), str_cat("explicit YAML tags are not supported (", n.Tag(), ")"));
    return n;
  }
  const Ctx& ctx() const { return ctx_; }

 private:
  YAML::Node node_;
  std::string path_;
  const Ctx& ctx_;
};

bool present(const YAML::Node& n) { return n.IsDefined() && !n.IsNull(); }

// Plain (unquoted) scalars only for numbers and booleans: "4" in quotes is a string.
bool plain(const YAML::Node& n) { return n.IsScalar() && n.Tag() == "?"; }

long long read_int(const Ctx& c, const YAML::Node& n, const std::string& key, long long lo, long long hi) {
  long long v = 0;
  const std::string& s = n.IsScalar() ? n.Scalar() : std::string();
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (plain(n) && !s.empty() && ec == std::errc::result_out_of_range)
    fail(c, n, key, str_cat(s, " is outside the allowed range [", lo, ", ", hi, "]"));
  if (!plain(n) || s.empty() || ec != std::errc() || p != s.data() + s.size())
    fail(c, n, key, str_cat("expected an integer, got ", show(n)));
  if (v < lo || v > hi) fail(c, n, key, str_cat(v, " is outside the allowed range [", lo, ", ", hi, "]"));
  return v;
}

bool read_bool(const Ctx& c, const YAML::Node& n, const std::string& key) {
  if (plain(n)) {
    const std::string& s = n.Scalar();
    if (s == "true" || s == "True" || s == "yes" || s == "on") return true;
    if (s == "false" || s == "False" || s == "no" || s == "off") return false;
  }
  fail(c, n, key, str_cat("expected true or false, got ", show(n)));
}

std::string read_string(const Ctx& c, const YAML::Node& n, const std::string& key) {
  if (!n.IsScalar() || n.Scalar().empty()) fail(c, n, key, str_cat("expected a non-empty string, got ", show(n)));
  return n.Scalar();
}

std::string read_choice(const Ctx& c, const YAML::Node& n, const std::string& key,
                        std::initializer_list<const char*> allowed) {
  std::string s = n.IsScalar() ? n.Scalar() : std::string();
  for (const char* a : allowed)
    if (n.IsScalar() && s == a) return s;
  fail(c, n, key, str_cat(show(n), " is not one of: ", join(allowed)));
}

std::vector<int> read_id_list(const Ctx& c, const YAML::Node& n, const std::string& key, bool allow_empty) {
  if (!n.IsSequence()) fail(c, n, key, str_cat("expected a list of non-negative integers, got ", show(n)));
  if (!allow_empty && n.size() == 0) fail(c, n, key, "the list is empty");
  std::vector<int> ids;
  std::set<int> seen;
  for (size_t i = 0; i < n.size(); ++i) {
    const int id = static_cast<int>(read_int(c, n[i], str_cat(key, "[", i, "]"), 0, 1 << 20));
    if (!seen.insert(id).second) fail(c, n[i], str_cat(key, "[", i, "]"), str_cat(id, " is listed twice"));
    ids.push_back(id);
  }
  return ids;
}

fs::path resolve(const Ctx& c, const std::string& p) {
  fs::path path(p);
  if (path.is_relative() && !c.base_dir.empty()) path = c.base_dir / path;
  return path.lexically_normal();
}

void parse_cpu(const Section& s, Config::Cpu& cpu) {
  const Ctx& c = s.ctx();
  if (auto n = s.value("format"); present(n)) cpu.format = read_choice(c, n, s.key("format"), {"bf16", "int8", "int4"});
  if (auto n = s.value("group_size"); present(n)) {
    if (cpu.format != "int4") fail(c, n, s.key("group_size"), str_cat("applies only to format int4 (format is ", cpu.format, ")"));
    const std::string v = read_choice(c, n, s.key("group_size"), {"32", "64", "128"});
    cpu.group_size = std::stoi(v);
  }
  if (auto n = s.value("zero_point"); present(n)) {
    if (cpu.format != "int4") fail(c, n, s.key("zero_point"), str_cat("applies only to format int4 (format is ", cpu.format, ")"));
    cpu.zero_point = read_bool(c, n, s.key("zero_point"));
  }
  if (auto n = s.value("numa_nodes"); present(n)) {
    if (!(n.IsScalar() && n.Scalar() == "auto")) cpu.numa_nodes = read_id_list(c, n, s.key("numa_nodes"), false);
  }
  if (auto n = s.value("virtual_subpools"); present(n))
    cpu.virtual_subpools = static_cast<int>(read_int(c, n, s.key("virtual_subpools"), 1, 64));
  if (auto n = s.value("threads"); present(n)) {
    if (!(n.IsScalar() && n.Scalar() == "auto")) cpu.threads = static_cast<int>(read_int(c, n, s.key("threads"), 1, 4096));
  }
  if (auto n = s.value("isa"); present(n)) {
    cpu.isa = read_string(c, n, s.key("isa"));
    if (cpu.isa != "auto") {
      try {
        parse_isa(cpu.isa);
      } catch (const Error& e) {
        fail(c, n, s.key("isa"), e.message());
      }
    }
  }
}

void parse_hot(const Section& parent, const YAML::Node& n, HotExpertsConfig& hot) {
  const Ctx& c = parent.ctx();
  const std::string key = parent.key("hot_experts");
  using P = HotExpertsConfig::Policy;
  if (n.IsScalar()) {  // shorthand: a uniform count
    hot.count = static_cast<int>(read_int(c, n, key, 0, 1 << 20));
    hot.policy = hot.count ? P::uniform : P::none;
    return;
  }
  Section s(n, key, c, {"count", "statistics", "layers"});
  auto count = s.value("count"), stats = s.value("statistics"), layers = s.value("layers");
  if (present(layers)) {
    if (present(count) || present(stats))
      fail(c, layers, s.key("layers"), "explicit per-layer lists exclude 'count' and 'statistics'; give one or the other");
    if (!layers.IsMap()) fail(c, layers, s.key("layers"), str_cat("expected a mapping layer -> [expert ids], got ", show(layers)));
    for (auto it = layers.begin(); it != layers.end(); ++it) {
      const std::string lk = str_cat(s.key("layers"), ".", it->first.Scalar());
      const int layer = static_cast<int>(read_int(c, it->first, lk, 0, 1 << 20));
      if (hot.layers.count(layer)) fail(c, it->first, lk, "layer given twice");
      hot.layers[layer] = read_id_list(c, it->second, lk, true);
    }
    hot.policy = P::explicit_lists;
    return;
  }
  if (present(stats) && !present(count))
    fail(c, stats, s.key("statistics"), "needs 'count' (how many of the most frequent experts per layer go to the GPU)");
  if (present(count)) hot.count = static_cast<int>(read_int(c, count, s.key("count"), 0, 1 << 20));
  if (present(stats)) {
    if (hot.count == 0)
      fail(c, stats, s.key("statistics"), "given with count 0, so nothing would be chosen from it; set count > 0 or remove it");
    hot.statistics = resolve(c, read_string(c, stats, s.key("statistics")));
  }
  hot.policy = hot.count == 0 ? P::none : present(stats) ? P::statistics : P::uniform;
}

void parse_gpu(const Section& s, Config::Gpu& gpu) {
  const Ctx& c = s.ctx();
  if (auto n = s.value("device"); present(n)) {
    const std::string v = n.IsScalar() ? n.Scalar() : std::string();
    long long idx = -1;
    std::string_view digits = v;
    if (digits.substr(0, 5) == "cuda:") digits.remove_prefix(5);
    auto [p, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), idx);
    if (v == "auto" || v == "none") {
      gpu.device = v;
    } else if (!digits.empty() && digits[0] != '-' && digits[0] != '+' && ec == std::errc() && p == digits.data() + digits.size() && idx >= 0 && idx < 1024) {
      gpu.device = str_cat("cuda:", idx);
    } else {
      fail(c, n, s.key("device"), str_cat(show(n), " is not one of: auto, none, a device index (0, 1, ...), cuda:N"));
    }
  }
  if (auto n = s.get("hot_experts"); present(n)) parse_hot(s, n, gpu.hot_experts);
  if (auto n = s.value("deferred_experts"); present(n))
    gpu.deferred_experts = static_cast<int>(read_int(c, n, s.key("deferred_experts"), 0, 256));
}

}  // namespace

std::string_view hot_policy_name(HotExpertsConfig::Policy p) noexcept {
  switch (p) {
    case HotExpertsConfig::Policy::none: return "none";
    case HotExpertsConfig::Policy::uniform: return "uniform";
    case HotExpertsConfig::Policy::statistics: return "statistics";
    case HotExpertsConfig::Policy::explicit_lists: return "explicit";
  }
  return "?";
}

int Config::gpu_index() const {
  if (gpu.device == "none") return -1;
  if (gpu.device == "auto") return -2;
  return std::stoi(gpu.device.substr(5));
}

IsaLevel Config::isa() const { return select_isa(cpu.isa, str_cat(source, ": cpu.isa")); }

Config parse_config(std::string_view yaml, std::string_view origin, const fs::path& base_dir) {
  Ctx c{std::string(origin), base_dir};
  YAML::Node root;
  try {
    std::vector<YAML::Node> docs = YAML::LoadAll(std::string(yaml));
    if (docs.size() > 1)
      fail(c, docs[1], "top level", str_cat("a config is one YAML document; this holds ", docs.size()));
    if (!docs.empty()) root = docs[0];
  } catch (const YAML::ParserException& e) {
    TANDEM_FAIL(Errc::invalid_argument, where(c, e.mark), ": YAML syntax error: ", e.msg);
  }
  Config cfg;
  cfg.source = c.origin;
  Section top(root, "", c, {"version", "model", "cpu", "gpu", "buffers", "trace"});
  if (auto n = top.value("version"); present(n)) cfg.version = static_cast<int>(read_int(c, n, "version", 1, 1));

  Section model(top.get("model"), "model", c, {"path"});
  if (auto n = model.value("path"); present(n)) cfg.model.path = resolve(c, read_string(c, n, "model.path"));

  parse_cpu(Section(top.get("cpu"), "cpu", c,
                    {"format", "group_size", "zero_point", "numa_nodes", "virtual_subpools", "threads", "isa"}),
            cfg.cpu);
  parse_gpu(Section(top.get("gpu"), "gpu", c, {"device", "hot_experts", "deferred_experts"}), cfg.gpu);

  Section buf(top.get("buffers"), "buffers", c, {"pinned_slots", "max_tokens"});
  if (auto n = buf.value("pinned_slots"); present(n)) cfg.buffers.pinned_slots = static_cast<int>(read_int(c, n, "buffers.pinned_slots", 1, 4));
  if (auto n = buf.value("max_tokens"); present(n)) cfg.buffers.max_tokens = static_cast<int>(read_int(c, n, "buffers.max_tokens", 1, 1 << 20));
  if (cfg.gpu.deferred_experts > 0 && cfg.buffers.pinned_slots < 2) {
    // A deferred task still reads its layer's slot while the next layer fills the next
    // one; with a single slot the two would be the same buffer.
    fail(c, buf.value("pinned_slots"), "buffers.pinned_slots",
         "must be at least 2 when gpu.deferred_experts > 0 (deferred experts read their slot during the next layer)");
  }

  Section trace(top.get("trace"), "trace", c, {"path", "enabled"});
  if (auto n = trace.value("path"); present(n)) cfg.trace.path = read_string(c, n, "trace.path");
  if (auto n = trace.value("enabled"); present(n)) cfg.trace.enabled = read_bool(c, n, "trace.enabled");
  return cfg;
}

Config load_config(const fs::path& path) {
  std::error_code ec;
  const auto st = fs::status(path, ec);
  TANDEM_CHECK(st.type() != fs::file_type::not_found, Errc::io, "cannot read config '", path.string(), "': no such file");
  TANDEM_CHECK(fs::is_regular_file(st), Errc::io, "cannot read config '", path.string(), "': not a regular file");
  std::ifstream in(path, std::ios::binary);
  TANDEM_CHECK(in.good(), Errc::io, "cannot read config '", path.string(), "'");
  std::stringstream ss;
  ss << in.rdbuf();
  TANDEM_CHECK(!in.bad(), Errc::io, "error while reading config '", path.string(), "'");
  return parse_config(ss.str(), path.string(), path.parent_path());
}

std::string Config::to_json() const {
  nlohmann::ordered_json j;
  j["source"] = source;
  j["version"] = version;
  j["model"]["path"] = model.path.string();
  j["cpu"] = {{"format", cpu.format},
              {"group_size", cpu.group_size},
              {"zero_point", cpu.zero_point},
              {"numa_nodes", cpu.numa_nodes.empty() ? nlohmann::ordered_json("auto") : nlohmann::ordered_json(cpu.numa_nodes)},
              {"virtual_subpools", cpu.virtual_subpools},
              {"threads", cpu.threads == 0 ? nlohmann::ordered_json("auto") : nlohmann::ordered_json(cpu.threads)},
              {"isa", cpu.isa}};
  nlohmann::ordered_json layers = nlohmann::ordered_json::object();
  for (const auto& [l, ids] : gpu.hot_experts.layers) layers[std::to_string(l)] = ids;
  j["gpu"] = {{"device", gpu.device},
              {"hot_experts",
               {{"policy", hot_policy_name(gpu.hot_experts.policy)},
                {"count", gpu.hot_experts.count},
                {"statistics", gpu.hot_experts.statistics.string()},
                {"layers", layers}}},
              {"deferred_experts", gpu.deferred_experts}};
  j["buffers"] = {{"pinned_slots", buffers.pinned_slots}, {"max_tokens", buffers.max_tokens}};
  j["trace"] = {{"path", trace.path.string()}, {"enabled", trace.enabled}};
  // Replace invalid UTF-8 (a path with odd bytes) instead of throwing.
  return j.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

}  // namespace tandem
