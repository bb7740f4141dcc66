"""A driver's commands to an elastic group's coordinator (GroupHandle.resize / stop) travel typed,
as the group's commands (troupe.capnp GroupCommand), never as text in its event log; a command to
a group that is gone fails at the sender; the coordinator acts on each new command once and an
adopting coordinator does not replay the old ones. On a real local cluster, without trainers."""
import json
import os
import time
import uuid

import pytest

from troupe_testing import import_troupe, local_cluster

troupe = import_troupe()
from troupe.exceptions import InvalidArgumentError, NotFoundError  # noqa: E402 (after the import path is set)


@pytest.fixture
def cluster():
    yield from local_cluster(num_cpus=1)


def make_group(rt, name):
    """A group record as a coordinator writes it (no trainers: only the record is commanded)."""
    group_id = uuid.uuid4().hex[:16]
    rt.put_group(group_id, json.dumps({"name": name, "state": "RUNNING", "step": 0}))
    return group_id


def test_resize_and_stop_are_typed_commands_not_event_lines(cluster):
    from troupe.train import GroupHandle

    rt = troupe._api.runtime()
    group_id = make_group(rt, "commanded")
    handle = GroupHandle(rt, "commanded", group_id)
    before = int(time.time() * 1000)
    assert handle.resize(2) == 1
    assert handle.stop() == 2
    record = rt.group(group_id)
    assert [(c["seq"], c["kind"], c["workers"]) for c in record["commands"]] == [(1, "resize", 2), (2, "stop", 0)]
    for c in record["commands"]:
        assert c["from"].endswith(f" pid {os.getpid()}"), c
        assert before - 1000 <= c["time_ms"] <= int(time.time() * 1000) + 1000, c
    # Nothing of a command is in the event log, which is for people to read.
    assert not any("request" in line or "resize" in line or "stop" in line for line in record["events"]), record
    # The same commands in the list every reader gets (troupe status, the dashboard).
    listed = [g for g in rt.groups() if g["id"] == group_id]
    assert listed and listed[0]["commands"] == record["commands"]


@pytest.mark.parametrize("workers", [0, -1, 2.5, "2", True, None])
def test_a_resize_to_no_positive_int_is_refused_before_it_is_sent(cluster, workers):
    from troupe.train import GroupHandle

    rt = troupe._api.runtime()
    group_id = make_group(rt, "refused")
    with pytest.raises(InvalidArgumentError):
        GroupHandle(rt, "refused", group_id).resize(workers)
    assert rt.group(group_id)["commands"] == []


def test_a_resize_to_broken_rings_is_refused_at_the_sender(cluster):
    # Rings of 2 trainers (sequence_parallel=2), 2 to 6 trainers: 3 and 5 break a ring; 1 clamps
    # to 2 and 7 to 6, both whole rings.
    from troupe.train import GroupHandle

    rt = troupe._api.runtime()
    group_id = uuid.uuid4().hex[:16]
    rt.put_group(group_id, json.dumps({"name": "rings", "state": "RUNNING", "step": 0, "min_workers": 2,
                                       "max_workers": 6, "engine": {"sequence_parallel": 2}}))
    handle = GroupHandle(rt, "rings", group_id)
    for broken in (3, 5):
        with pytest.raises(InvalidArgumentError, match="sequence_parallel=2"):
            handle.resize(broken)
    assert rt.group(group_id)["commands"] == []
    assert handle.resize(1) == 1 and handle.resize(7) == 2
    assert [c["workers"] for c in rt.group(group_id)["commands"]] == [1, 7]


def test_the_binding_checks_the_kind_and_the_number(cluster):
    rt = troupe._api.runtime()
    group_id = make_group(rt, "binding")
    with pytest.raises(InvalidArgumentError, match="grow"):
        rt.group_command(group_id, "grow", 2)
    with pytest.raises(InvalidArgumentError):
        rt.group_command(group_id, "resize", 0)
    with pytest.raises(InvalidArgumentError):
        rt.group_command(group_id, "resize", 2**32)
    assert rt.group_command(group_id, "resize", workers=3) == 1
    assert rt.group(group_id)["commands"][0]["workers"] == 3


def test_a_command_to_a_removed_or_unknown_group_raises_not_found(cluster):
    from troupe.train import GroupHandle

    rt = troupe._api.runtime()
    group_id = make_group(rt, "removed")
    handle = GroupHandle(rt, "removed", group_id)
    assert handle.resize(1) == 1
    rt.remove_group(group_id)
    with pytest.raises(NotFoundError, match=group_id):
        handle.resize(2)
    with pytest.raises(NotFoundError):
        handle.stop()
    with pytest.raises(NotFoundError):
        GroupHandle(rt, "never", "00000000deadbeef").stop()


def test_the_coordinator_takes_each_new_command_once_and_an_adopter_skips_the_old(cluster):
    """GroupCoordinator._commands: what fit() acts on at each chunk boundary; the highest seq
    present at adoption is where an adopting coordinator starts (as _adopt sets it)."""
    from troupe._group import GroupCoordinator, GroupHandle, _newest_command

    rt = troupe._api.runtime()
    group_id = make_group(rt, "coordinated")
    handle = GroupHandle(rt, "coordinated", group_id)
    coordinator = GroupCoordinator.__new__(GroupCoordinator)  # its loop's state only: no trainers
    coordinator._rt, coordinator.group_id, coordinator._handled = rt, group_id, 0
    assert coordinator._commands() == []
    handle.resize(2)
    handle.stop()
    assert [(c["kind"], c["workers"]) for c in coordinator._commands()] == [("resize", 2), ("stop", 0)]
    assert coordinator._commands() == []  # taken once
    handle.resize(1)
    assert [c["seq"] for c in coordinator._commands()] == [3]

    adopter = GroupCoordinator.__new__(GroupCoordinator)
    adopter._rt, adopter.group_id = rt, group_id
    adopter._handled = _newest_command(rt.group(group_id))  # as _adopt starts
    assert adopter._handled == 3
    assert adopter._commands() == []  # the dead coordinator's commands are not replayed
    handle.stop()
    assert [c["kind"] for c in adopter._commands()] == ["stop"]
