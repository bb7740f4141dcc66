@0x9bc102bf5ef90ae7;
# The built-in Checkpoint actor's typed interface (actors/checkpoint_actor.cc; what it does is
# described in troupe/actors/checkpoint_actor.h). Trainers, peers and the Python driver call it;
# the Python side reaches the same methods through the actor's generic call, the params and
# results encoded with this schema (troupe._actors).

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("troupe::actors::rpc");

# Where a snapshot is held on a node: the rank's own segment, or a replica a peer sent.
enum SnapshotKind {
  memory @0;
  replica @1;
}

# A background job's answer: still running, finished with a result, or finished with nothing.
enum JobState {
  running @0;
  done @1;
  none @2;
}

struct RankStep {
  rank @0 :UInt32;
  step @1 :UInt64;
}

# A complete snapshot this node holds.
struct Holding {
  rank @0 :UInt32;
  step @1 :UInt64;
  worldSize @2 :UInt32;
  kind @3 :SnapshotKind;
  imageBytes @4 :UInt64;
}

struct CheckpointStatus {
  pid @0 :Int64;
  group @1 :Text;
  node @2 :Text;
  dir @3 :Text;
  persisted @4 :List(RankStep);       # the newest step persisted, per rank
  persistErrors @5 :List(Text);       # recent errors, oldest first
  replicated @6 :List(RankStep);      # the newest step the replica target confirmed, per rank
  replicaErrors @7 :List(Text);
  replicasHeld @8 :List(RankStep);    # replicas other nodes sent here, per rank
  replicasPinned @9 :List(RankStep);
}

interface Checkpoint {
  # Where rank `rank` snapshots on this node: a segment in `shmDir`.
  attach @0 (rank :UInt32) -> (segment :Text, shmDir :Text);
  # A snapshot of `rank` is complete in its segment: persist and replicate the newest one
  # (coalesced: saves faster than a persist skip to the newest).
  saved @1 (rank :UInt32, step :UInt64) -> ();
  # The group's live checkpoint actors (this one is added if missing); returns the new replica
  # target ("" when alone).
  members @2 (members :List(Text)) -> (replicaTo :Text);
  # Pins rank's newest snapshot at or before `step` here and in its replica. Answers at once:
  # `running` until the job ends, then once `done` with the step pinned (hasStep false when no
  # snapshot exists) and the peer holding the replica ("" without one), or the job's error.
  pin @3 (rank :UInt32, step :UInt64) -> (state :JobState, hasStep :Bool, step :UInt64, replicaTo :Text);
  status @4 () -> (status :CheckpointStatus);
  # The complete snapshots held in this node's segments of the group.
  inventory @5 () -> (actor :Text, node :Text, holdings :List(Holding));
  # Bytes [offset, offset + length) of a held snapshot's image; length at most 8 MiB. Fails
  # (NOT_FOUND, ABORTED) if the snapshot is no longer held or changed while being read.
  read @6 (kind :SnapshotKind, rank :UInt32, step :UInt64, offset :UInt64, length :UInt64) -> (data :Data);
  # Stages the newest step complete on every rank (at most maxStep) into rank's segment here.
  # Answers at once: `running` while in progress, then once `done` (step, source, segment) or
  # `none`, with the sources skipped and why. Call again until the state is not `running`.
  restore @7 (rank :UInt32, maxStep :UInt64 = 0xffffffffffffffff)
      -> (state :JobState, step :UInt64, source :Text, segment :Text, skipped :List(Text));
  # The group ended: cancels restores, removes this node's segments and dead writers' files.
  release @8 () -> (removed :List(Text));

  # Peer to peer: a replica of the sender's rank `rank` arrives in chunks.
  replicaBegin @9 (rank :UInt32, step :UInt64, imageBytes :UInt64, from :Text) -> (slot :UInt32);
  replicaWrite @10 (rank :UInt32, slot :UInt32, step :UInt64, offset :UInt64, data :Data) -> ();
  # Every byte sent: the image's header and checksums are verified before it is held.
  replicaCommit @11 (rank :UInt32, slot :UInt32, step :UInt64) -> (step :UInt64);
  replicaPin @12 (rank :UInt32, step :UInt64) -> (step :UInt64);
}
