"""Troupe: an actor runtime for distributed training.

    import troupe
    troupe.init()                      # an embedded local cluster (or "auto", "HOST:PORT")

    @troupe.remote(num_cpus=1)
    class Counter:
        def __init__(self): self.n = 0
        def add(self, k): self.n += k; return self.n

    c = Counter.remote()
    print(troupe.get(c.add.remote(5)))

`troupe.optim` (AGD, WSAM, LAMB, LARS, AdamW on fused C++ kernels) and `troupe.checkpoint`
(Flash checkpoints: shared-memory snapshots, the persisted format) are imported on first use,
so `import troupe` does not import torch.
"""

import importlib

from ._api import (ActorClass, ActorHandle, ObjectRef, actors, cluster_resources, cpp_actor, get, get_actor, init,
                   is_initialized, kill, nodes, remote, shutdown, wait)
from .exceptions import ActorDiedError, ActorError, GetTimeoutError, TroupeError

__all__ = ["ActorClass", "ActorDiedError", "ActorError", "ActorHandle", "GetTimeoutError", "ObjectRef", "TroupeError",
           "actors", "cluster_resources", "cpp_actor", "get", "get_actor", "init", "is_initialized", "kill", "nodes",
           "checkpoint", "optim", "remote", "shutdown", "train", "wait"]


def __getattr__(name):
    if name in ("optim", "checkpoint", "train"):
        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'troupe' has no attribute {name!r}")
