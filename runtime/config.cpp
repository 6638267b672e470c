#include "tandem/config.h"

#include <yaml.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <initializer_list>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "tandem/cpu_features.h"
#include "tandem/error.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;

struct Ctx {
  std::string origin;
  fs::path base_dir;
};

// ---- the document -------------------------------------------------------------------
// What the schema reads of YAML: scalars, lists and mappings with their positions, built
// from libyaml's events. A general YAML library's node graph is not used: it could share
// or expand nodes behind our back, and the parser in yaml-cpp 0.7 looped forever on some
// two-character files. Here every node is counted, the nesting is bounded and anchors are
// refused while the events arrive, so the work and memory are linear in the input, which
// is itself capped (ConfigLimits).

struct Node {
  enum class Kind { null, scalar, sequence, mapping };
  Kind kind = Kind::null;
  std::string value;               // a scalar's text
  std::string tag;                 // an explicit tag as written, resolved ("!" is the non-specific one); empty: none
  bool plain = false;              // an untagged plain scalar: the only kind that may be a number or a boolean
  int line = -1, column = -1;      // 0-based
  std::vector<const Node*> items;  // a list's items; a mapping's key, value, key, value, ...
};

bool is_scalar(const Node* n) { return n && n->kind == Node::Kind::scalar; }
bool is_list(const Node* n) { return n && n->kind == Node::Kind::sequence; }
bool is_map(const Node* n) { return n && n->kind == Node::Kind::mapping; }

std::string where(const Ctx& c, const Node* n) {
  if (!n || n->line < 0) return c.origin;
  return str_cat(c.origin, ":", n->line + 1, ":", n->column + 1);
}

[[noreturn]] void fail(const Ctx& c, const Node* n, std::string_view key, std::string_view what) {
  TANDEM_FAIL(Errc::invalid_argument, where(c, n), ": ", key, ": ", what);
}

// libyaml accepts UTF-8 only, while a path in a config is bytes (a Linux file name need
// not be UTF-8, and yaml-cpp passed such bytes through). Each byte that is not part of
// valid UTF-8 goes to libyaml as one character of plane 16's private use area and comes
// back as the byte in every scalar; an input that holds such a character itself is
// refused, so the mapping stays one to one.
constexpr uint32_t kByteStandIn = 0x10FF00;  // + the byte (0x80..0xFF)

void put_utf8(std::string& out, uint32_t cp) {
  out += static_cast<char>(0xF0 | (cp >> 18));
  out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
  out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
  out += static_cast<char>(0x80 | (cp & 0x3F));
}

// The length of the valid UTF-8 sequence at s[i] (overlong forms and surrogates are not
// valid), or 0; its code point in *cp.
size_t utf8_at(std::string_view s, size_t i, uint32_t* cp) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = b(0);
  if (c < 0x80) return *cp = c, 1;
  size_t n = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC2 ? 2 : 0;
  if (n == 0 || c > 0xF4 || i + n > s.size()) return 0;
  uint32_t v = c & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) {
    if ((b(k) & 0xC0) != 0x80) return 0;
    v = (v << 6) | (b(k) & 0x3F);
  }
  if ((n == 3 && v < 0x800) || (n == 4 && (v < 0x10000 || v > 0x10FFFF)) || (v >= 0xD800 && v <= 0xDFFF)) return 0;
  return *cp = v, n;
}

std::string to_utf8(const Ctx& c, std::string_view in) {
  std::string out;
  out.reserve(in.size());
  int line = 0, column = 0;
  for (size_t i = 0; i < in.size();) {
    uint32_t cp = 0;
    const size_t n = utf8_at(in, i, &cp);
    if (n == 0) {
      put_utf8(out, kByteStandIn + static_cast<unsigned char>(in[i]));
      ++i;
    } else {
      if (cp >= kByteStandIn + 0x80) {
        char u[16];
        std::snprintf(u, sizeof u, "U+%X", cp);
        TANDEM_FAIL(Errc::invalid_argument, c.origin, ":", line + 1, ":", column + 1, ": YAML syntax error: character ", u,
                    " is not allowed in a config");
      }
      out.append(in.substr(i, n));
      i += n;
    }
    if (in[i - 1] == '\n') line++, column = 0;
    else ++column;
  }
  return out;
}

