// Large byte strings that one connection's outgoing messages reference in place
// (Orphanage::referenceExternalData) instead of copying them into the message. Each is kept
// until the socket write that carries it has completed (the connection's stream hands it to that
// write, see BufferedStream), or until the connection and its server are gone: a message the
// connection never wrote (it broke first) drops its buffer with them. Internal to runtime/.
// Thread-safety: the connection's event-loop thread only.
#pragma once

#include <capnp/blob.h>
#include <capnp/orphan.h>
#include <kj/common.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace troupe {

// Bytes from this size on go into a message by reference, not copied: calls' arguments
// (client.cc), results (actor_server.cc), and the replies a caller keeps (Reply). Below it a copy
// costs less than the bookkeeping.
inline constexpr size_t kReferenceFrom = 64 * 1024;

// A Data orphan in the message of `builder` that references `bytes` in place
// (Orphanage::referenceExternalData); `bytes` must outlive the writing of the message. Cap'n
// Proto sends whole 8-byte words, so the bytes up to the next word boundary are zeroed first, in
// the string's own storage (nothing else of this process's memory goes out).
template <typename Builder>
capnp::Orphan<capnp::Data> referenceBytes(Builder builder, std::string& bytes) {
  const size_t size = bytes.size();
  if (size_t padded = (size + 7) & ~size_t{7}; padded != size) {
    bytes.append(padded - size, '\0');
    bytes.resize(size);
  }
  return capnp::Orphanage::getForMessageContaining(builder).referenceExternalData(
      capnp::Data::Reader(reinterpret_cast<const kj::byte*>(bytes.data()), size));
}

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
  std::string& bytes() { return bytes_; }

 private:
  std::string bytes_;
};

class HeldBuffers {
 public:
  // Keeps `bytes` and returns them as a Data orphan of `builder`'s message that references them.
  template <typename Builder>
  capnp::Orphan<capnp::Data> hold(Builder builder, std::string bytes) {
    auto owned = std::make_unique<HeldBuffer>(std::move(bytes));
    auto orphan = referenceBytes(builder, owned->bytes());
    held_[reinterpret_cast<const kj::byte*>(owned->bytes().data())] = std::move(owned);
    return orphan;
  }

  bool empty() const { return held_.empty(); }

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
