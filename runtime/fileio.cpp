#include "tandem/fileio.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

#include "tandem/error.h"

namespace tandem {

AtomicFile::AtomicFile(std::filesystem::path path, std::string_view what) : path_(std::move(path)), what_(what) {
  // Unique per process and object, so concurrent writers of one path never share a temporary.
  static std::atomic<uint64_t> serial{0};
  tmp_ = path_.string() + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(serial.fetch_add(1));
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TANDEM_CHECK(fd_ >= 0, Errc::io, what_, ": cannot open ", tmp_.string(), " for writing: ", std::strerror(errno));
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!tmp_.empty()) ::unlink(tmp_.c_str());  // not committed
}

void AtomicFile::write_at(uint64_t offset, const void* data, size_t n) {
  const auto* p = static_cast<const std::byte*>(data);
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::pwrite(fd_, p + done, n - done, static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    TANDEM_CHECK(r > 0, Errc::io, what_, ": writing ", tmp_.string(), " failed at byte ", offset + done, ": ",
                 r < 0 ? std::strerror(errno) : "nothing written");
    done += static_cast<size_t>(r);
  }
}

void AtomicFile::commit() {
  TANDEM_CHECK(::fsync(fd_) == 0, Errc::io, what_, ": fsync of ", tmp_.string(), " failed: ", std::strerror(errno));
  ::close(std::exchange(fd_, -1));
  std::error_code ec;
  std::filesystem::rename(tmp_, path_, ec);
  TANDEM_CHECK(!ec, Errc::io, what_, ": cannot rename ", tmp_.string(), " to ", path_.string(), ": ", ec.message());
  tmp_.clear();
  fsync_directory(path_.parent_path().empty() ? "." : path_.parent_path());
}

void fsync_directory(const std::filesystem::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

void write_file_atomic(const std::filesystem::path& path, std::string_view data, std::string_view what) {
  AtomicFile f(path, what);
  f.write_at(0, data.data(), data.size());
  f.commit();
}

}  // namespace tandem