// libyaml's text back to the input's bytes.
std::string from_utf8(const unsigned char* p, size_t size) {
  std::string_view s(reinterpret_cast<const char*>(p), size);
  std::string out;
  out.reserve(size);
  for (size_t i = 0; i < s.size();) {
    uint32_t cp = 0;
    const size_t n = std::max<size_t>(1, utf8_at(s, i, &cp));
    if (n == 4 && cp >= kByteStandIn + 0x80) out += static_cast<char>(cp - kByteStandIn);
    else out.append(s.substr(i, n));
    i += n;
  }
  return out;
}

std::string text(const yaml_char_t* p) {
  return p ? from_utf8(p, std::char_traits<char>::length(reinterpret_cast<const char*>(p))) : std::string();
}

struct Document {
  std::deque<Node> nodes;  // a deque: the nodes point at each other
  const Node* root = nullptr;
  const Node* second_root = nullptr;  // the next document's, when the file holds more than one
  int documents = 0;
};

// The key path of `next`, a node about to be added to the innermost open collection
// (for errors raised while reading, before the schema has seen anything).
std::string path_to(const std::vector<Node*>& open, const Node& next) {
  std::string path;
  auto add = [&](const Node* key) { path += str_cat(path.empty() ? "" : ".", is_scalar(key) ? key->value : "?"); };
  for (size_t i = 0; i < open.size(); ++i) {
    const Node* n = open[i];
    const bool last = i + 1 == open.size();  // the child is `next`; else the last item, added already
    const size_t child = last ? n->items.size() : n->items.size() - 1;
    if (n->kind == Node::Kind::sequence) path += str_cat("[", child, "]");
    else if (child % 2 == 1) add(n->items[child - 1]);  // a value: its key names it
    else if (last) add(&next);                          // a key: its own name
  }
  return path.empty() ? "top level" : path;
}

[[noreturn]] void too_large(const std::string& origin, std::string_view size, size_t limit) {
  TANDEM_FAIL(Errc::invalid_argument, origin, ": the config is ", size, ", over the limit of ", limit,
              " bytes (TANDEM_CONFIG_MAX_BYTES raises it)");
}

