// tandem/fileio.h: writing files so a reader never sees a half-written one.
#pragma once

#include <filesystem>
#include <string_view>

namespace tandem {

// Writes `data` to a temporary file next to `path`, flushes it to disk, then renames it
// over `path`: the target holds either the old contents or all of the new ones. `what`
// names the file's role in errors ("trace", "routing statistics").
void write_file_atomic(const std::filesystem::path& path, std::string_view data, std::string_view what);

}  // namespace tandem
