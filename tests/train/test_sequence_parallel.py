"""Sequence parallelism in the elastic group end to end: four C++ trainers as a 2 x 2 mesh (two
rings of two for ring attention, data parallel across the rings) on a real cluster. A trainer
killed in either dimension (its ring partner's or the other ring's) is replaced and the run ends
bit for bit where an uninterrupted one does; a resize goes by whole rings."""
import pytest

from train_testing import local_cluster, make, needs_trainers

pytestmark = needs_trainers


@pytest.fixture(scope="module")
def cluster():
    """Four CPUs (two cores really there) for the 2 x 2 mesh, shared by the module's tests."""
    yield from local_cluster(4)


def mesh(**overrides):
    """Four trainers as two rings of two (and never fewer than one ring)."""
    return make(**{"min_workers": 2, "max_workers": 4, "sequence_parallel": 2, **overrides})


def run(steps, **overrides):
    with mesh(**overrides) as t:
        history = t.fit(steps)
        return t, t.parameter_hash(), {row["step"]: row["loss"] for row in history}


@pytest.fixture(scope="module")
def clean(cluster):
    _, hashes, losses = run(6)
    assert len(set(hashes)) == 1, "the ranks of the mesh disagree"
    return hashes[0], losses


@pytest.mark.parametrize("victim", [1, 2], ids=["ring partner", "other ring"])
def test_a_trainer_killed_in_either_dimension_recovers_bitwise_equal(cluster, clean, victim):
    t, hashes, losses = run(6, _fault={"rank": victim, "kill_at_step": 4})
    assert len(t.recoveries) == 1, t.events
    assert set(hashes) == {clean[0]}
    # The failed chunk's steps before the restored one are not reported again.
    assert max(losses) == 6 and all(losses[s] == clean[1][s] for s in losses), (losses, clean[1])


def test_the_mesh_trains_each_row_once_and_resizes_by_whole_rings(cluster):
    with mesh() as t:
        t.fit(2)
        assert all(len(row["sample_ids"]) == 8 for row in t.history), "a ring's rows were counted twice"
        with pytest.raises(ValueError, match="multiple of sequence_parallel"):
            t.resize(3)
        t.resize(2)
        t.fit(2)
        assert [row["world_size"] for row in t.history] == [4, 4, 2, 2]
        assert len(set(t.parameter_hash())) == 1


def test_sequence_parallel_options_are_checked(cluster):
    with pytest.raises(ValueError, match="multiples of it"):
        mesh(min_workers=1)
    with pytest.raises(ValueError, match="multiple of twice it"):
        mesh(context=30)
