// Large byte strings that one connection's outgoing messages reference in place
// (Orphanage::referenceExternalData) instead of copying them into the message. Each is kept
// until the socket write that carries it has completed (the connection's stream hands it to that
// write, see BufferedStream), or until the connection and its server are gone: a message the
// connection never wrote (it broke first) drops its buffer with them. Internal to runtime/.
// Thread-safety: the connection's event-loop thread only.
#pragma once

#include <capnp/blob.h>
#include <kj/common.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace troupe {

// Bytes held now by every connection of this process, and ever held (for tests).
inline std::atomic<uint64_t> gHeldBytes{0};
inline std::atomic<uint64_t> gHeldBytesEver{0};

// One held string; counted in gHeldBytes while it lives.
class HeldBuffer {
 public:
  explicit HeldBuffer(std::string bytes) : bytes_(std::move(bytes)) {
    gHeldBytes += bytes_.size();
    gHeldBytesEver += bytes_.size();
  }
  ~HeldBuffer() { gHeldBytes -= bytes_.size(); }
  KJ_DISALLOW_COPY(HeldBuffer);
  const kj::byte* data() const { return reinterpret_cast<const kj::byte*>(bytes_.data()); }

 private:
  std::string bytes_;
};

class HeldBuffers {
 public:
  // Below this a copy into the message costs less than the bookkeeping.
  static constexpr size_t kReferenceFrom = 64 * 1024;

  // Keeps `bytes` and returns them to reference. Cap'n Proto sends whole 8-byte words, so the
  // bytes up to the next word boundary are zeroed first, in the string's own storage (nothing
  // else of this process's memory goes out).
  capnp::Data::Reader hold(std::string bytes) {
    const size_t size = bytes.size();
    if (size_t padded = (size + 7) & ~size_t{7}; padded != size) {
      bytes.append(padded - size, '\0');
      bytes.resize(size);
    }
    auto owned = std::make_unique<HeldBuffer>(std::move(bytes));
    const kj::byte* data = owned->data();
    held_[data] = std::move(owned);
    return capnp::Data::Reader(data, size);
  }

  bool empty() const { return held_.empty(); }
  size_t size() const { return held_.size(); }

  // Releases the buffers that a write of `pieces` carries, for that write to keep.
  std::vector<std::unique_ptr<HeldBuffer>> carriedBy(kj::ArrayPtr<const kj::ArrayPtr<const kj::byte>> pieces) {
    std::vector<std::unique_ptr<HeldBuffer>> carried;
    for (const auto& piece : pieces) {
      auto it = held_.find(piece.begin());
      if (it == held_.end()) continue;
      carried.push_back(std::move(it->second));
      held_.erase(it);
    }
    return carried;
  }

 private:
  std::unordered_map<const kj::byte*, std::unique_ptr<HeldBuffer>> held_;
};

}  // namespace troupe
