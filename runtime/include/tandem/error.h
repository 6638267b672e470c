// tandem/error.h: the one error type and the one checking macro.
//
//   TANDEM_CHECK(cond, Errc::invalid_argument, "tensor '", name, "' has ", n, " dims");
//
// A failed check throws tandem::Error carrying a category (Errc), the source
// location and a message built from the streamed values; the text reads
// "<what>  [check 'cond' failed at runtime/x.cpp:42]". The Python bindings map
// the category to ValueError / OSError / RuntimeError with the same text.
// Validate at API boundaries with TANDEM_CHECK; inside kernels use assert.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace tandem {

enum class Errc {
  invalid_argument,  // a caller passed something wrong (shape, value, option)
  bad_format,        // a file's contents are malformed (checkpoint, config)
  io,                // the OS refused: open, mmap, read, write
  unsupported,       // valid request this build or machine cannot serve (ISA, dtype)
  internal,          // a bug in tandem: an invariant broke
};

std::string_view errc_name(Errc c) noexcept;

// `s` with every byte that is not part of valid UTF-8 written as \xNN (lower-case hex), as
// Python's "backslashreplace" does: messages that quote a user's bytes (a config key, a file
// name) read the same in every report (the doctor's, an exception's).
std::string escape_invalid_utf8(std::string_view s);

class Error : public std::runtime_error {
 public:
  // what() is the message followed by "  [<where>]" when where is non-empty.
  Error(Errc code, std::string message, std::string_view where = {}, const char* file = "",
        int line = 0);
  Errc code() const noexcept { return code_; }
  // The message without the "[check ... at file:line]" suffix.
  const std::string& message() const noexcept { return message_; }
  const char* file() const noexcept { return file_; }
  int line() const noexcept { return line_; }

 private:
  Errc code_;
  std::string message_;
  const char* file_;
  int line_;
};

namespace detail {
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
[[noreturn]] void throw_check(Errc code, const char* file, int line, const char* cond,
                              std::string message);
}  // namespace detail

// Builds a message from streamable values: tandem::str_cat("n=", n).
using detail::str_cat;

}  // namespace tandem

#define TANDEM_CHECK(cond, code, ...)                                                    \
  do {                                                                                   \
    if (!(cond)) [[unlikely]]                                                            \
      ::tandem::detail::throw_check((code), __FILE__, __LINE__, #cond,                   \
                                    ::tandem::detail::str_cat(__VA_ARGS__));             \
  } while (0)

// Unconditional failure, for branches that are errors by construction.
#define TANDEM_FAIL(code, ...)                                                           \
  ::tandem::detail::throw_check((code), __FILE__, __LINE__, nullptr,                     \
                                ::tandem::detail::str_cat(__VA_ARGS__))
