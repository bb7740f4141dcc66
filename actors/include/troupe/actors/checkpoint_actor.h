// The built-in "Checkpoint" actor: one per node of a training group. It owns the node's
// shared-memory checkpoint segments (checkpoint/flash_segment.h) so they outlive the trainers
// that write them, persists new snapshots to the checkpoint directory in the background, sends
// each new snapshot to the checkpoint actor of another node as a replica (and keeps the replicas
// other nodes send it), and serves restores: the newest step complete on every rank, from this
// node's memory, else another node's memory or replica, else disk.
//
// Init args: rpc::CheckpointArgs (actors/schema/init_args.capnp), written from a JSON object with
// these keys (troupe/actors/init_args.h):
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
//   "file_mode"            persisted files' permission mode (default 0600; its owner must read
//                          and write)
//   "shm_dir"              shared-memory directory (default /dev/shm, or $TROUPE_SHM_DIR)
//   "fault"                a fault-injection spec (checkpoint/fault.h), for tests
//
// Methods: the typed interface rpc::Checkpoint (actors/schema/checkpoint.capnp, included as
// "checkpoint.capnp.h"; ActorHandle::typed<rpc::Checkpoint>()), which says what each takes and
// returns. The generic call(method, payload) reaches the same methods by name, the params and
// results encoded with that schema (how Python calls them: troupe._actors). Every call returns
// promptly: persisting, replicating and restoring run in the background (a persist thread, a
// restore thread, and the RPC thread's event loop for peer transfers).
//   attach, saved   a trainer's rank snapshots into the segment attach names, then says so;
//                   the newest snapshot is persisted and replicated (coalesced: if saves come
//                   faster than a persist, the ones in between are skipped)
//   pin             the newest snapshot at or before a step is pinned here and in its replica
//   restore         stages the newest step complete on every rank (at most maxStep) into the
//                   rank's segment here; answers `running` until it is done, then once `done`
//                   (step, source) or `none`. Trainers whose restored steps differ restore again
//                   with maxStep = the smallest.
//   status, inventory, read   what is persisted, replicated and held; a held image's bytes
//                   (at most 8 MiB a call)
//   members         the group's live checkpoint actors: picks the replica target
//   replicaBegin, replicaWrite, replicaCommit, replicaPin   from the peer that sends replicas;
//                   a replica counts once its header and checksums are verified at commit
//   release         the group ended: cancels restores in progress, removes this node's segments
//                   of the group and temporary files of dead writers in the directory. Call it
//                   once the group's trainers have stopped (a replica arriving afterwards would
//                   create a segment again). Also done when the actor exits cleanly (SIGTERM); a
//                   kill -9 leaves the segments (by design: a new incarnation finds them) until
//                   release or `troupe stop`.
// Errors are returned as the call's error with a message naming what failed.
// Thread-safety: see troupe/runtime/actor.h; internal threads only touch what they own.
#pragma once

#include "troupe/runtime/actor.h"

namespace troupe::actors {

// Registers the "Checkpoint" actor type.
void registerCheckpointActor(ActorRegistry& registry);

}  // namespace troupe::actors
