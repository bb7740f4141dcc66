"""Placement groups from Python, as ray.util offers them.

    pg = troupe.util.placement_group([{"CPU": 1}, {"CPU": 1}], strategy="SPREAD")
    troupe.get(pg.ready())
    a = Actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0)).remote()
    troupe.util.remove_placement_group(pg)
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from . import _api, _checks, _session
from .exceptions import TroupeError
from .exceptions import ArgumentTypeError, InvalidArgumentError

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class PlacementGroup:
    """A handle to a placement group: its id, bundles, and readiness."""

    def __init__(self, pg_id: str, bundle_specs: list[dict[str, float]] | None = None) -> None:
        self.id = pg_id
        self.bundle_specs = bundle_specs or []

    @property
    def bundle_count(self) -> int:
        return len(self.bundle_specs)

    def _state(self) -> dict[str, Any]:
        return _api.runtime_call(_api.runtime().placement_group, self.id)

    def ready(self) -> _api.ObjectRef:
        """An ObjectRef that resolves (to this group) once every bundle is placed; get() of it
        raises if the group was removed."""

        def poll():
            g = self._state()
            if g["state"] == "CREATED":
                return True, self
            if g["state"] == "REMOVED":
                return True, TroupeError(f"placement group {self.id} was removed before it was ready")
            return False, None

        return _api.PollRef(f"placement_group({self.id[:8]}).ready", poll)

    def wait(self, timeout_seconds: float = 30) -> bool:
        """True once the group is placed, False if timeout_seconds pass first."""
        deadline = time.monotonic() + timeout_seconds
        while True:
            state = self._state()["state"]
            if state == "CREATED":
                return True
            if state == "REMOVED" or time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def __reduce__(self):
        return PlacementGroup, (self.id, self.bundle_specs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PlacementGroup) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"PlacementGroup({self.id})"


def placement_group(bundles: Sequence[Mapping[str, float]], strategy: str = "PACK", name: str = "",
                    lifetime: str | None = None) -> PlacementGroup:
    """Reserves `bundles` (a list of {resource: quantity}) with `strategy`; returns at once, with
    the group PENDING until it is placed (see ready() and wait()). An infeasible group raises."""
    if strategy not in STRATEGIES:
        raise InvalidArgumentError(f"strategy must be one of {STRATEGIES}, not {strategy!r}")
    if not isinstance(bundles, (list, tuple)) or not bundles:
        raise InvalidArgumentError("bundles must be a non-empty list of {resource: quantity} dicts")
    specs = []
    for i, b in enumerate(bundles):
        if not isinstance(b, dict) or not b or any(not isinstance(v, (int, float)) or v < 0 for v in b.values()):
            raise InvalidArgumentError(f"bundle {i} must be a non-empty dict of quantities >= 0, not {b!r}")
        if all(v == 0 for v in b.values()):
            raise InvalidArgumentError(f"bundle {i} asks for no resources: {b!r}")
        specs.append({k: float(v) for k, v in b.items()})
    if lifetime not in (None, "detached"):
        raise InvalidArgumentError(f"lifetime must be None or 'detached', not {lifetime!r}")
    g = _api.runtime_call(_api.runtime().create_placement_group, strategy, specs, name or "")
    return PlacementGroup(g["id"], specs)


def remove_placement_group(pg: PlacementGroup | str) -> None:
    """Releases the group's bundles; actors in it end."""
    _api.runtime_call(_api.runtime().remove_placement_group, getattr(pg, "id", pg))


def placement_group_table(pg: PlacementGroup | str | None = None) -> dict[str, Any]:
    """The state of one group (or, with no argument, raises: listing all is `troupe status`)."""
    if pg is None:
        raise ArgumentTypeError("placement_group_table() needs a placement group (see `troupe status` for all)")
    return _api.runtime_call(_api.runtime().placement_group, getattr(pg, "id", pg))


def get_placement_group(placement_group_name: str) -> PlacementGroup:
    """The placement group named `placement_group_name` (Ray's ray.util.get_placement_group;
    names are cluster-wide). ValueError when no live group has it."""
    _checks._check_name(placement_group_name, "placement group name")
    for g in _api.runtime_call(_api.runtime().snapshot)["placement_groups"]:
        if g["name"] == placement_group_name and g.get("state") != "REMOVED":
            return PlacementGroup(g["id"], [dict(b) for b in g["bundles"]])
    raise InvalidArgumentError(f"Failed to look up placement group with name: {placement_group_name}")


def list_named_actors(all_namespaces: bool = False) -> list[str] | list[dict[str, str]]:
    """Ray's ray.util.list_named_actors: the names of the live named actors in this job's
    namespace, or with all_namespaces=True [{"name", "namespace"}] of every namespace's."""
    out: list[Any] = []
    here = _session._current_namespace()
    for a in _api.actors():
        if not a.get("name") or a.get("state") == "DEAD":
            continue
        namespace, _, name = a["name"].rpartition("/")  # names hold no '/': see _session._scoped_name
        namespace = namespace or _api.DEFAULT_NAMESPACE
        if all_namespaces:
            out.append({"name": name, "namespace": namespace})
        elif namespace == here:
            out.append(name)
    return out


class PlacementGroupSchedulingStrategy:
    """Schedules an actor or task into a bundle of a placement group (index -1: bundle 0)."""

    def __init__(self, placement_group: PlacementGroup, placement_group_bundle_index: int = -1,
                 placement_group_capture_child_tasks: bool | None = None) -> None:
        self.placement_group = placement_group
        self.placement_group_bundle_index = placement_group_bundle_index


class NodeAffinitySchedulingStrategy:
    def __init__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError("NodeAffinitySchedulingStrategy is not supported by Troupe; use a custom "
                                  "resource of the node (start --resources) or a placement group")


__all__ = ["PlacementGroup", "PlacementGroupSchedulingStrategy", "placement_group", "placement_group_table",
           "remove_placement_group"]
