"""torch.distributed's "troupe" backend (importing this module registers it), and a
torch.distributed Store over the cluster.

    import torch.distributed as dist
    import troupe.dist  # noqa: F401
    dist.init_process_group("troupe", init_method="tcp://10.0.0.1:29500", rank=r, world_size=n)

    # In a Troupe actor, on any hosts: no shared file system, no TCPStore port, no rank-0 address.
    store = troupe.dist.ClusterStore("my-job/attempt-3", timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=r, world_size=n)  # or "troupe", "nccl"

ClusterStore(prefix, timeout=timedelta(seconds=300), ttl=None) is a torch.distributed Store
(set, get, add, compare_set, wait, delete_key, num_keys, set_timeout) whose keys live in the
cluster's store under `prefix` (any non-empty string; stores with the same prefix share keys),
reached as the actor's node agent handed it over: the head's Redis, or the head's store gateway
from another host. get() and wait() wait up to the timeout; a wait that times out raises a
RuntimeError naming the missing keys. The keys expire `ttl` after the last write (default: an
hour, or twice the timeout if longer); delete_all() deletes them at once. It works only in a
Troupe worker process (an actor); elsewhere it raises RuntimeError.

group_store(group, epoch, timeout=..., ttl=None) joins epoch `epoch` of the cluster's collective
group `group` (raising the group's epoch to it: the earlier epochs are over; RuntimeError when the
group is already past it) and returns the ClusterStore of that epoch (prefix "<group>:<epoch>"),
deleted with the group's record; its waits fail as soon as the group moves past the epoch.
TorchTrainer's ranks rendezvous through it.

CPU tensors over Troupe's communicators: shared memory between the ranks of one host, the TCP
ring across hosts. Ops: all_reduce (SUM, AVG, MIN, MAX), broadcast, all_gather,
all_gather_into_tensor (_allgather_base), reduce_scatter, reduce_scatter_tensor
(_reduce_scatter_base), barrier, send, recv; any other op raises an error naming it. DDP and
ZeroRedundancyOptimizer work on it. After a failure (a peer died: the error names it) the group is
unusable: destroy it and create another.

Environment, read when a group is created:
  TROUPE_DIST_HOST       the address this rank listens on for its peers (default: the address
                         that routes to MASTER_ADDR when it is set and not loopback, else the
                         node's address in a Troupe worker (TROUPE_NODE_IP), else 127.0.0.1)
  TROUPE_DIST_TLS_TOKEN  non-empty: every connection speaks TLS keyed by this token (all ranks
                         must agree)
  TROUPE_COLLECTIVES_SHM=0  ranks on one host talk TCP instead of shared memory
"""
import datetime
import os
import socket

import torch.distributed as _torch_dist

from troupe import _dist

BACKEND = "troupe"

ClusterStore = _dist.ClusterStore

__all__ = ["BACKEND", "ClusterStore", "dead_peers", "group_store", "health"]


def group_store(group: str, epoch: int, timeout: datetime.timedelta = datetime.timedelta(seconds=300),
                ttl: "datetime.timedelta | None" = None) -> ClusterStore:
    """The ClusterStore of epoch `epoch` of the cluster's collective group `group`, after joining
    that epoch (see the module's doc)."""
    return _dist.group_store(group, int(epoch), timeout, ttl)


def _local_host():
    host = os.environ.get("TROUPE_DIST_HOST")
    if host:
        return host
    master = os.environ.get("MASTER_ADDR", "")
    if master and master not in ("localhost", "127.0.0.1", "::1"):
        # The address of the interface that routes to the master (a UDP connect sends nothing).
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))
            return s.getsockname()[0]
    # In a Troupe worker: the node's address, which its peers on other hosts reach.
    return os.environ.get("TROUPE_NODE_IP") or "127.0.0.1"


def _create(store, rank, world_size, timeout):
    return _dist.create_process_group(
        store, rank, world_size, timeout.total_seconds(), _local_host(),
        os.environ.get("TROUPE_DIST_TLS_TOKEN", ""),
        os.environ.get("TROUPE_COLLECTIVES_SHM", "1") != "0")


def health(group=None):
    """'OK', or the error that made the group's communicator unusable (group: default group)."""
    pg = group if group is not None else _torch_dist.distributed_c10d._get_default_group()
    return _dist.health(pg)


def dead_peers(group=None):
    """The ranks whose death the group's communicator saw: their process ended, as the kernel
    said (a rank on this host) or their connection did (group: default group)."""
    pg = group if group is not None else _torch_dist.distributed_c10d._get_default_group()
    return _dist.dead_peers(pg)


def waiting_on(group=None):
    """For hang reports: the peers the collective in progress waits for ('' when none runs)."""
    pg = group if group is not None else _torch_dist.distributed_c10d._get_default_group()
    return _dist.waiting_on(pg)


if not hasattr(_torch_dist.Backend, BACKEND.upper()):
    _torch_dist.Backend.register_backend(BACKEND, _create)
