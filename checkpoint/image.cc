#include "troupe/checkpoint/image.h"

#include <bit>
#include <cstring>
#include <set>

#include <fmt/format.h>

#include "troupe/checkpoint/checksum.h"

namespace troupe::checkpoint {
namespace {

static_assert(std::endian::native == std::endian::little, "the image format is little-endian");

// Offsets of the fixed header's fields (docs/checkpoint_format.md).
enum FixedField : uint64_t {
  kMagic = 0,
  kVersion = 8,
  kFixedSize = 12,
  kHeaderBytes = 16,
  kImageBytes = 24,
  kStep = 32,
  kRank = 40,
  kWorldSize = 44,
  kTensorCount = 48,
  kTableBytes = 52,
  kMetaOffset = 56,
  kMetaCapacity = 64,
  kMetaBytes = 72,
  kMetaCrc = 80,
  kTableCrc = 84,
  kFlags = 88,
  kHeaderCrc = 92,
};
constexpr uint64_t kEntryFixed = 24;  // offset u64, bytes u64, crc u32, nameBytes u16, dtypeBytes u8, ndim u8

uint64_t alignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

template <typename T>
void put(uint8_t* p, uint64_t at, T v) {
  std::memcpy(p + at, &v, sizeof(T));
}
template <typename T>
T get(const uint8_t* p, uint64_t at) {
  T v;
  std::memcpy(&v, p + at, sizeof(T));
  return v;
}

uint64_t entryBytes(const TensorSpec& t) {
  return alignUp(kEntryFixed + 8 * t.shape.size() + t.name.size() + t.dtype.size(), 8);
}

Status corrupt(std::string what) { return Status(StatusCode::kFailedPrecondition, "corrupt checkpoint image: " + what); }

}  // namespace

Result<ImageLayout> ImageLayout::plan(std::vector<TensorSpec> tensors, uint64_t metaCapacity) {
  ImageLayout layout;
  std::set<std::string_view> names;
  uint64_t table = 0;
  for (const auto& t : tensors) {
    TROUPE_RETURN_IF_ERROR(validateTensorSpec(t));
    if (!names.insert(t.name).second) {
      return Status(StatusCode::kInvalidArgument, fmt::format("tensor name '{}' appears twice", t.name));
    }
    table += entryBytes(t);
  }
  if (tensors.size() > (uint64_t(1) << 24) || table > (uint64_t(1) << 31)) {
    return Status(StatusCode::kInvalidArgument, fmt::format("too many tensors ({})", tensors.size()));
  }
  if (metaCapacity > (uint64_t(1) << 32)) {
    return Status(StatusCode::kInvalidArgument, fmt::format("metadata capacity {} exceeds 4 GiB", metaCapacity));
  }
  layout.tableBytes_ = table;
  layout.metaOffset_ = alignUp(kFixedHeaderBytes + table, 8);
  layout.metaCapacity_ = metaCapacity;
  layout.headerBytes_ = alignUp(layout.metaOffset_ + metaCapacity, kPageBytes);
  uint64_t at = layout.headerBytes_;
  for (const auto& t : tensors) {
    layout.offsets_.push_back(at);
    at = alignUp(at + t.bytes, kTensorAlignment);
  }
  layout.imageBytes_ = alignUp(at, kPageBytes);
  layout.tensors_ = std::move(tensors);
  return layout;
}

uint64_t ImageLayout::tensorBytes() const {
  uint64_t total = 0;
  for (const auto& t : tensors_) total += t.bytes;
  return total;
}

Status ImageLayout::encodeHeader(uint8_t* out, const ImageStamp& stamp, std::span<const uint32_t> crcs,
                                 std::string_view meta) const {
  if (crcs.size() != tensors_.size()) {
    return Status(StatusCode::kInvalidArgument, fmt::format("{} checksums for {} tensors", crcs.size(), tensors_.size()));
  }
  if (meta.size() > metaCapacity_) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("checkpoint metadata is {} bytes; this layout has room for {}", meta.size(), metaCapacity_));
  }
  std::memset(out, 0, headerBytes_);
  std::memcpy(out + kMagic, kImageMagic, sizeof(kImageMagic));
  put<uint32_t>(out, kVersion, kImageVersion);
  put<uint32_t>(out, kFixedSize, kFixedHeaderBytes);
  put<uint64_t>(out, kHeaderBytes, headerBytes_);
  put<uint64_t>(out, kImageBytes, imageBytes_);
  put<uint64_t>(out, kStep, stamp.step);
  put<uint32_t>(out, kRank, stamp.rank);
  put<uint32_t>(out, kWorldSize, stamp.worldSize);
  put<uint32_t>(out, kTensorCount, static_cast<uint32_t>(tensors_.size()));
  put<uint32_t>(out, kTableBytes, static_cast<uint32_t>(tableBytes_));
  put<uint64_t>(out, kMetaOffset, metaOffset_);
  put<uint64_t>(out, kMetaCapacity, metaCapacity_);
  put<uint64_t>(out, kMetaBytes, meta.size());
  uint64_t at = kFixedHeaderBytes;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const auto& t = tensors_[i];
    put<uint64_t>(out, at, offsets_[i]);
    put<uint64_t>(out, at + 8, t.bytes);
    put<uint32_t>(out, at + 16, crcs[i]);
    put<uint16_t>(out, at + 20, static_cast<uint16_t>(t.name.size()));
    put<uint8_t>(out, at + 22, static_cast<uint8_t>(t.dtype.size()));
    put<uint8_t>(out, at + 23, static_cast<uint8_t>(t.shape.size()));
    uint64_t p = at + kEntryFixed;
    for (int64_t d : t.shape) {
      put<int64_t>(out, p, d);
      p += 8;
    }
    std::memcpy(out + p, t.name.data(), t.name.size());
    std::memcpy(out + p + t.name.size(), t.dtype.data(), t.dtype.size());
    at += entryBytes(t);
  }
  std::memcpy(out + metaOffset_, meta.data(), meta.size());
  put<uint32_t>(out, kMetaCrc, crc32c(meta.data(), meta.size()));
  put<uint32_t>(out, kTableCrc, crc32c(out + kFixedHeaderBytes, tableBytes_));
  put<uint32_t>(out, kHeaderCrc, crc32c(out, kHeaderCrc));
  return Status::ok();
}

