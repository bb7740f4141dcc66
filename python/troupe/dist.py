"""torch.distributed's "troupe" backend: importing this module registers it.

    import torch.distributed as dist
    import troupe.dist  # noqa: F401
    dist.init_process_group("troupe", init_method="tcp://10.0.0.1:29500", rank=r, world_size=n)

CPU tensors over Troupe's communicators: shared memory between the ranks of one host, the TCP
ring across hosts. Ops: all_reduce (SUM, AVG, MIN, MAX), broadcast, all_gather,
all_gather_into_tensor (_allgather_base), reduce_scatter, reduce_scatter_tensor
(_reduce_scatter_base), barrier, send, recv; any other op raises an error naming it. DDP and
ZeroRedundancyOptimizer work on it. After a failure (a peer died: the error names it) the group is
unusable: destroy it and create another.

Environment, read when a group is created:
  TROUPE_DIST_HOST       the address this rank listens on for its peers (default: the address
                         that routes to MASTER_ADDR when it is set and not loopback, else
                         127.0.0.1)
  TROUPE_DIST_TLS_TOKEN  non-empty: every connection speaks TLS keyed by this token (all ranks
                         must agree)
  TROUPE_COLLECTIVES_SHM=0  ranks on one host talk TCP instead of shared memory
"""
import os
import socket

import torch.distributed as _torch_dist

from troupe import _dist

BACKEND = "troupe"


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
    return "127.0.0.1"


def _create(store, rank, world_size, timeout):
    return _dist.create_process_group(
        store, rank, world_size, timeout.total_seconds(), _local_host(),
        os.environ.get("TROUPE_DIST_TLS_TOKEN", ""),
        os.environ.get("TROUPE_COLLECTIVES_SHM", "1") != "0")


def health(group=None):
    """'OK', or the error that made the group's communicator unusable (group: default group)."""
    pg = group if group is not None else _torch_dist.distributed_c10d._get_default_group()
    return _dist.health(pg)


if not hasattr(_torch_dist.Backend, BACKEND.upper()):
    _torch_dist.Backend.register_backend(BACKEND, _create)
