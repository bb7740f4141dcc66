// Fuzz target: an elastic group's command as read back from Redis (decodeGroupCommand). Any text
// decodes to a command within its bounds or is refused as malformed; a command the client writes
// (groupCommandJson), numbered as the append script numbers it, decodes back to itself.
#include <cstdint>
#include <string>

#include "store_records.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace troupe;
  using namespace troupe::store_records;
  std::string text(reinterpret_cast<const char*>(data), size);
  auto command = decodeGroupCommand(text, "fuzz:egroup_commands");
  if (!command.isOk()) return 0;
  const GroupCommand& c = *command;
  if (c.seq == 0) __builtin_trap();
  if (c.kind == GroupCommand::Kind::kResize && c.workers == 0) __builtin_trap();
  if (c.kind == GroupCommand::Kind::kStop && c.workers != 0) __builtin_trap();
  // Written again as the client and the script write it, it reads back the same.
  std::string written = groupCommandJson(c, "nonce");
  if (written.size() < 2 || written[0] != '{') __builtin_trap();
  std::string stored = "{\"seq\":" + std::to_string(c.seq) + "," + written.substr(1);
  auto again = decodeGroupCommand(stored, "fuzz:again");
  if (!again.isOk() || again->seq != c.seq || again->timeMs != c.timeMs || again->from != c.from ||
      again->kind != c.kind || again->workers != c.workers) {
    __builtin_trap();
  }
  return 0;
}