Document read_yaml(const Ctx& c, std::string_view input, const ConfigLimits& limits) {
  if (input.size() > limits.max_bytes) too_large(c.origin, str_cat(input.size(), " bytes"), limits.max_bytes);
  const std::string utf8 = to_utf8(c, input);
  yaml_parser_t parser;
  if (!yaml_parser_initialize(&parser)) throw std::bad_alloc();
  std::unique_ptr<yaml_parser_t, void (*)(yaml_parser_t*)> parser_guard(&parser, yaml_parser_delete);
  yaml_parser_set_input_string(&parser, reinterpret_cast<const unsigned char*>(utf8.data()), utf8.size());
  yaml_parser_set_encoding(&parser, YAML_UTF8_ENCODING);  // never guessed: the input is what to_utf8 made

  Document doc;
  std::vector<Node*> open;  // the collections being read, outermost first
  for (bool done = false; !done;) {
    yaml_event_t ev;
    if (!yaml_parser_parse(&parser, &ev)) {
      std::string msg = parser.problem ? parser.problem : "unknown error";
      size_t line = parser.problem_mark.line, column = parser.problem_mark.column;
      if (parser.error == YAML_READER_ERROR) {  // a byte offset into the text given to libyaml
        line = column = 0;
        for (size_t i = 0; i < parser.problem_offset && i < utf8.size(); ++i) {
          if (utf8[i] == '\n') line++, column = 0;
          else if ((static_cast<unsigned char>(utf8[i]) & 0xC0) != 0x80) ++column;
        }
        if (parser.problem_value >= 0) msg += str_cat(" (character ", parser.problem_value, ")");
      } else if (parser.context) {
        msg += str_cat(" (", parser.context, " at ", parser.context_mark.line + 1, ":", parser.context_mark.column + 1, ")");
      }
      TANDEM_FAIL(Errc::invalid_argument, c.origin, ":", line + 1, ":", column + 1, ": YAML syntax error: ", msg);
    }
    std::unique_ptr<yaml_event_t, void (*)(yaml_event_t*)> ev_guard(&ev, yaml_event_delete);
    Node* node = nullptr;
    const yaml_char_t* anchor = nullptr;
    const yaml_char_t* tag = nullptr;
    switch (ev.type) {
      case YAML_STREAM_END_EVENT: done = true; break;
      case YAML_DOCUMENT_START_EVENT: doc.documents++; break;
      case YAML_SEQUENCE_END_EVENT:
      case YAML_MAPPING_END_EVENT: open.pop_back(); break;
      case YAML_ALIAS_EVENT: {
        Node at;
        at.line = static_cast<int>(ev.start_mark.line), at.column = static_cast<int>(ev.start_mark.column);
        fail(c, &at, path_to(open, at),
             str_cat("YAML aliases are not supported (*", text(ev.data.alias.anchor), "); write the value out"));
      }
      case YAML_SCALAR_EVENT:
        node = &doc.nodes.emplace_back();
        anchor = ev.data.scalar.anchor, tag = ev.data.scalar.tag;
        node->value = from_utf8(ev.data.scalar.value, ev.data.scalar.length);
        node->plain = !tag && ev.data.scalar.style == YAML_PLAIN_SCALAR_STYLE;
        node->kind = node->plain && (node->value.empty() || node->value == "~" || node->value == "null" ||
                                     node->value == "Null" || node->value == "NULL")
                         ? Node::Kind::null
                         : Node::Kind::scalar;
        break;
      case YAML_SEQUENCE_START_EVENT:
        node = &doc.nodes.emplace_back();
        node->kind = Node::Kind::sequence;
        anchor = ev.data.sequence_start.anchor, tag = ev.data.sequence_start.tag;
        break;
      case YAML_MAPPING_START_EVENT:
        node = &doc.nodes.emplace_back();
        node->kind = Node::Kind::mapping;
        anchor = ev.data.mapping_start.anchor, tag = ev.data.mapping_start.tag;
        break;
      default: break;  // stream start, document end
    }
    if (!node) continue;
    node->line = static_cast<int>(ev.start_mark.line), node->column = static_cast<int>(ev.start_mark.column);
    node->tag = text(tag);
    const bool collection = node->kind == Node::Kind::sequence || node->kind == Node::Kind::mapping;
    if (anchor)
      fail(c, node, path_to(open, *node),
           str_cat("YAML anchors are not supported (&", text(anchor), "); write the value out where it is used"));
    if (doc.nodes.size() > limits.max_nodes)
      TANDEM_FAIL(Errc::invalid_argument, where(c, node), ": more than ", limits.max_nodes,
                  " YAML nodes, over the limit (TANDEM_CONFIG_MAX_NODES raises it)");
    if (collection && static_cast<int64_t>(open.size()) >= limits.max_depth)
      fail(c, node, path_to(open, *node),
           str_cat("nested more than ", limits.max_depth, " levels deep, over the limit (TANDEM_CONFIG_MAX_DEPTH raises it)"));
    if (!open.empty()) {
      open.back()->items.push_back(node);
    } else if (doc.documents == 1) {
      doc.root = node;
    } else if (!doc.second_root) {
      doc.second_root = node;
    }
    if (collection) open.push_back(node);
  }
  return doc;
}

