// tandem/expert_store.h: a model's routed experts packed once, on disk, and loaded again
// without re-packing (`tandem convert`; the config's cpu.store).
//
// A store is a directory:
//   manifest.json         what it holds (format, shape, MoE layers, the source checkpoint's
//                         fingerprint, each layer file's size and hash); written last, so a
//                         directory without it is an unfinished conversion that never loads
//   layer-NNNN.tpk        one per MoE layer (NNNN: the model layer): a 4 KiB header (magic,
//                         version, the same facts as JSON), then per expert its gate_up pack
//                         and its down pack, each 4 KiB aligned
// Each expert is stored whole, as one subpool would pack it (pack_gate_up, pack): the layout
// does not depend on the NUMA node count or the thread count of the machine that wrote it.
// A machine with several subpools reads each subpool's slice of the intermediate dimension
// from it: gate/up as a run of panels, down as column ranges of each panel (column_bytes;
// int8 keeps whole-row scales, pack_cols), giving the very packs packing from the checkpoint
// gives there. Reads go with pread into memory first touched by the subpool's own threads
// (node-local, huge pages), not into the page cache's pages.
//
//   StoreSpec spec{shape, layers, pack_options(cfg.cpu), naming};
//   convert_experts(ckpt, spec, "/models/q/tandem-int4-g128", progress);  // resumable
//   ExpertStore store = ExpertStore::open("/models/q/tandem-int4-g128");
//   store.check(spec, ckpt);    // refuses a store for another model, format or source
//   engine.load_store(store, ckpt, naming, progress);
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "tandem/experts.h"
#include "tandem/kernels.h"
#include "tandem/safetensors.h"

namespace tandem {

// The layout version of the packs (kernels.h's formats): a store of another version is
// refused, never read as if it were this one.
inline constexpr int kPackVersion = 1;
// The store's own file layout version.
inline constexpr int kStoreVersion = 1;

// What a store holds: one model's routed experts in one format.
struct StoreSpec {
  MoeShape shape;
  std::vector<int> layers;  // model layer index of each MoE layer, ascending
  PackOptions format;
  ExpertNaming naming;      // the checkpoint names the experts are read from
};

struct ConvertReport {
  int layers_written = 0, layers_kept = 0;  // kept: finished by an earlier, interrupted run
  uint64_t bytes = 0;                       // the store's layer files
  bool up_to_date = false;                  // the directory already held this store
  std::string replaced;                     // non-empty: why the store there no longer loaded
                                            // (a changed source, a truncated file, ...): it was
                                            // finished again, its matching layers kept
};

// Writes the store of `spec` from `ckpt` into `dir` (created if missing). Each layer file is
// written under a temporary name, flushed and renamed; manifest.json comes last. A run that
// was interrupted is resumed: layer files already finished for the same spec and source
// are kept, temporaries are removed. A finished store of the same spec that no longer loads
// (its source changed, a file truncated, another pack version) is finished again the same
// way. A directory holding a finished store of another spec is refused (naming the field),
// never overwritten; so is one another conversion is writing. progress counts experts.
ConvertReport convert_experts(const Checkpoint& ckpt, const StoreSpec& spec, const std::filesystem::path& dir,
                              const Progress& progress = {});

class ExpertStore {
 public:
  // Reads the manifest and every layer file's header, checking sizes: a missing manifest (an
  // unfinished conversion), a truncated or foreign file, or another pack version is an
  // error naming the file and the field.
  static ExpertStore open(const std::filesystem::path& dir);
  ExpertStore(ExpertStore&&) noexcept;
  ExpertStore& operator=(ExpertStore&&) noexcept;
  ~ExpertStore();

  const std::filesystem::path& dir() const;
  const StoreSpec& spec() const;
  uint64_t bytes() const;  // the layer files' packed experts and headers
  std::string source_path() const;  // the checkpoint it was made from, as given then (absolute)

  // Refuses, naming the field, a store that is not `want` (shape, layers, format, group,
  // zero points) or whose source is not `ckpt`: a source file added, missing, resized or
  // with another header is refused at once; one whose modification time changed has its
  // expert tensors hashed again (progress counts layers) and is refused where they differ.
  void check(const StoreSpec& want, const Checkpoint& ckpt, const Progress& progress = {}) const;
  // Reads every layer file and compares its hash with the one written at conversion
  // (bit rot, a file edited in place). progress counts layers.
  void verify(const Progress& progress = {}) const;

  // Expert e of MoE layer i (index into spec().layers): gate/up rows [i0, i1) into gate_up
  // (empty_pack(format, i1 - i0, hidden, true)) and down columns [i0, i1) into down
  // (empty_pack(format, hidden, i1 - i0)). i0, i1 on the format's slice unit
  // (intermediate_slices). Safe to call from several threads at once.
  void read(int i, int e, int i0, int i1, PackedWeight& gate_up, PackedWeight& down) const;

 private:
  struct Impl;
  explicit ExpertStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The directory name `tandem convert` uses by default: "tandem-<format>[-g<group>[-zp]]".
std::string store_dir_name(const PackOptions& format);

}  // namespace tandem