Result<ImageExtent> peekImage(const uint8_t* data, uint64_t size) {
  if (size < kFixedHeaderBytes) return corrupt(fmt::format("only {} bytes, shorter than its header", size));
  if (std::memcmp(data, kImageMagic, sizeof(kImageMagic)) != 0) return corrupt("bad magic (not a Troupe checkpoint)");
  uint32_t version = get<uint32_t>(data, kVersion);
  if (version != kImageVersion) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("checkpoint image version {} is not supported (this build reads {})", version, kImageVersion));
  }
  uint32_t recorded = get<uint32_t>(data, kHeaderCrc);
  uint32_t actual = crc32c(data, kHeaderCrc);
  if (recorded != actual) return corrupt(fmt::format("header checksum {:08x} != recorded {:08x}", actual, recorded));
  ImageExtent extent;
  extent.headerBytes = get<uint64_t>(data, kHeaderBytes);
  extent.imageBytes = get<uint64_t>(data, kImageBytes);
  extent.step = get<uint64_t>(data, kStep);
  extent.headerCrc = recorded;
  if (get<uint32_t>(data, kFixedSize) != kFixedHeaderBytes || extent.headerBytes % kPageBytes != 0 ||
      extent.headerBytes < kPageBytes || extent.imageBytes < extent.headerBytes || extent.imageBytes % kPageBytes != 0 ||
      extent.imageBytes > kMaxImageBytes) {
    return corrupt(fmt::format("inconsistent sizes (header {} bytes, image {} bytes)", extent.headerBytes,
                               extent.imageBytes));
  }
  return extent;
}

