// The built-in "Checkpoint" actor: one per node of a training group. It owns the node's
// shared-memory checkpoint segments (checkpoint/flash_segment.h) so they outlive the trainers
// that write them, persists new snapshots to the checkpoint directory in the background, sends
// each new snapshot to the checkpoint actor of another node as a replica (and keeps the replicas
// other nodes send it), and serves restores: the newest step complete on every rank, from this
// node's memory, else another node's memory or replica, else disk.
//
// Init args (JSON object):
//   "group"      required  the group's name, [A-Za-z0-9_-]{1,64}; part of every segment name
//   "node"       required  this node's tag, same characters; unique among the group's actors
//   "self"                 this actor's name (as created with name=...), used by peers and to
//                          pick the default replica target
//   "members"              names of every checkpoint actor of the group, this one included
//   "replica_to"           name of the actor that keeps this node's replicas; default: the member
//                          after "self" in "members" (cyclic) when there are several; "" turns
//                          replicas off
//   "dir"                  checkpoint directory (shared by the group's actors); "" or absent: no
//                          persistence
//   "keep"                 complete steps kept on disk (default 3)
//   "shm_dir"              shared-memory directory (default /dev/shm, or $TROUPE_SHM_DIR)
//   "fault"                a fault-injection spec (checkpoint/fault.h), for tests
//
// Methods (call(method, payload)); JSON payloads and replies unless noted. Every call returns
// promptly: persisting, replicating and restoring run in the background (a persist thread, a
// restore thread, and the RPC thread's event loop for peer transfers).
//   attach        {"rank": r}  ->  {"segment": name, "shm_dir": dir}: where rank r snapshots
//   saved         {"rank": r, "step": s}  ->  {"queued": true}: a snapshot of rank r is complete
//                 in its segment; persist and replicate the newest one (coalesced: if saves come
//                 faster than a persist, the newest snapshot is persisted next and the ones in
//                 between are skipped)
//   status        ""  ->  {"pid", "group", "node", "dir", "persisted": {r: step},
//                 "persist_errors": [..], "replicated": {r: step}, "replica_errors": [..],
//                 "replicas_held": {r: step}}
//   inventory     ""  ->  {"actor", "node", "holdings": [{"rank", "step", "world_size",
//                 "kind": "memory"|"replica", "image_bytes"}]}: complete snapshots held here
//   read          {"kind": "memory"|"replica", "rank", "step", "offset", "length"}  ->  raw bytes
//                 of that snapshot's image (at most 8 MiB); an error if the snapshot is no longer
//                 held or changed while being read
//   replicaBegin  {"rank", "step", "image_bytes", "from"}  ->  {"slot": k}: a peer starts sending
//                 a replica of its rank r
//   replicaWrite  binary: u32 rank, u32 slot, u64 step, u64 offset (little-endian), then bytes
//                 ->  ""
//   replicaCommit {"rank", "slot", "step"}  ->  {"step": s}: every byte sent; the replica's
//                 checksums are verified before it counts
//   restore       {"rank": r, "max_step"?: s}  ->  {"state": "running"} while in progress, then
//                 once {"state": "done", "step", "source", "segment", "skipped": [..]} or
//                 {"state": "none", "skipped": [..]}: stages the newest step complete on every
//                 rank (at most max_step) into rank r's segment on this node; the trainer then
//                 reads it from there. Call again until the state is not "running". Trainers whose
//                 restored steps differ restore again with max_step = the smallest.
//   release       ""  ->  {"removed": [names]}: the group ended: cancels restores in progress,
//                 removes this node's segments of the group and temporary files of dead writers
//                 in the directory. Call it once the group's trainers have stopped (a replica
//                 arriving afterwards would create a segment again). Also done when the actor
//                 exits cleanly (SIGTERM); a kill -9 leaves the segments (by design: a new
//                 incarnation finds them) until release or `troupe stop`.
// Errors are returned as the call's error with a message naming what failed.
// Thread-safety: see troupe/runtime/actor.h; internal threads only touch what they own.
#pragma once

#include "troupe/runtime/actor.h"

namespace troupe::actors {

// Registers the "Checkpoint" actor type.
void registerCheckpointActor(ActorRegistry& registry);

}  // namespace troupe::actors
