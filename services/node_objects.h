// A node's object directory: the Python processes of the node put() their objects there (one
// file each, python/troupe/_objects.py), and the node agent serves them in chunks to processes
// of other nodes that pull them (NodeAgent.readObject). Past the store's limit, the processes
// move objects to the node's spill directory on disk, from where they are read back on get();
// the agent serves an object from whichever of the two holds it. The agent makes both
// directories when it starts and removes them when it ends; `troupe stop` removes what a killed
// agent left.
// Thread-safety: a value the agent's KJ thread owns.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <string_view>

#include <kj/async-io.h>
#include <kj/common.h>

#include "troupe/runtime/ids.h"
#include "troupe/runtime/safe_open.h"
#include "troupe/runtime/status.h"

namespace troupe {

class NodeObjects {
 public:
  // Largest chunk one readObject answers: several are in flight, each one RPC message.
  static constexpr uint32_t kMaxChunk = 16u << 20;
  // The smallest limit a store may be given.
  static constexpr uint64_t kMinLimit = 8u << 20;

  // Makes this node's directory, /dev/shm/troupe-node-<id> (or under $TMPDIR without /dev/shm),
  // 0700. Someone else's directory at that name is left alone and a fresh one made beside it.
  // The path is recorded in <runDir>/objects/<id> for `troupe stop`; the agent keeps
  // <dir>/.lock locked while it lives, and removes the directories of this machine's agents that
  // died without removing theirs (kill -9: their lock is free). The spill directory is
  // <runDir>/spill/<id> (0700). limit: bytes of shared memory the objects may hold (0: 30% of
  // RAM, at most the shared-memory file system's size).
  static Result<NodeObjects> open(const NodeId& node, const std::string& runDir, uint64_t limit = 0);
  NodeObjects() = default;
  NodeObjects(NodeObjects&&) noexcept;
  NodeObjects& operator=(NodeObjects&&) noexcept;
  ~NodeObjects();

  const std::string& directory() const { return directory_; }
  const std::string& spillDirectory() const { return spill_; }
  uint64_t limit() const { return limit_; }

  struct Usage {
    uint64_t objects = 0;
    uint64_t bytes = 0;
    uint64_t spilledObjects = 0;
    uint64_t spilledBytes = 0;
  };
  Usage usage() const;

  // Copies up to into.size() bytes of object `name` from `offset` into `into`; returns how many
  // and the object's size. kNotFound names why the object is gone (freed, or its owner died),
  // kInvalidArgument a name that is no object's.
  struct Read {
    size_t length = 0;
    uint64_t size = 0;
  };
  Result<Read> read(std::string_view name, uint64_t offset, kj::ArrayPtr<kj::byte> into) const;
  // The object's file, open for reading, and its size (errors as read()'s).
  struct Opened {
    FileDescriptor fd;
    uint64_t size = 0;
  };
  Result<Opened> openObject(std::string_view name) const;

  // Serves one connection of the agent's bulk port: requests, each answered in turn until the
  // peer closes. Request: u32 name length (<= 200) | name | u64 offset | u64 length. Answer:
  // u8 status code (0: OK) | u64 object size | u32 message length (<= 4096) | message, then, when
  // OK, the `length` bytes from `offset`, written straight from a mapping of the file. A copy
  // still being pulled here (its <name>.ready file holds how many bytes have arrived, in order)
  // is sent as its bytes arrive; one that makes no progress for kStall fails the request.
  kj::Promise<void> serve(kj::Own<kj::AsyncIoStream> stream, kj::Timer& timer) const;
  static constexpr kj::Duration kStall = 10 * kj::SECONDS;

  // Serving on (a relay): several nodes pulling one object do not each cost this node a copy.
  // A puller names, with its first chunk, where its own copy can be read ("<host>:<bulk
  // port>/<copy name>", its offer); the next puller of the object is sent to the copy that
  // serves the fewest others (relayFor, "" when there is none: it streams from here), and
  // falls back to this node if the relay fails. dropSource forgets an offer whose copy went.
  std::string relayFor(std::string_view name, std::string_view offer) const;
  void dropSource(std::string_view name, std::string_view offer) const;
  // Bytes of this node's objects sent to other nodes (chunks and streams).
  uint64_t servedBytes() const { return served_; }
  // Deletes a handed-over result (only those: names "<pid>-h...") once its caller pulled it.
  Status drop(std::string_view name) const;

  // Whether `name` could name an object file: what a peer may ask for (no path, no dot file).
  static bool validName(std::string_view name);

  // Holds: who else has refs to an object (the borrower protocol of python/troupe/_objects.py).
  // <directory>/.refs/<name>/ exists once the owner has lent a ref, with one file per holder:
  // "<pid>" (a process of this node: the owner while it keeps refs, and borrowers), "<node>.<pid>"
  // (a process of another node), "x<id>.<pid>" (a process of no node), and "<holder>:<token>"
  // for a ref that holder sent that nobody has received yet. The holder that removes the last
  // file removes the directory (rmdir: exactly one does) and the object with it.
  //
  // The calls of holders of other nodes, which cannot reach the files. hold: the holder received
  // a ref (its file is made, then the in-flight file `landed` removed); lend: it sends one on
  // (the in-flight file <holder>:<token>); release: it dropped its last ref (or, named
  // <holder>:<token>, a value that held a ref sent in it is gone). kNotFound: the object
  // is freed; kInvalidArgument: a malformed name, holder or token.
  Status hold(std::string_view name, std::string_view holder, std::string_view landed) const;
  Status lend(std::string_view name, std::string_view holder, std::string_view token) const;
  Status release(std::string_view name, std::string_view holder) const;

  // The pids holding refs here, by the id of their node (other nodes only).
  std::map<std::string, std::set<int>> remoteHolders() const;
  // What is known of other nodes' processes: the pids alive on nodes that answered, and the
  // nodes that are dead. A holder of a node in neither is kept.
  struct RemoteLiveness {
    std::map<std::string, std::set<int>> alive;
    std::set<std::string> dead;
  };
  // Removes the files of holders that are gone (a dead pid of this node, a process another node
  // says is gone, a dead node), and each object whose last holder went or whose owner died.
  void sweep(const RemoteLiveness& remote) const;

 private:
  // One bulk request's answer; a copy still arriving here may be waited for since `since`.
  kj::Promise<void> answer(kj::AsyncIoStream& s, kj::Timer& timer, std::string name, uint64_t offset, uint64_t length,
                           kj::TimePoint since) const;

  std::string directory_;
  std::string spill_;
  std::string refs_;  // <directory>/.refs
  uint64_t limit_ = 0;
  struct Source {
    std::string offer;
    uint32_t serving = 0;  // pullers sent to it
  };
  mutable std::map<std::string, std::vector<Source>> sources_;  // by object name
  mutable uint64_t served_ = 0;
  std::string record_;  // <runDir>/objects/<id>
  int lock_ = -1;       // <directory>/.lock, flock'd while this agent lives
};

// Removes the object directory a run's node recorded in <runDir>/objects (`troupe stop`, after
// the agents): only a directory of this user named troupe-node-*, with the files in it; and the
// run's spill directories.
void removeRecordedObjectDirectories(const std::string& runDir);

}  // namespace troupe
