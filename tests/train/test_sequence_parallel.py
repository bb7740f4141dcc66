"""Sequence parallelism in the elastic group end to end: four C++ trainers as a 2 x 2 mesh (two
rings of two for ring attention, data parallel across the rings) on a real cluster. A trainer
killed in either dimension (its ring partner's or the other ring's) is replaced and the run ends
bit for bit where an uninterrupted one does; a resize goes by whole rings."""
import glob
import os

import pytest

from troupe_testing import BUILD, import_troupe, processes_under

troupe = import_troupe()

pytestmark = pytest.mark.skipif(not glob.glob(os.path.join(BUILD, "actors", "libtroupe_train_actors.a")),
                                reason="built without LibTorch: no trainer actors")

TEXT = "/usr/share/common-licenses/GPL-3"


@pytest.fixture(scope="module")
def cluster():
    troupe.init(num_cpus=4, log_to_driver=False)
    root = troupe._api._session.run_root
    yield root
    troupe.shutdown()
    assert processes_under(root) == [], "shutdown() left processes behind"


def make(**overrides):
    from troupe.train import ElasticTrainer

    options = dict(model="tinylm", data=TEXT, optimizer={"name": "adamw", "lr": 3e-3}, global_batch_size=8,
                   max_micro_batch=4, min_workers=2, max_workers=4, context=32, steps_per_call=3, progress=False,
                   seed=7, checkpoint={"snapshot_every": 1}, sequence_parallel=2)
    options.update(overrides)
    return ElasticTrainer(**options)


def run(steps, **overrides):
    with make(**overrides) as t:
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
    with make() as t:
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
        make(min_workers=1)
    with pytest.raises(ValueError, match="multiple of twice it"):
        make(context=30)
