// Fuzz target: a rank image's header, as read from a file or received from a peer
// (replicaCommit). Any input must parse or be refused; nothing may read outside it.
#include <cstdint>
#include <cstring>
#include <vector>

#include "troupe/checkpoint/image.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace troupe::checkpoint;
  // A private copy of exactly `size` bytes, so ASan sees any read past the end.
  std::vector<uint8_t> copy(data, data + size);
  auto extent = peekImage(copy.data(), copy.size());
  auto header = parseImageHeader(copy.data(), copy.size());
  if (header.isOk()) {
    // A header that parses describes tensors inside the image it claims.
    const auto& layout = header->layout;
    for (size_t i = 0; i < layout.tensors().size(); ++i) {
      if (layout.tensorOffset(i) + layout.tensors()[i].bytes > layout.imageBytes()) __builtin_trap();
    }
    if (layout.imageBytes() <= copy.size()) (void)verifyImageData(*header, copy.data());
  }
  (void)extent;
  return 0;
}