std::string join(std::initializer_list<const char*> items) {
  std::string s;
  for (const char* i : items) s += str_cat(s.empty() ? "" : ", ", i);
  return s;
}

const std::string& scalar(const Node* n) {
  static const std::string none;
  return is_scalar(n) ? n->value : none;
}

std::string show(const Node* n) {
  if (is_scalar(n)) return str_cat("'", n->value, "'");
  if (is_list(n)) return "a list";
  if (is_map(n)) return "a mapping";
  return "nothing";
}

// Explicit tags (!!binary, !!str, !foo, ...) change what a value means in ways the schema
// does not follow: refused wherever they are, rather than silently ignored.
void check_untagged(const Ctx& c, const Node* n, std::string_view key) {
  if (n && !n->tag.empty() && n->tag != "!") fail(c, n, key, str_cat("explicit YAML tags are not supported (", n->tag, ")"));
}

// One mapping of the file: rejects unknown and repeated keys up front, then hands
// out values by name.
class Section {
 public:
  Section(const Node* node, std::string path, const Ctx& ctx, std::initializer_list<const char*> allowed)
      : node_(node), path_(std::move(path)), ctx_(ctx) {
    if (!node || node->kind == Node::Kind::null) return;
    const std::string self = path_.empty() ? "top level" : path_;
    if (!is_map(node)) fail(ctx, node, self, str_cat("expected a mapping with keys ", join(allowed), ", got ", show(node)));
    check_untagged(ctx, node, self);
    std::set<std::string> seen;
    for (size_t i = 0; i < node->items.size(); i += 2) {
      const Node* kn = node->items[i];
      const std::string& k = scalar(kn);
      bool ok = false;
      for (const char* a : allowed) ok |= k == a;
      if (!ok) fail(ctx, kn, key(k), str_cat("unknown key; allowed here: ", join(allowed)));
      if (!seen.insert(k).second) fail(ctx, kn, key(k), "given twice");
    }
  }
  std::string key(std::string_view k) const { return path_.empty() ? std::string(k) : str_cat(path_, ".", k); }
  // A nested mapping (absent: nullptr).
  const Node* get(const char* k) const { return lookup(k); }
  // A leaf value: absent gives nullptr; a key with no value, or with an explicit YAML
  // tag (!!binary, !!null, ...), is an error rather than a silent default.
  const Node* value(const char* k) const {
    const Node* kn = nullptr;
    const Node* n = lookup(k, &kn);
    if (!n) return nullptr;
    if (n->kind == Node::Kind::null)  // an empty value: point at its key
      fail(ctx_, kn, key(k), "has no value (remove the key to use the default)");
    check_untagged(ctx_, n, key(k));
    return n;
  }
  const Ctx& ctx() const { return ctx_; }

 private:
  const Node* lookup(const char* k, const Node** key_node = nullptr) const {
    if (!is_map(node_)) return nullptr;
    for (size_t i = 0; i + 1 < node_->items.size(); i += 2) {
      if (!is_scalar(node_->items[i]) || node_->items[i]->value != k) continue;
      if (key_node) *key_node = node_->items[i];
      return node_->items[i + 1];
    }
    return nullptr;
  }
  const Node* node_;
  std::string path_;
  const Ctx& ctx_;
};

bool present(const Node* n) { return n && n->kind != Node::Kind::null; }

long long read_int(const Ctx& c, const Node* n, const std::string& key, long long lo, long long hi) {
  long long v = 0;
  const std::string& s = scalar(n);
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  const bool plain = is_scalar(n) && n->plain;  // "4" in quotes is a string
  if (plain && !s.empty() && ec == std::errc::result_out_of_range)
    fail(c, n, key, str_cat(s, " is outside the allowed range [", lo, ", ", hi, "]"));
  if (!plain || s.empty() || ec != std::errc() || p != s.data() + s.size())
    fail(c, n, key, str_cat("expected an integer, got ", show(n)));
  if (v < lo || v > hi) fail(c, n, key, str_cat(v, " is outside the allowed range [", lo, ", ", hi, "]"));
  return v;
}

