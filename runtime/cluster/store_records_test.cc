// Records read back from Redis are checked as strictly as input from a peer (store_records.h): a
// record written by another version, by hand or by an attacker holding the Redis password is
// refused as malformed, never converted out of range. Inputs found by fuzz/store_records_fuzz.cc
// are kept here and in fuzz/corpus/store_records/.
#include "store_records.h"

#include <doctest/doctest.h>

namespace troupe::store_records {
namespace {

FieldMap validNode() {
  return {{"id", "0123456789abcdef"}, {"address", "127.0.0.1:4000"}, {"hostname", "h"}, {"is_head", "1"},
          {"state", "ALIVE"}, {"pid", "42"}, {"registered_ms", "1"}, {"last_heartbeat_ms", "2"},
          {"total", R"({"CPU":4})"}, {"used", R"({"CPU":1})"}, {"labels", "{}"}, {"death_reason", ""}};
}

FieldMap validActor() {
  return {{"id", "00aa"}, {"type", "T"}, {"name", ""}, {"node_id", ""}, {"address", ""}, {"detached", "0"},
          {"owner", ""}, {"init_args", ""}, {"placement_group", ""}, {"death_reason", ""}, {"state", "PENDING"},
          {"pid", "0"}, {"incarnation", "0"}, {"restarts", "0"}, {"max_restarts", "0"}, {"max_task_retries", "0"},
          {"bundle_index", "-1"}, {"created_ms", "1"}, {"updated_ms", "1"}, {"resources", R"({"CPU":1})"}};
}

TEST_CASE("store records: valid records decode; ids and quantities that are not are malformed") {
  auto node = validNode();
  REQUIRE(decodeNode(node, "k").isOk());
  auto actor = validActor();
  REQUIRE(decodeActor(actor, "k").isOk());
  for (auto [field, value] : {std::pair<std::string, std::string>{"id", "../../etc"}, {"id", ""},
                              {"total", R"({"CPU":-1})"}, {"used", R"({"GPU":1e300})"}, {"pid", "1e3"}}) {
    auto fields = validNode();
    fields[field] = value;
    auto decoded = decodeNode(fields, "troupe:c:node:x");
    CHECK_MESSAGE(!decoded.isOk(), field, "=", value);
    CHECK(decoded.status().message().find("malformed record at Redis key 'troupe:c:node:x'") != std::string::npos);
  }
  for (auto [field, value] : {std::pair<std::string, std::string>{"node_id", "a/b"}, {"placement_group", "Z"},
                              {"resources", R"({"CPU":-0.5})"}, {"id", ".."}}) {
    auto fields = validActor();
    fields[field] = value;
    CHECK_MESSAGE(!decodeActor(fields, "k").isOk(), field, "=", value);
  }
  FieldMap group = {{"id", "0f"}, {"name", "g"}, {"strategy", "PACK"}, {"state", "CREATED"}, {"created_ms", "1"},
                    {"bundles", R"([{"resources":{"CPU":1},"node_id":""}])"}};
  REQUIRE(decodePlacementGroup(group, "k").isOk());
  group["bundles"] = R"([{"resources":{"CPU":1},"node_id":"../x"}])";
  CHECK(!decodePlacementGroup(group, "k").isOk());
  group["bundles"] = R"([{"resources":{"CPU":-3},"node_id":""}])";
  CHECK(!decodePlacementGroup(group, "k").isOk());
}

TEST_CASE("store records: an event's time is any number that fits; others are ignored") {
  NodeId id("00ff");
  auto event = parseEventMessage(eventMessage(ClusterEventType::kNodeDead, id, "lost", 1700000000123));
  REQUIRE(event.has_value());
  CHECK(event->timeMs == 1700000000123);
  CHECK(event->nodeId == id);
  CHECK(parseEventMessage(R"({"type":"NODE_ADDED","node_id":"00ff","time_ms":1.7e12})")->timeMs == 1700000000000);
  // 1e300 was cast to int64 (undefined behaviour: INT64_MIN here).
  CHECK(!parseEventMessage(R"({"type":"NODE_ADDED","node_id":"00ff","time_ms":1e300})").has_value());
  CHECK(!parseEventMessage(R"({"type":"NODE_ADDED","node_id":"00ff","time_ms":18446744073709551615})").has_value());
  CHECK(!parseEventMessage(R"({"type":"NODE_ADDED","node_id":"../x","time_ms":1})").has_value());
  CHECK(!parseEventMessage(R"({"type":"NODE_ADDED","node_id":"00ff","time_ms":"1"})").has_value());
  CHECK(!parseEventMessage("[]").has_value());
}

}  // namespace
}  // namespace troupe::store_records
