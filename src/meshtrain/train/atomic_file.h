// Writes a file so that readers, and a crash at any moment, see either the
// previous file at that path or the complete new one, never a partial file.
//
// The content goes to a temporary file in the same directory, which is
// fsynced, renamed over the target, and the directory is fsynced so the
// rename itself is durable. If anything fails (a write error, a full disk,
// an exception from the producer), the temporary is removed, the old file
// is untouched, and the error propagates. Blocks on disk I/O.
#pragma once

#include <cstddef>
#include <functional>
#include <string>

namespace mt {

// Receives consecutive pieces of a byte stream.
using ByteSink = std::function<void(const void* data, size_t n)>;

// Calls produce(sink) once; everything given to the sink becomes the new
// content of `path`. I/O failures throw FileError naming the path, the stage
// and the system error.
void write_file_atomically(const std::string& path,
                           const std::function<void(const ByteSink& sink)>& produce);

}  // namespace mt
