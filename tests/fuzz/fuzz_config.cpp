// libFuzzer: arbitrary bytes as a placement config file. The parser (runtime/config.cpp
// over libyaml) must either return a Config, whose JSON can always be written, or throw
// tandem::Error; anything else (another exception, a crash, a hang past -timeout, memory
// past -rss_limit_mb) is a finding. ASan/UBSan watch tandem's side of the parse.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "tandem/config.h"
#include "tandem/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const tandem::Config c = tandem::parse_config(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz.yaml", "/base");
    (void)c.to_json();
  } catch (const tandem::Error&) {
  }
  return 0;
}
