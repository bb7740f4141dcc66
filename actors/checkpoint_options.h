// Internal to actors/: the Checkpoint actor's init args (Options, from rpc::CheckpointArgs of
// actors/schema/init_args.capnp) and the small things its units share: the
// mappings of segments by name (SegmentCache), what identifies one save (SnapshotId), the recent
// errors kept for status, and the error handler of their task sets.
// Thread-safety: Options is a value, copied to a thread that needs it; a SegmentCache, a
// RecentErrors and a TaskErrorLog belong to one thread.
#pragma once

#include <sys/types.h>

#include <kj/async.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "troupe/checkpoint/checkpoint_dir.h"
#include "troupe/checkpoint/fault.h"
#include "troupe/checkpoint/flash_segment.h"
#include "troupe/runtime/status.h"

namespace troupe::actors::checkpoint_actor {

namespace ck = troupe::checkpoint;

struct Options {
  std::string group;
  std::string node;
  std::string self;
  std::vector<std::string> members;
  std::string replicaTo;
  std::string dir;
  uint32_t keep = 3;
  uint32_t fileMode = 0600;  // of persisted files (directories get x where files get r)
  std::string shmDir;
  ck::FaultInjection fault;

  std::string primary(uint32_t rank) const;
  std::string replica(uint32_t rank) const;
  ck::SegmentOptions segment(const std::string& name) const;
  ck::DirectoryOptions directory(const std::atomic<bool>* stop) const;
};

// kInvalidArgument naming what is wrong with the init args or the call.
Status badArgs(const std::string& what);

// The init args (an rpc::CheckpointArgs message, troupe/actors/init_args.h), checked: a message
// that decodes, names that make valid segment names, a replica target that is not this actor, a
// file mode its owner can read and write. kInvalidArgument otherwise.
Result<Options> parseOptions(std::string_view initArgs);

// A peer's failure with the code that crossed the RPC edge (NOT_FOUND, ...; UNAVAILABLE when
// the connection itself went).
Status statusOf(const kj::Exception& e);

// The newest few errors of one kind, each logged once as it is added; status shows them.
class RecentErrors {
 public:
  void add(std::string error);
  const std::vector<std::string>& list() const { return errors_; }

 private:
  std::vector<std::string> errors_;
};

// Logs a background task that failed without handling its own error.
class TaskErrorLog final : public kj::TaskSet::ErrorHandler {
 public:
  void taskFailed(kj::Exception&& e) override;
};

// Mappings of segments by name, reopened when the file was replaced (a writer re-created it for
// a new layout). Entries are shared so a transfer in progress keeps its mapping.
class SegmentCache {
 public:
  explicit SegmentCache(const Options& options) : options_(options) {}

  // kNotFound when no segment of that name exists; an open error otherwise.
  Result<std::shared_ptr<ck::FlashSegment>> get(const std::string& name);
  void clear() { entries_.clear(); }

 private:
  struct Entry {
    std::shared_ptr<ck::FlashSegment> segment;
    dev_t dev = 0;
    ino_t ino = 0;
  };
  const Options& options_;
  std::map<std::string, Entry> entries_;
};

// Which snapshot was last handled: the segment file, a slot and its sequence number identify one
// save (a re-created segment starts its sequence numbers again).
struct SnapshotId {
  uint64_t file = 0;
  int slot = -1;
  uint64_t seq = 0;
  bool operator==(const SnapshotId&) const = default;
};

}  // namespace troupe::actors::checkpoint_actor
