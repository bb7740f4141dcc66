// The shared-memory pipes (shm_transport.h) in one process: a producer and a consumer thread on a
// shared anonymous mapping laid out as a segment. The cross-process behaviour (setup, unlink,
// a killed peer) is covered by communicator_test.cc with real rank processes.
#include <doctest/doctest.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <future>
#include <random>
#include <thread>
#include <vector>

#include "shm_transport.h"
#include "wire.h"

namespace troupe::collectives {
namespace {

using namespace std::chrono_literals;

// A two-rank segment on anonymous shared memory (the layout, without the header or a name).
std::unique_ptr<ShmSegment> anonymousSegment(size_t pipeBytes) {
  const uint64_t bytes = segmentBytes(2, pipeBytes);
  REQUIRE(bytes > 0);
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  REQUIRE(base != MAP_FAILED);
  return std::make_unique<ShmSegment>(base, bytes, 2, pipeBytes);
}

// Reads `bytes` (one item) from the pipe as the communicator does: copy what is there, sleep on
// the doorbell when nothing is, consume the item's padding at its end.
void readItem(ShmPipe& pipe, std::atomic<uint32_t>& doorbell, char* out, size_t bytes) {
  size_t left = bytes;
  while (left > 0) {
    const uint32_t seen = doorbell.load();
    std::optional<size_t> available = pipe.available();
    REQUIRE(available.has_value());
    if (*available == 0) {
      if (pipe.armWake(std::min(roundUpToPipeAlign(left), pipe.capacity() / 2))) futexWait(doorbell, seen, 100ms);
      continue;
    }
    const size_t n = std::min({*available, pipe.contiguous(), left});
    std::memcpy(out, pipe.peek(), n);
    out += n;
    left -= n;
    pipe.consume(left == 0 ? roundUpToPipeAlign(n) : n);
  }
}

TEST_CASE("shm pipe: items of any size arrive intact across wrap-around, the producer blocking on a full pipe") {
  auto segment = anonymousSegment(kMinPipeBytes);
  ShmPipe producer = segment->pipe(0, 1);
  ShmPipe consumer = segment->pipe(0, 1);
  std::mt19937 random(7);
  std::uniform_int_distribution<size_t> size(1, 3 * kMinPipeBytes);  // some larger than the pipe
  std::vector<std::vector<char>> items(200);
  for (auto& item : items) {
    item.resize(size(random));
    for (char& c : item) c = static_cast<char>(random());
  }
  std::atomic<bool> stop{false};
  auto writer = std::async(std::launch::async, [&] {
    for (auto& item : items) {
      std::vector<iovec> iov{iovec{item.data(), item.size()}};
      if (producer.write(iov, /*block=*/true, stop) != ShmPipe::WriteResult::kDone || !iov.empty()) return false;
    }
    return true;
  });
  for (size_t i = 0; i < items.size(); ++i) {
    std::vector<char> got(items[i].size());
    readItem(consumer, segment->doorbell(1), got.data(), got.size());
    REQUIRE_MESSAGE(got == items[i], "item " << i << " of " << items[i].size() << " bytes");
  }
  REQUIRE(writer.wait_for(10s) == std::future_status::ready);
  CHECK(writer.get());
}

TEST_CASE("shm pipe: a non-blocking write stops at a full pipe and resumes where it stopped") {
  auto segment = anonymousSegment(kMinPipeBytes);
  ShmPipe producer = segment->pipe(1, 0);
  ShmPipe consumer = segment->pipe(1, 0);
  std::vector<char> big(kMinPipeBytes + 1000, 'x');
  std::vector<iovec> iov{iovec{big.data(), big.size()}};
  std::atomic<bool> stop{false};
  CHECK(producer.write(iov, /*block=*/false, stop) == ShmPipe::WriteResult::kFull);
  REQUIRE(iov.size() == 1);
  CHECK(iov[0].iov_len == 1000);
  CHECK(consumer.available() == std::optional<size_t>(kMinPipeBytes));
  consumer.consume(kMinPipeBytes);
  CHECK(producer.write(iov, /*block=*/false, stop) == ShmPipe::WriteResult::kDone);
  CHECK(iov.empty());
  CHECK(consumer.available() == std::optional<size_t>(roundUpToPipeAlign(1000)));
}

TEST_CASE("shm pipe: a producer blocked on a full pipe gives up within a second when stopped") {
  auto segment = anonymousSegment(kMinPipeBytes);
  ShmPipe producer = segment->pipe(0, 1);
  std::vector<char> big(2 * kMinPipeBytes, 'y');
  std::atomic<bool> stop{false};
  auto writer = std::async(std::launch::async, [&] {
    std::vector<iovec> iov{iovec{big.data(), big.size()}};
    return producer.write(iov, /*block=*/true, stop);  // nobody consumes: blocks when full
  });
  CHECK(writer.wait_for(50ms) == std::future_status::timeout);  // still blocked, as it must be
  const auto stoppedAt = std::chrono::steady_clock::now();
  stop.store(true);
  producer.wakeProducer();
  REQUIRE(writer.wait_for(2s) == std::future_status::ready);
  CHECK(std::chrono::steady_clock::now() - stoppedAt < 1s);
  CHECK(writer.get() == ShmPipe::WriteResult::kStopped);
}

TEST_CASE("shm pipe: positions a peer could not have written are reported, not used") {
  auto segment = anonymousSegment(kMinPipeBytes);
  ShmPipe producer = segment->pipe(0, 1);
  ShmPipe consumer = segment->pipe(0, 1);
  PipeControl& control = producer.control();
  // A producer position beyond the capacity, and one off the item alignment.
  for (uint64_t head : {uint64_t{kMinPipeBytes + kPipeAlign}, uint64_t{100}}) {
    CAPTURE(head);
    control.head.store(head);
    CHECK_FALSE(consumer.available().has_value());
  }
  control.head.store(0);
  CHECK(consumer.available() == std::optional<size_t>(0));
  // A consumer position ahead of everything the producer wrote.
  control.tail.store(4096);
  std::vector<char> data(256, 'z');
  std::vector<iovec> iov{iovec{data.data(), data.size()}};
  std::atomic<bool> stop{false};
  CHECK(producer.write(iov, /*block=*/true, stop) == ShmPipe::WriteResult::kCorrupt);
}

TEST_CASE("shm segment: sizes are bounded for any number of ranks") {
  CHECK(pipeBytesFor(2, 256 << 10) == (1 << 20));
  CHECK(pipeBytesFor(4, 8192) == kMinPipeBytes);
  CHECK(pipeBytesFor(4, size_t{1} << 40) == kMaxPipeBytes);
  for (int ranks : {2, 8, 64, 128, 129, 1000, 5000}) {
    CAPTURE(ranks);
    const size_t pipe = pipeBytesFor(ranks, 4 << 20);
    if (pipe == 0) {
      CHECK(ranks > 128);
      continue;
    }
    CHECK(pipe % kMinPipeBytes == 0);
    CHECK(segmentBytes(ranks, pipe) > 0);
    CHECK(segmentBytes(ranks, pipe) <= kMaxSegmentBytes);
  }
  CHECK(segmentBytes(1, kMinPipeBytes) == 0);
  CHECK(segmentBytes(64, kMaxPipeBytes) == 0);  // 4032 pipes of 16 MiB: over the bound
}

TEST_CASE("host identity: stable within a process and published in the rendezvous entry") {
  const std::string id = localHostIdentity();
  CHECK_FALSE(id.empty());
  CHECK(id.find("/netns:") != std::string::npos);
  CHECK(localHostIdentity() == id);
  Entry entry;
  entry.host = "127.0.0.1";
  entry.nonce = std::string(kNonceChars, 'a');
  entry.hostId = id;
  auto back = decodeEntry(encodeEntry(entry));
  REQUIRE(back.has_value());
  CHECK(back->hostId == id);
  entry.hostId = std::string(kMaxHostIdChars + 1, 'h');
  CHECK_FALSE(decodeEntry(encodeEntry(entry)).has_value());
}

}  // namespace
}  // namespace troupe::collectives
