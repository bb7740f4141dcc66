// The rank image: one rank's state at one step as a single byte range, identical in a shared-
// memory slot, in a peer's replica and in a rank file on disk, so moving it between tiers is a
// plain copy. docs/checkpoint_format.md describes the bytes; in short:
//
//   [fixed header 96 B][tensor table][metadata, metaCapacity B] pad to 4 KiB   = headerBytes
//   [tensor 0][tensor 1]...  each 64-byte aligned, the end padded to 4 KiB      = imageBytes
//
// The layout (names, dtypes, shapes, offsets, metadata capacity) is planned once from the tensor
// specs and reused by every save; a save only rewrites the per-save fields: step, rank, world
// size, the per-tensor CRC32Cs and the metadata.
// Thread-safety: ImageLayout and ImageHeader are immutable values once built.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "troupe/checkpoint/tensor_state.h"
#include "troupe/runtime/status.h"

namespace troupe::checkpoint {

inline constexpr char kImageMagic[8] = {'T', 'R', 'O', 'U', 'P', 'E', 'C', 'K'};
inline constexpr uint32_t kImageVersion = 1;
inline constexpr uint64_t kFixedHeaderBytes = 96;
inline constexpr uint64_t kPageBytes = 4096;
inline constexpr uint64_t kTensorAlignment = 64;
// Metadata room reserved when the caller names none: enough for RNG and data-shard state.
inline constexpr uint64_t kDefaultMetaCapacity = 64 * 1024;
// The largest image a header may claim (256 TiB): far above any rank's state, and low enough that
// sizes derived from it (two slots of a segment, page rounding) cannot wrap around.
inline constexpr uint64_t kMaxImageBytes = uint64_t(1) << 48;

// Which save an image holds.
struct ImageStamp {
  uint64_t step = 0;
  uint32_t rank = 0;
  uint32_t worldSize = 1;
};

struct ImageHeader;

class ImageLayout {
 public:
  ImageLayout() = default;
  // Plans the image for `tensors` (in this order) with room for `metaCapacity` metadata bytes.
  // kInvalidArgument for an invalid spec (see validateTensorSpec) or a repeated name.
  static Result<ImageLayout> plan(std::vector<TensorSpec> tensors, uint64_t metaCapacity = kDefaultMetaCapacity);

  const std::vector<TensorSpec>& tensors() const { return tensors_; }
  // Byte offset of tensor i from the start of the image.
  uint64_t tensorOffset(size_t i) const { return offsets_[i]; }
  uint64_t headerBytes() const { return headerBytes_; }
  uint64_t imageBytes() const { return imageBytes_; }
  uint64_t metaCapacity() const { return metaCapacity_; }
  // Sum of the tensors' bytes (no padding).
  uint64_t tensorBytes() const;
  bool operator==(const ImageLayout&) const = default;

  // Writes the whole header region (headerBytes() bytes, padding zeroed) for one save.
  // `crcs` has one CRC32C per tensor; kInvalidArgument if `meta` exceeds metaCapacity().
  [[nodiscard]] Status encodeHeader(uint8_t* out, const ImageStamp& stamp, std::span<const uint32_t> crcs,
                                    std::string_view meta) const;

 private:
  friend Result<ImageHeader> parseImageHeader(const uint8_t* data, uint64_t size);
  std::vector<TensorSpec> tensors_;
  std::vector<uint64_t> offsets_;
  uint64_t tableBytes_ = 0;
  uint64_t metaOffset_ = 0;
  uint64_t metaCapacity_ = 0;
  uint64_t headerBytes_ = 0;
  uint64_t imageBytes_ = 0;
};

// A parsed, checked header: the layout and one save's fields.
struct ImageHeader {
  ImageLayout layout;
  ImageStamp stamp;
  std::vector<uint32_t> crcs;
  std::string meta;
  uint32_t headerCrc = 0;  // identifies this save's header (the manifest records it)
};

// The sizes an image's fixed header announces, checked (magic, version, header CRC, bounds).
struct ImageExtent {
  uint64_t headerBytes = 0;
  uint64_t imageBytes = 0;
  uint64_t step = 0;
  uint32_t headerCrc = 0;
};
// Reads the fixed header (needs kFixedHeaderBytes). kFailedPrecondition ("corrupt ...") when
// it is not a valid image header.
Result<ImageExtent> peekImage(const uint8_t* data, uint64_t size);
// Parses the header region (needs headerBytes bytes) and checks every field, the table and
// metadata CRCs, and that every tensor lies inside the image. kFailedPrecondition when corrupt.
Result<ImageHeader> parseImageHeader(const uint8_t* data, uint64_t size);
// Checks every tensor's CRC32C against the header; `image` holds imageBytes bytes.
// kFailedPrecondition naming the first tensor that does not match.
Status verifyImageData(const ImageHeader& header, const uint8_t* image);

}  // namespace troupe::checkpoint
