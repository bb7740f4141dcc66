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
so `import troupe` does not import torch. `troupe.__version__` is the version in meson.build.
The package is typed (PEP 561: py.typed).
"""

import importlib
from types import ModuleType

from ._api import (ActorClass, ActorHandle, ObjectRef, actors, available_resources, cluster_resources, cpp_actor,
                   exit_actor, get, get_actor, get_runtime_context, init, is_initialized, kill, method, nodes, put,
                   remote, shutdown, wait)
from ._tasks import RemoteFunction
from ._version import __version__
from .exceptions import (ActorDiedError, ActorError, GetTimeoutError, ObjectLostError, TaskError, TroupeError,
                         WorkerCrashedError)

__all__ = ["__version__", "ActorClass", "ActorDiedError", "ActorError", "ActorHandle", "GetTimeoutError",
           "ObjectLostError", "ObjectRef", "RemoteFunction", "TaskError", "TroupeError", "WorkerCrashedError", "actors",
           "available_resources", "cluster_resources", "cpp_actor", "exit_actor", "get", "get_actor",
           "get_runtime_context", "init", "is_initialized", "kill", "method", "nodes", "put", "checkpoint", "optim",
           "remote", "shutdown", "train", "util", "wait"]


def __getattr__(name: str) -> ModuleType:
    if name in ("optim", "checkpoint", "train", "util"):
        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'troupe' has no attribute {name!r}")
