#include "tandem/fileio.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "tandem/error.h"

namespace tandem {

void write_file_atomic(const std::filesystem::path& path, std::string_view data, std::string_view what) {
  // Unique per process and call, so concurrent writers of one path never share a temporary.
  static std::atomic<uint64_t> serial{0};
  const std::filesystem::path tmp =
      path.string() + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(serial.fetch_add(1));
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TANDEM_CHECK(fd >= 0, Errc::io, what, ": cannot open ", tmp.string(), " for writing: ", std::strerror(errno));
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      TANDEM_FAIL(Errc::io, what, ": writing ", tmp.string(), " failed: ", std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  const bool synced = ::fsync(fd) == 0;
  const int sync_err = errno;
  ::close(fd);
  if (!synced) {
    ::unlink(tmp.c_str());
    TANDEM_FAIL(Errc::io, what, ": fsync of ", tmp.string(), " failed: ", std::strerror(sync_err));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    ::unlink(tmp.c_str());
    TANDEM_FAIL(Errc::io, what, ": cannot rename ", tmp.string(), " to ", path.string(), ": ", ec.message());
  }
}

}  // namespace tandem