double read_double(const Ctx& c, const Node* n, const std::string& key, double lo, double hi) {
  double v = 0;
  const std::string& s = scalar(n);
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (!is_scalar(n) || !n->plain || s.empty() || ec != std::errc() || p != s.data() + s.size() || !std::isfinite(v))
    fail(c, n, key, str_cat("expected a number, got ", show(n)));
  if (v < lo || v > hi) fail(c, n, key, str_cat(s, " is outside the allowed range [", lo, ", ", hi, "]"));
  return v;
}

bool read_bool(const Ctx& c, const Node* n, const std::string& key) {
  if (is_scalar(n) && n->plain) {
    const std::string& s = n->value;
    if (s == "true" || s == "True" || s == "yes" || s == "on") return true;
    if (s == "false" || s == "False" || s == "no" || s == "off") return false;
  }
  fail(c, n, key, str_cat("expected true or false, got ", show(n)));
}

std::string read_string(const Ctx& c, const Node* n, const std::string& key) {
  if (!is_scalar(n) || n->value.empty()) fail(c, n, key, str_cat("expected a non-empty string, got ", show(n)));
  return n->value;
}

std::string read_choice(const Ctx& c, const Node* n, const std::string& key, std::initializer_list<const char*> allowed) {
  for (const char* a : allowed)
    if (is_scalar(n) && n->value == a) return n->value;
  fail(c, n, key, str_cat(show(n), " is not one of: ", join(allowed)));
}

