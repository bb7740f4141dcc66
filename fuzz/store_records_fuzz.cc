// Fuzz target: records read back from Redis (node, actor and placement group hashes, cluster
// event messages). The input's first byte picks the decoder; the rest is the hash as HGETALL
// returns it, field and value separated by NUL bytes (or, for an event, the message itself).
// Anything decodes to a record or is refused as malformed; nothing is converted out of range.
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

#include "store_records.h"
#include "troupe/runtime/resources.h"

namespace {

troupe::store_records::FieldMap fieldsOf(std::string_view bytes) {
  troupe::store_records::FieldMap fields;
  std::string field;
  bool isValue = false;
  size_t start = 0;
  for (size_t i = 0; i <= bytes.size(); ++i) {
    if (i < bytes.size() && bytes[i] != '\0') continue;
    std::string part(bytes.substr(start, i - start));
    if (isValue) {
      fields[field] = part;
    } else {
      field = part;
    }
    isValue = !isValue;
    start = i + 1;
  }
  return fields;
}

void checkResources(const troupe::Resources& resources) {
  if (!troupe::checkResources(resources, "fuzz").isOk()) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace troupe;
  using namespace troupe::store_records;
  if (size == 0) return 0;
  std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  auto fields = fieldsOf(rest);
  switch (data[0] % 4) {
    case 0:
      if (auto node = decodeNode(fields, "fuzz:node")) {
        if (!node->id.valid()) __builtin_trap();
        checkResources(node->total);
        checkResources(node->used);
      }
      break;
    case 1:
      if (auto actor = decodeActor(fields, "fuzz:actor")) {
        if (!actor->id.valid()) __builtin_trap();
        if (!actor->nodeId.empty() && !actor->nodeId.valid()) __builtin_trap();
        checkResources(actor->resources);
      }
      break;
    case 2:
      if (auto group = decodePlacementGroup(fields, "fuzz:pg")) {
        if (!group->id.valid()) __builtin_trap();
        for (const auto& bundle : group->bundles) {
          if (!bundle.nodeId.empty() && !bundle.nodeId.valid()) __builtin_trap();
          checkResources(bundle.resources);
        }
      }
      break;
    case 3:
      if (auto event = parseEventMessage(std::string(rest))) {
        if (!event->nodeId.valid()) __builtin_trap();
        auto again = parseEventMessage(eventMessage(event->type, event->nodeId, event->reason, event->timeMs));
        if (!again || again->timeMs != event->timeMs || again->nodeId != event->nodeId) __builtin_trap();
      }
      break;
  }
  return 0;
}
