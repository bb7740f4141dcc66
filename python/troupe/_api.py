"""The driver API as `troupe` exports it, gathered from its layers (each imports only those
below it):

- troupe._checks: the checks of what a user passes (names, timeouts, resources, runtime_env);
- troupe._session: init()/shutdown() and the embedded cluster's launcher, runtime() and
  runtime_call() (how the rest of the package reaches the cluster), the cluster views;
- troupe._refs: ObjectRef, put(), get(), wait(), and calls that wait for their arguments;
- troupe._remote: remote(), actor classes, handles and their method calls, cpp_actor(), kill(),
  get_actor();
- troupe._tasks (above these): remote functions and their worker pools.
"""
from ._refs import ObjectRef, PollRef, get, put, wait
from ._remote import ActorClass, ActorHandle, cpp_actor, exit_actor, get_actor, kill, method, remote
from ._session import (DEFAULT_NAMESPACE, actors, available_resources, cluster_resources, default_run_root,
                       get_runtime_context, init, is_initialized, nodes, runtime, runtime_call, shutdown)
from .exceptions import TroupeError

__all__ = ["DEFAULT_NAMESPACE", "ActorClass", "ActorHandle", "ObjectRef", "PollRef", "TroupeError", "actors",
           "available_resources", "cluster_resources", "cpp_actor", "default_run_root", "exit_actor", "get", "get_actor",
           "get_runtime_context", "init", "is_initialized", "kill", "method", "nodes", "put", "remote", "runtime",
           "runtime_call", "shutdown", "wait"]