Result<ImageHeader> parseImageHeader(const uint8_t* data, uint64_t size) {
  TROUPE_ASSIGN_OR_RETURN(auto extent, peekImage(data, size));
  if (size < extent.headerBytes) {
    return corrupt(fmt::format("header region is {} bytes, only {} available", extent.headerBytes, size));
  }
  ImageHeader header;
  ImageLayout& layout = header.layout;
  uint32_t count = get<uint32_t>(data, kTensorCount);
  layout.tableBytes_ = get<uint32_t>(data, kTableBytes);
  layout.metaOffset_ = get<uint64_t>(data, kMetaOffset);
  layout.metaCapacity_ = get<uint64_t>(data, kMetaCapacity);
  layout.headerBytes_ = extent.headerBytes;
  layout.imageBytes_ = extent.imageBytes;
  uint64_t metaBytes = get<uint64_t>(data, kMetaBytes);
  // Each bound is checked before it is added to another: a crafted offset must not wrap around.
  if (layout.metaOffset_ > layout.headerBytes_ || kFixedHeaderBytes + layout.tableBytes_ > layout.metaOffset_ ||
      layout.metaOffset_ % 8 != 0 || layout.metaCapacity_ > layout.headerBytes_ - layout.metaOffset_ ||
      metaBytes > layout.metaCapacity_) {
    return corrupt("table or metadata outside the header region");
  }
  uint32_t tableCrc = crc32c(data + kFixedHeaderBytes, layout.tableBytes_);
  if (tableCrc != get<uint32_t>(data, kTableCrc)) return corrupt("tensor table checksum does not match");
  header.meta.assign(reinterpret_cast<const char*>(data + layout.metaOffset_), metaBytes);
  if (crc32c(header.meta.data(), header.meta.size()) != get<uint32_t>(data, kMetaCrc)) {
    return corrupt("metadata checksum does not match");
  }
  header.stamp.step = extent.step;
  header.stamp.rank = get<uint32_t>(data, kRank);
  header.stamp.worldSize = get<uint32_t>(data, kWorldSize);
  header.headerCrc = extent.headerCrc;
  if (header.stamp.worldSize == 0 || header.stamp.rank >= header.stamp.worldSize) {
    return corrupt(fmt::format("rank {} of world size {}", header.stamp.rank, header.stamp.worldSize));
  }
  uint64_t at = kFixedHeaderBytes;
  uint64_t end = kFixedHeaderBytes + layout.tableBytes_;
  uint64_t dataEnd = layout.headerBytes_;
  for (uint32_t i = 0; i < count; ++i) {
    if (at + kEntryFixed > end) return corrupt(fmt::format("tensor table ends inside entry {}", i));
    TensorSpec t;
    uint64_t offset = get<uint64_t>(data, at);
    t.bytes = get<uint64_t>(data, at + 8);
    uint32_t crc = get<uint32_t>(data, at + 16);
    uint16_t nameBytes = get<uint16_t>(data, at + 20);
    uint8_t dtypeBytes = get<uint8_t>(data, at + 22);
    uint8_t ndim = get<uint8_t>(data, at + 23);
    uint64_t p = at + kEntryFixed;
    if (p + 8 * uint64_t(ndim) + nameBytes + dtypeBytes > end) {
      return corrupt(fmt::format("tensor table ends inside entry {}", i));
    }
    for (uint8_t d = 0; d < ndim; ++d, p += 8) t.shape.push_back(get<int64_t>(data, p));
    t.name.assign(reinterpret_cast<const char*>(data + p), nameBytes);
    t.dtype.assign(reinterpret_cast<const char*>(data + p + nameBytes), dtypeBytes);
    if (auto s = validateTensorSpec(t); !s.isOk()) return corrupt(s.message());
    if (offset < dataEnd || offset % kTensorAlignment != 0 || offset > layout.imageBytes_ ||
        t.bytes > layout.imageBytes_ - offset) {
      return corrupt(fmt::format("tensor '{}' at offset {} ({} bytes) overlaps another part of the image", t.name,
                                 offset, t.bytes));
    }
    dataEnd = offset + t.bytes;
    layout.offsets_.push_back(offset);
    layout.tensors_.push_back(std::move(t));
    header.crcs.push_back(crc);
    at += entryBytes(layout.tensors_.back());
  }
  if (at != end) return corrupt("tensor table has bytes after its last entry");
  return header;
}

Status verifyImageData(const ImageHeader& header, const uint8_t* image) {
  const auto& tensors = header.layout.tensors();
  for (size_t i = 0; i < tensors.size(); ++i) {
    uint32_t actual = crc32c(image + header.layout.tensorOffset(i), tensors[i].bytes);
    if (actual != header.crcs[i]) {
      return corrupt(fmt::format("tensor '{}' of rank {} step {}: checksum {:08x} != recorded {:08x}", tensors[i].name,
                                 header.stamp.rank, header.stamp.step, actual, header.crcs[i]));
    }
  }
  return Status::ok();
}

}  // namespace troupe::checkpoint
