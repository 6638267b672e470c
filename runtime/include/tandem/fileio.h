// tandem/fileio.h: writing files so a reader never sees a half-written one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace tandem {

// A file written under a temporary name next to `path` (unique per process and object) and
// renamed over `path` by commit(), after a flush to disk: the target holds either the old
// contents or all of the new ones. Without commit() (an error, an exception) the temporary is
// removed. `what` names the file's role in errors ("trace", "store layer").
class AtomicFile {
 public:
  AtomicFile(std::filesystem::path path, std::string_view what);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  // Writes n bytes at `offset` (any order; holes read as zeros).
  void write_at(uint64_t offset, const void* data, size_t n);
  void commit();  // fsync, rename over the target, fsync its directory

 private:
  std::filesystem::path path_, tmp_;
  std::string what_;
  int fd_ = -1;
};

// Flushes a directory's entries (a rename or removal in it) to disk; best effort, since
// some filesystems refuse a directory fsync.
void fsync_directory(const std::filesystem::path& dir);

// The whole of `data` as one AtomicFile.
void write_file_atomic(const std::filesystem::path& path, std::string_view data, std::string_view what);

}  // namespace tandem