std::vector<int> read_id_list(const Ctx& c, const Node* n, const std::string& key, bool allow_empty) {
  if (!is_list(n)) fail(c, n, key, str_cat("expected a list of non-negative integers, got ", show(n)));
  check_untagged(c, n, key);
  if (!allow_empty && n->items.empty()) fail(c, n, key, "the list is empty");
  std::vector<int> ids;
  std::set<int> seen;
  for (size_t i = 0; i < n->items.size(); ++i) {
    const Node* item = n->items[i];
    const int id = static_cast<int>(read_int(c, item, str_cat(key, "[", i, "]"), 0, 1 << 20));
    if (!seen.insert(id).second) fail(c, item, str_cat(key, "[", i, "]"), str_cat(id, " is listed twice"));
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
  if (auto n = s.value("store"); present(n)) cpu.store = resolve(c, read_string(c, n, "cpu.store"));
  if (auto n = s.value("format"); present(n)) cpu.format = read_choice(c, n, s.key("format"), {"bf16", "int8", "int4", "mxfp4"});
  if (auto n = s.value("dense_format"); present(n))
    cpu.dense_format = read_choice(c, n, s.key("dense_format"), {"auto", "torch", "bf16", "int8", "int4"});
  const bool int4 = cpu.format == "int4" || cpu.dense_format == "int4";
  if (auto n = s.value("group_size"); present(n)) {
    if (!int4)
      fail(c, n, s.key("group_size"),
           str_cat("applies only to format or dense_format int4 (format is ", cpu.format, ", dense_format ",
                   cpu.dense_format, ")"));
    const std::string v = read_choice(c, n, s.key("group_size"), {"32", "64", "128"});
    cpu.group_size = std::stoi(v);
  }
  if (auto n = s.value("zero_point"); present(n)) {
    if (!int4)
      fail(c, n, s.key("zero_point"),
           str_cat("applies only to format or dense_format int4 (format is ", cpu.format, ", dense_format ",
                   cpu.dense_format, ")"));
    cpu.zero_point = read_bool(c, n, s.key("zero_point"));
  }
  if (auto n = s.value("numa_nodes"); present(n)) {
    if (scalar(n) != "auto") cpu.numa_nodes = read_id_list(c, n, s.key("numa_nodes"), false);
  }
  if (auto n = s.value("virtual_subpools"); present(n))
    cpu.virtual_subpools = static_cast<int>(read_int(c, n, s.key("virtual_subpools"), 1, 64));
  if (auto n = s.value("threads"); present(n)) {
    if (scalar(n) != "auto") cpu.threads = static_cast<int>(read_int(c, n, s.key("threads"), 1, 4096));
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

void parse_hot(const Section& parent, const Node* n, HotExpertsConfig& hot) {
  const Ctx& c = parent.ctx();
  const std::string key = parent.key("hot_experts");
  using P = HotExpertsConfig::Policy;
  if (is_scalar(n)) {  // shorthand: a uniform count, or auto
    check_untagged(c, n, key);
    if (scalar(n) == "auto") {
      hot.auto_count = true;
      hot.policy = P::uniform;
      return;
    }
    hot.count = static_cast<int>(read_int(c, n, key, 0, 1 << 20));
    hot.policy = hot.count ? P::uniform : P::none;
    return;
  }
  Section s(n, key, c, {"count", "statistics", "layers", "dynamic", "rebalance_steps", "hysteresis"});
  auto count = s.value("count"), stats = s.value("statistics"), layers = s.value("layers");
  auto dynamic = s.value("dynamic"), every = s.value("rebalance_steps"), hyst = s.value("hysteresis");
  if (present(dynamic)) hot.dynamic = read_bool(c, dynamic, s.key("dynamic"));
  if (present(every)) {
    if (!hot.dynamic) fail(c, every, s.key("rebalance_steps"), "applies only with 'dynamic: true'");
    hot.rebalance_steps = static_cast<int>(read_int(c, every, s.key("rebalance_steps"), 1, 1 << 30));
  }
  if (present(hyst)) {
    if (!hot.dynamic) fail(c, hyst, s.key("hysteresis"), "applies only with 'dynamic: true'");
    hot.hysteresis = read_double(c, hyst, s.key("hysteresis"), 0.0, 100.0);
  }
  if (hot.dynamic && present(layers))
    fail(c, dynamic, s.key("dynamic"), "dynamic hot experts start from 'count' (uniform or with 'statistics'), not "
                                       "from explicit per-layer lists");
  if (hot.dynamic && !present(count))
    fail(c, dynamic, s.key("dynamic"), "needs 'count' (how many experts per layer the GPU holds)");
  if (present(layers)) {
    if (present(count) || present(stats))
      fail(c, layers, s.key("layers"), "explicit per-layer lists exclude 'count' and 'statistics'; give one or the other");
    if (!is_map(layers)) fail(c, layers, s.key("layers"), str_cat("expected a mapping layer -> [expert ids], got ", show(layers)));
    for (size_t i = 0; i + 1 < layers->items.size(); i += 2) {
      const Node* kn = layers->items[i];
      const std::string lk = str_cat(s.key("layers"), ".", scalar(kn));
      const int layer = static_cast<int>(read_int(c, kn, lk, 0, 1 << 20));
      if (hot.layers.count(layer)) fail(c, kn, lk, "layer given twice");
      hot.layers[layer] = read_id_list(c, layers->items[i + 1], lk, true);
    }
    hot.policy = P::explicit_lists;
    return;
  }
  if (present(stats) && !present(count))
    fail(c, stats, s.key("statistics"), "needs 'count' (how many of the most frequent experts per layer go to the GPU)");
  if (present(count) && scalar(count) == "auto")
    hot.auto_count = true;
  else if (present(count))
    hot.count = static_cast<int>(read_int(c, count, s.key("count"), 0, 1 << 20));
  if (present(stats)) {
    if (hot.count == 0 && !hot.auto_count)
      fail(c, stats, s.key("statistics"), "given with count 0, so nothing would be chosen from it; set count > 0 or remove it");
    hot.statistics = resolve(c, read_string(c, stats, s.key("statistics")));
  }
  hot.policy = hot.count == 0 && !hot.auto_count ? P::none : present(stats) ? P::statistics : P::uniform;
  if (hot.dynamic && hot.count == 0 && !hot.auto_count)
    fail(c, dynamic, s.key("dynamic"), "given with count 0, so there is nothing to move; set count > 0 or remove it");
}

void parse_gpu(const Section& s, Config::Gpu& gpu) {
  const Ctx& c = s.ctx();
  if (auto n = s.value("device"); present(n)) {
    const std::string v = scalar(n);
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

// A positive integer from the environment variable `name`, or `fallback` when it is unset.
template <typename T>
T limit_from_env(const char* name, T fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  const std::string_view s(v);
  T n = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), n);
  TANDEM_CHECK(ec == std::errc() && p == s.data() + s.size() && n > 0, Errc::invalid_argument, name, "='", s,
               "' is not a positive integer");
  return n;
}

}  // namespace

ConfigLimits ConfigLimits::from_env() {
  ConfigLimits l;
  l.max_bytes = limit_from_env<size_t>("TANDEM_CONFIG_MAX_BYTES", l.max_bytes);
  l.max_depth = limit_from_env<int>("TANDEM_CONFIG_MAX_DEPTH", l.max_depth);
  l.max_nodes = limit_from_env<size_t>("TANDEM_CONFIG_MAX_NODES", l.max_nodes);
  return l;
}

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

Config parse_config(std::string_view yaml, std::string_view origin, const fs::path& base_dir, const ConfigLimits& limits) {
  Ctx c{std::string(origin), base_dir};
  const Document doc = read_yaml(c, yaml, limits);
  if (doc.documents > 1)
    fail(c, doc.second_root, "top level", str_cat("a config is one YAML document; this holds ", doc.documents));
  Config cfg;
  cfg.source = c.origin;
  Section top(doc.root, "", c, {"version", "model", "cpu", "gpu", "buffers", "trace", "train", "distributed"});
  if (auto n = top.value("version"); present(n)) cfg.version = static_cast<int>(read_int(c, n, "version", 1, 1));

  Section model(top.get("model"), "model", c, {"path"});
  if (auto n = model.value("path"); present(n)) cfg.model.path = resolve(c, read_string(c, n, "model.path"));

  parse_cpu(Section(top.get("cpu"), "cpu", c,
                    {"format", "dense_format", "group_size", "zero_point", "numa_nodes", "virtual_subpools", "threads",
                     "isa", "store"}),
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

  Section train(top.get("train"), "train", c, {"backward_format"});
  if (auto n = train.value("backward_format"); present(n))
    cfg.train.backward_format = read_choice(c, n, "train.backward_format", {"bf16", "int8"});

  Section dist(top.get("distributed"), "distributed", c, {"cpu_experts", "comm", "alltoall_from_tokens"});
  if (auto n = dist.value("cpu_experts"); present(n))
    cfg.distributed.cpu_experts = read_choice(c, n, "distributed.cpu_experts", {"auto", "shared", "per_rank"});
  if (auto n = dist.value("comm"); present(n))
    cfg.distributed.comm = read_choice(c, n, "distributed.comm", {"auto", "allgather", "alltoall"});
  if (auto n = dist.value("alltoall_from_tokens"); present(n)) {
    cfg.distributed.alltoall_from_tokens =
        scalar(n) == "auto" ? 0 : static_cast<int>(read_int(c, n, "distributed.alltoall_from_tokens", 1, 1 << 24));
  }
  return cfg;
}

Config load_config(const fs::path& path, const ConfigLimits& limits) {
  std::error_code ec;
  const auto st = fs::status(path, ec);
  TANDEM_CHECK(st.type() != fs::file_type::not_found, Errc::io, "cannot read config '", path.string(), "': no such file");
  TANDEM_CHECK(fs::is_regular_file(st), Errc::io, "cannot read config '", path.string(), "': not a regular file");
  // Checked before reading (a multi-gigabyte file is refused without being read), and
  // again by the reads, which never go past the limit (the file may change meanwhile).
  const uintmax_t size = fs::file_size(path, ec);
  if (!ec && size > limits.max_bytes) too_large(path.string(), str_cat(size, " bytes"), limits.max_bytes);
  std::ifstream in(path, std::ios::binary);
  TANDEM_CHECK(in.good(), Errc::io, "cannot read config '", path.string(), "'");
  std::string text;
  char buf[1 << 16];
  while (text.size() <= limits.max_bytes) {
    in.read(buf, static_cast<std::streamsize>(std::min<size_t>(sizeof buf, limits.max_bytes + 1 - text.size())));
    text.append(buf, static_cast<size_t>(in.gcount()));
    if (!in) break;
  }
  TANDEM_CHECK(!in.bad(), Errc::io, "error while reading config '", path.string(), "'");
  if (text.size() > limits.max_bytes) too_large(path.string(), "larger", limits.max_bytes);
  return parse_config(text, path.string(), path.parent_path(), limits);
}

std::string Config::to_json() const {
  nlohmann::ordered_json j;
  j["source"] = source;
  j["version"] = version;
  j["model"]["path"] = model.path.string();
  j["cpu"] = {{"format", cpu.format},
              {"dense_format", cpu.dense_format},
              {"group_size", cpu.group_size},
              {"zero_point", cpu.zero_point},
              {"numa_nodes", cpu.numa_nodes.empty() ? nlohmann::ordered_json("auto") : nlohmann::ordered_json(cpu.numa_nodes)},
              {"virtual_subpools", cpu.virtual_subpools},
              {"threads", cpu.threads == 0 ? nlohmann::ordered_json("auto") : nlohmann::ordered_json(cpu.threads)},
              {"isa", cpu.isa},
              {"store", cpu.store.string()}};
  nlohmann::ordered_json layers = nlohmann::ordered_json::object();
  for (const auto& [l, ids] : gpu.hot_experts.layers) layers[std::to_string(l)] = ids;
  j["gpu"] = {{"device", gpu.device},
              {"hot_experts",
               {{"policy", hot_policy_name(gpu.hot_experts.policy)},
                {"count", gpu.hot_experts.auto_count ? nlohmann::ordered_json("auto")
                                                     : nlohmann::ordered_json(gpu.hot_experts.count)},
                {"statistics", gpu.hot_experts.statistics.string()},
                {"layers", layers},
                {"dynamic", gpu.hot_experts.dynamic},
                {"rebalance_steps", gpu.hot_experts.rebalance_steps},
                {"hysteresis", gpu.hot_experts.hysteresis}}},
              {"deferred_experts", gpu.deferred_experts}};
  j["buffers"] = {{"pinned_slots", buffers.pinned_slots}, {"max_tokens", buffers.max_tokens}};
  j["trace"] = {{"path", trace.path.string()}, {"enabled", trace.enabled}};
  j["train"] = {{"backward_format", train.backward_format}};
  j["distributed"] = {{"cpu_experts", distributed.cpu_experts},
                      {"comm", distributed.comm},
                      {"alltoall_from_tokens", distributed.alltoall_from_tokens == 0
                                                   ? nlohmann::ordered_json("auto")
                                                   : nlohmann::ordered_json(distributed.alltoall_from_tokens)}};
  // Replace invalid UTF-8 (a path with odd bytes) instead of throwing.
  return j.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

void HotExpertsConfig::keep_on_cpu(const std::string& where, const std::string& experts) {
  if (auto_count) {
    auto_count = false;
    count = 0;
    policy = Policy::none;
    dynamic = false;
  }
  TANDEM_CHECK(policy == Policy::none, Errc::unsupported, where, ": gpu.hot_experts: hot experts run silu(gate) * up "
               "experts without biases only; this model's experts are ", experts,
               ": set gpu.hot_experts to none or auto (every expert on the CPU)");
}

}  // namespace tandem
