// Not part of any layer: the self-test of the layer check (tests/CMakeLists.txt, test
// layers.back_edge_fails_to_link). Linked into the kernels layer's check, it stands for a
// cpu_kernels/ file calling into the runtime, and that link must fail.
#include <memory>

#include "tandem/stream.h"

namespace tandem {

std::unique_ptr<Stream> layer_back_edge_probe() { return make_host_stream(); }

}  // namespace tandem
