#include "tandem/error.h"

#include <cstring>

namespace tandem {

std::string_view errc_name(Errc c) noexcept {
  switch (c) {
    case Errc::invalid_argument: return "invalid_argument";
    case Errc::bad_format: return "bad_format";
    case Errc::io: return "io";
    case Errc::unsupported: return "unsupported";
    case Errc::internal: return "internal";
  }
  return "unknown";
}

namespace {
// In-tree code is compiled with -fmacro-prefix-map, so __FILE__ is already relative;
// code outside the tree that uses TANDEM_CHECK (an installed-package consumer) gets its
// path shortened to the last known top-level folder, best effort.
const char* short_path(const char* file) {
  while (std::strncmp(file, "../", 3) == 0) file += 3;  // build dirs pass ../../runtime/x.cpp
  while (std::strncmp(file, "./", 2) == 0) file += 2;
  if (file[0] != '/') return file;
  for (const char* top : {"/cpu_kernels/", "/runtime/", "/gpu/", "/sft/", "/python/", "/tests/", "/bench/"}) {
    if (const char* p = std::strstr(file, top)) return p + 1;
  }
  return file;
}
}  // namespace

Error::Error(Errc code, std::string message, std::string_view where, const char* file, int line)
    : std::runtime_error(where.empty() ? message : str_cat(message, "  [", where, "]")),
      code_(code), message_(std::move(message)), file_(short_path(file)), line_(line) {}

namespace detail {
void throw_check(Errc code, const char* file, int line, const char* cond, std::string message) {
  // The user-facing message comes first; the location is for bug reports.
  std::string where = cond ? str_cat("check '", cond, "' failed at ", short_path(file), ":", line)
                           : str_cat("at ", short_path(file), ":", line);
  if (message.empty()) message = str_cat(errc_name(code), " error");
  throw Error(code, std::move(message), where, file, line);
}
}  // namespace detail

std::string escape_invalid_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<unsigned char>(s[i]);
    // Length of a well-formed sequence starting here (RFC 3629: no overlongs, no surrogates,
    // nothing above U+10FFFF), or 0.
    size_t n = 0;
    if (b < 0x80) n = 1;
    else if (b >= 0xC2 && b <= 0xDF) n = 2;
    else if (b >= 0xE0 && b <= 0xEF) n = 3;
    else if (b >= 0xF0 && b <= 0xF4) n = 4;
    bool ok = n > 0 && i + n <= s.size();
    for (size_t k = 1; ok && k < n; ++k) {
      const auto c = static_cast<unsigned char>(s[i + k]);
      unsigned lo = 0x80, hi = 0xBF;
      if (k == 1 && b == 0xE0) lo = 0xA0;
      if (k == 1 && b == 0xED) hi = 0x9F;
      if (k == 1 && b == 0xF0) lo = 0x90;
      if (k == 1 && b == 0xF4) hi = 0x8F;
      ok = c >= lo && c <= hi;
    }
    if (ok) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[b >> 4];
      out += hex[b & 15];
      ++i;
    }
  }
  return out;
}

}  // namespace tandem
