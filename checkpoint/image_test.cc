#include "troupe/checkpoint/image.h"

#include <doctest/doctest.h>

#include <cstring>
#include <tuple>

#include "troupe/checkpoint/testing.h"
#include "troupe/checkpoint/checksum.h"

namespace troupe::checkpoint {
namespace {

using testing::imageOf;
using testing::TestState;

TEST_CASE("image: specs are checked and sized") {
  auto ok = makeTensorSpec("w", "bfloat16", {3, 4});
  REQUIRE(ok.isOk());
  CHECK(ok->bytes == 24);
  CHECK(makeTensorSpec("s", "float64", {})->bytes == 8);
  CHECK(makeTensorSpec("", "float32", {1}).status().code() == StatusCode::kInvalidArgument);
  CHECK(makeTensorSpec("w", "float31", {1}).status().message().find("unknown dtype 'float31'") != std::string::npos);
  CHECK(makeTensorSpec("w", "float32", {2, -1}).status().code() == StatusCode::kInvalidArgument);
  CHECK(makeTensorSpec("w", "float32", {int64_t(1) << 40, int64_t(1) << 40}).status().code() ==
        StatusCode::kInvalidArgument);
  auto spec = *ok;
  spec.bytes = 23;
  CHECK(validateTensorSpec(spec).code() == StatusCode::kInvalidArgument);
  auto dup = ImageLayout::plan({*ok, *ok});
  CHECK(dup.status().message().find("appears twice") != std::string::npos);
}

TEST_CASE("image: layout is aligned and a header round-trips every field") {
  TestState state;
  state.fill(42);
  auto layout = state.layout(1000);
  CHECK(layout.headerBytes() % kPageBytes == 0);
  CHECK(layout.imageBytes() % kPageBytes == 0);
  for (size_t i = 0; i < state.specs.size(); ++i) CHECK(layout.tensorOffset(i) % kTensorAlignment == 0);
  std::string meta = "rng-state\0with-zero";
  auto image = imageOf(state, layout, {42, 3, 8}, meta);
  auto header = parseImageHeader(image.data(), image.size());
  REQUIRE(header.isOk());
  CHECK(header->layout == layout);
  CHECK(header->stamp.step == 42);
  CHECK(header->stamp.rank == 3);
  CHECK(header->stamp.worldSize == 8);
  CHECK(header->meta == meta);
  CHECK(verifyImageData(*header, image.data()).isOk());
  auto extent = peekImage(image.data(), image.size());
  REQUIRE(extent.isOk());
  CHECK(extent->imageBytes == layout.imageBytes());
  CHECK(extent->headerCrc == header->headerCrc);
  // Metadata larger than the room planned for it is refused, not truncated.
  std::vector<uint32_t> crcs(state.specs.size());
  CHECK(layout.encodeHeader(image.data(), {1, 0, 1}, crcs, std::string(1001, 'x')).code() ==
        StatusCode::kInvalidArgument);
}

TEST_CASE("image: a flipped byte anywhere is detected") {
  TestState state;
  state.fill(7);
  auto layout = state.layout();
  auto clean = imageOf(state, layout, {7, 0, 1}, "meta");
  // In the fixed header, the table, the metadata: parse fails.
  for (uint64_t at : {uint64_t(33), kFixedHeaderBytes + 5, uint64_t(0)}) {
    auto image = clean;
    image[at] ^= 0x10;
    CHECK(parseImageHeader(image.data(), image.size()).status().message().find("corrupt") != std::string::npos);
  }
  {
    auto header = parseImageHeader(clean.data(), clean.size());
    REQUIRE(header.isOk());
    auto image = clean;
    // The metadata region follows the table.
    size_t metaAt = static_cast<size_t>((kFixedHeaderBytes + 7) / 8 * 8);
    while (std::memcmp(image.data() + metaAt, "meta", 4) != 0) ++metaAt;
    image[metaAt] ^= 1;
    CHECK(!parseImageHeader(image.data(), image.size()).isOk());
  }
  // In a tensor: the header parses, the data check names the tensor.
  auto image = clean;
  image[layout.tensorOffset(2) + 5] ^= 0x01;
  auto header = parseImageHeader(image.data(), image.size());
  REQUIRE(header.isOk());
  Status data = verifyImageData(*header, image.data());
  CHECK(data.code() == StatusCode::kFailedPrecondition);
  CHECK(data.message().find("emb.bf16") != std::string::npos);
}


// A crafted header passes its checksum (anyone can compute one): every size and offset in it must
// still be checked, without arithmetic that wraps.
TEST_CASE("image: crafted sizes and offsets with a valid header checksum are refused, never read") {
  TestState state;
  state.fill(3);
  auto layout = state.layout(64);
  auto clean = imageOf(state, layout, {3, 0, 1}, "meta");
  auto forge = [&](uint64_t at, uint64_t value, size_t width) {
    auto image = clean;
    std::memcpy(image.data() + at, &value, width);
    uint32_t crc = crc32c(image.data(), 92);  // the header checksum covers bytes [0, 92)
    std::memcpy(image.data() + 92, &crc, 4);
    return image;
  };
  const uint64_t huge = ~uint64_t(0) - 7;  // metaOffset + capacity wraps to a small number
  for (auto [at, value, width] : {std::tuple<uint64_t, uint64_t, size_t>{56, huge, 8},   // metaOffset
                                  {64, huge, 8},                                          // metaCapacity
                                  {72, huge, 8},                                          // metaBytes
                                  {52, 0xffffffffu, 4},                                   // tableBytes
                                  {48, 0xffffffffu, 4},                                   // tensorCount
                                  {24, huge, 8}}) {                                       // imageBytes
    auto image = forge(at, value, width);
    auto parsed = parseImageHeader(image.data(), image.size());
    CHECK_MESSAGE(!parsed.isOk(), "field at ", at);
  }
  // Refused by the bounds check itself, before anything is read at the wrapped offset (which
  // would read outside the buffer and only then fail on the metadata checksum).
  // A page-aligned image size of 2^63 bytes: every table entry fits inside it, so only the bound on
  // the image size keeps it from doubling into a segment size that wraps.
  auto vast = forge(24, uint64_t(1) << 63, 8);
  CHECK(parseImageHeader(vast.data(), vast.size()).status().message().find("inconsistent sizes") != std::string::npos);
  CHECK(!peekImage(vast.data(), vast.size()).isOk());
  auto wrapped = forge(56, huge, 8);
  CHECK(parseImageHeader(wrapped.data(), wrapped.size()).status().message().find("outside the header region") !=
        std::string::npos);
}

}  // namespace
}  // namespace troupe::checkpoint
