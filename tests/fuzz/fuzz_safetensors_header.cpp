// libFuzzer: arbitrary bytes as a whole safetensors file. The parser must either
// throw tandem::Error or return tensors that lie inside the file; ASan/UBSan catch
// any out-of-bounds read or undefined behaviour on the way.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "tandem/error.h"
#include "tandem/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto h = tandem::parse_safetensors_header({reinterpret_cast<const std::byte*>(data), size}, "fuzz");
    for (const auto& t : h.tensors)
      if (t.begin > t.end || h.data_offset + t.end > size || t.nbytes() != t.numel() * tandem::dtype_size(t.dtype))
        std::abort();
  } catch (const tandem::Error&) {
  }
  return 0;
}
