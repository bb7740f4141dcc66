#include "troupe/runtime/metrics.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>

#include <fmt/format.h>

#include "troupe/runtime/logging.h"
#include "troupe/runtime/safe_open.h"

namespace troupe::metrics {
namespace {

constexpr char kMagic[8] = {'T', 'R', 'P', 'M', 'E', 'T', '0', '1'};

struct alignas(64) Header {
  char magic[8];
  uint32_t slotBytes;
  uint32_t slots;
  std::atomic<uint32_t> used;  // slots [0, used) are complete (stored with release)
};

struct Slot {
  char name[96];
  char labels[80];
  uint8_t unit;
  uint8_t pad[7];
  std::atomic<uint64_t> value;
};
static_assert(sizeof(Slot) == 192 && std::atomic<uint64_t>::is_always_lock_free);

constexpr size_t kFileBytes = sizeof(Header) + kSlots * sizeof(Slot);

struct Registry {
  std::mutex mutex;
  Header* header = nullptr;
  Slot* slots = nullptr;
  std::map<std::string, Counter*, std::less<>> byKey;
  std::deque<Counter> counters;
  std::deque<std::atomic<uint64_t>> overflow;  // counters past kSlots: counted, not published

  Registry() {
    void* memory = MAP_FAILED;
    if (const char* path = std::getenv("TROUPE_METRICS_FILE"); path && *path) {
      // O_EXCL: a process the worker starts inherits the variable but must not take the file over.
      int fd = ::open(path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
      if (fd >= 0) {
        if (::ftruncate(fd, kFileBytes) == 0) {
          memory = ::mmap(nullptr, kFileBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        }
        ::close(fd);
      }
    }
    if (memory == MAP_FAILED) {
      memory = ::mmap(nullptr, kFileBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      TROUPE_CHECK(memory != MAP_FAILED, "metrics: cannot map {} bytes: {}", kFileBytes, std::strerror(errno));
    }
    header = static_cast<Header*>(memory);
    slots = reinterpret_cast<Slot*>(static_cast<char*>(memory) + sizeof(Header));
    header->slotBytes = sizeof(Slot);
    header->slots = kSlots;
    std::memcpy(header->magic, kMagic, sizeof(kMagic));  // last: a reader checks it first
  }
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: counters are used until exit
  return *r;
}

bool validName(std::string_view s) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    char c = s[i];
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' || (i > 0 && c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return true;
}

bool validLabelName(std::string_view s) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    char c = s[i];
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (i > 0 && c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return true;
}

bool printable(std::string_view s) {
  for (char c : s) {
    if (c < 0x20 || c > 0x7e) return false;
  }
  return true;
}

// The text of a NUL-terminated field, or nullopt when it has no NUL.
std::optional<std::string_view> field(const char* data, size_t size) {
  const void* end = std::memchr(data, '\0', size);
  if (end == nullptr) return std::nullopt;
  return std::string_view(data, static_cast<const char*>(end) - data);
}

}  // namespace

Counter& counter(std::string_view name, std::string_view labels, Unit unit) {
  Registry& r = registry();
  std::string key = fmt::format("{}{{{}}}", name, labels);
  std::lock_guard lock(r.mutex);
  if (auto it = r.byKey.find(key); it != r.byKey.end()) return *it->second;
  TROUPE_CHECK(validName(name) && name.size() < sizeof(Slot::name), "metrics: bad counter name '{}'", name);
  TROUPE_CHECK(printable(labels) && labels.size() < sizeof(Slot::labels) && parseLabels(labels).has_value(),
               "metrics: bad labels '{}' (write them with labelText)", labels);
  uint32_t used = r.header->used.load(std::memory_order_relaxed);
  std::atomic<uint64_t>* value;
  if (used < kSlots) {
    Slot& slot = r.slots[used];
    std::memcpy(slot.name, name.data(), name.size());
    std::memcpy(slot.labels, labels.data(), labels.size());
    slot.unit = static_cast<uint8_t>(unit);
    value = &slot.value;
    r.header->used.store(used + 1, std::memory_order_release);
  } else {
    value = &r.overflow.emplace_back(0);
  }
  Counter& c = r.counters.emplace_back(value);
  r.byKey.emplace(std::move(key), &c);
  return c;
}

ActorCalls& actorCalls() {
  static ActorCalls c{counter("troupe_actor_calls_total"), counter("troupe_actor_call_errors_total"),
                      counter("troupe_actor_call_seconds_total", "", Unit::kSeconds)};
  return c;
}

Result<std::vector<Sample>> read(const std::string& path) {
  // The worker that writes it could have put a FIFO there instead: never block on it.
  TROUPE_ASSIGN_OR_RETURN(auto fd, openRegularFile(path, O_RDONLY));
  std::string bytes(kFileBytes + 1, '\0');
  ssize_t got = ::pread(fd.get(), bytes.data(), bytes.size(), 0);
  if (got != static_cast<ssize_t>(kFileBytes)) {
    return Status(StatusCode::kFailedPrecondition, fmt::format("{}: {} bytes, not a counter file of {}", path, got, kFileBytes));
  }
  auto word = [&bytes](size_t offset) {
    uint32_t v = 0;
    std::memcpy(&v, bytes.data() + offset, sizeof(v));
    return v;
  };
  const uint32_t used = word(offsetof(Header, used));
  if (std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0 || word(offsetof(Header, slotBytes)) != sizeof(Slot) ||
      word(offsetof(Header, slots)) != kSlots || used > kSlots) {
    return Status(StatusCode::kFailedPrecondition, fmt::format("{}: not a counter file (bad header)", path));
  }
  std::vector<Sample> out;
  out.reserve(used);
  for (uint32_t i = 0; i < used; ++i) {
    const char* at = bytes.data() + sizeof(Header) + i * sizeof(Slot);
    auto name = field(at + offsetof(Slot, name), sizeof(Slot::name));
    auto labels = field(at + offsetof(Slot, labels), sizeof(Slot::labels));
    uint8_t unit = static_cast<uint8_t>(at[offsetof(Slot, unit)]);
    if (!name || !labels || !validName(*name) || !printable(*labels) ||
        (unit != static_cast<uint8_t>(Unit::kCount) && unit != static_cast<uint8_t>(Unit::kSeconds))) {
      continue;
    }
    // The worker wrote this text, and it may write anything: only what parses as label text goes
    // on, written again by labelText so a stray quote or backslash never reaches a scrape.
    auto parsed = parseLabels(*labels);
    if (!parsed) continue;
    uint64_t value = 0;
    std::memcpy(&value, at + offsetof(Slot, value), sizeof(value));
    double v = unit == static_cast<uint8_t>(Unit::kSeconds) ? static_cast<double>(value) / 1e9 : static_cast<double>(value);
    out.push_back(Sample{std::string(*name), labelText(*parsed), v});
  }
  return out;
}

std::string escapeLabel(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\' || c == '"') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string labelText(const Labels& labels) {
  std::string out;
  for (const auto& [name, value] : labels) {
    TROUPE_CHECK(validLabelName(name), "metrics: bad label name '{}'", name);
    if (!out.empty()) out += ',';
    out += fmt::format("{}=\"{}\"", name, escapeLabel(value));
  }
  return out;
}

std::optional<Labels> parseLabels(std::string_view text) {
  Labels out;
  size_t i = 0;
  while (i < text.size()) {
    if (!out.empty()) {
      if (text[i] != ',') return std::nullopt;
      ++i;
    }
    size_t eq = text.find('=', i);
    if (eq == std::string_view::npos || !validLabelName(text.substr(i, eq - i))) return std::nullopt;
    std::string name(text.substr(i, eq - i));
    i = eq + 1;
    if (i >= text.size() || text[i] != '"') return std::nullopt;
    ++i;
    std::string value;
    bool closed = false;
    while (i < text.size()) {
      char c = text[i++];
      if (c == '"') {
        closed = true;
        break;
      }
      if (c == '\n') return std::nullopt;
      if (c == '\\') {
        if (i >= text.size()) return std::nullopt;
        char e = text[i++];
        if (e == 'n') {
          value += '\n';
        } else if (e == '\\' || e == '"') {
          value += e;
        } else {
          return std::nullopt;
        }
      } else {
        value += c;
      }
    }
    if (!closed) return std::nullopt;
    out.emplace_back(std::move(name), std::move(value));
  }
  return out;
}

}  // namespace troupe::metrics
