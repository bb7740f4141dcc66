"""ElasticTrainer made from configuration objects, on a real local cluster: the settings reach the
group (its record, which adopting coordinators and `troupe status` read) and
FailureConfig.max_failures ends fit() at the failure past the limit."""
import glob
import os

import pytest

from troupe_testing import BUILD, import_troupe, local_cluster

troupe = import_troupe()

TEXT = "/usr/share/common-licenses/GPL-3"

pytestmark = pytest.mark.skipif(not glob.glob(os.path.join(BUILD, "actors", "libtroupe_train_actors.a")),
                                reason="built without LibTorch: no trainer actors")


@pytest.fixture
def cluster():
    yield from local_cluster(num_cpus=2)


def test_configs_reach_the_group_and_max_failures_stops_fit(cluster, tmp_path):
    import json

    from troupe.train import CheckpointConfig, ElasticTrainer, FailureConfig, ScalingConfig

    t = ElasticTrainer(model="tinylm", data=TEXT, optimizer={"name": "adamw", "lr": 3e-3}, global_batch_size=8,
                       max_micro_batch=4, context=32, steps_per_call=2, progress=False, seed=7,
                       scaling=ScalingConfig(min_workers=1, max_workers=2, workers=1, zero=1),
                       failure=FailureConfig(max_failures=0, recovery_timeout=25.0, replace_timeout=5.0,
                                             hang_timeout=90.0),
                       checkpoint=CheckpointConfig(dir=str(tmp_path), snapshot_every=1, persist_every=0, keep=2),
                       _fault={"rank": 0, "kill_at_step": 3})
    with t:
        assert (t.min_workers, t.max_workers, len(t.trainers)) == (1, 2, 1)
        assert (t.recovery_timeout, t.replace_timeout, t.hang_timeout, t.max_failures) == (25.0, 5.0, 90.0, 0)
        doc = json.loads(troupe._api.runtime().group(t.group_id)["doc"])
        assert doc["engine"]["zero"] == 1 and doc["engine"]["threads"] == 1
        assert doc["checkpoint"] == {"dir": str(tmp_path), "snapshot_every": 1, "persist_every": 0, "keep": 2}
        assert (doc["min_workers"], doc["max_workers"]) == (1, 2)
        t.fit(2)  # the first chunk: steps 1 and 2
        with pytest.raises(troupe.TroupeError, match="more than FailureConfig.max_failures=0") as e:
            t.fit(2)  # the trainer dies at step 3: no recovery is allowed
        assert isinstance(e.value.__cause__, (troupe.ActorDiedError, troupe.ActorError))
        assert t.recoveries == [] and t.step == 2
        assert any("max_failures=0 reached" in ev["text"] for ev in t.events)


def test_an_engine_setting_the_trainers_do_not_take_is_refused_before_anything_is_placed(cluster):
    # AdamW's eps is not an option of the engine's optimizers: it would be ignored by the
    # trainers, so the group is refused whole, naming it, and nothing is left placed.
    from troupe.exceptions import InvalidArgumentError
    from troupe.train import ElasticTrainer

    rt = troupe._api.runtime()
    with pytest.raises(InvalidArgumentError, match="engine.eps"):
        ElasticTrainer(model="tinylm", data=TEXT, optimizer={"name": "adamw", "lr": 3e-3, "eps": 1e-8},
                       global_batch_size=8, context=32, workers=1, max_workers=1, progress=False)
    with pytest.raises(InvalidArgumentError, match="engine.momentum"):
        ElasticTrainer(model="tinylm", data=TEXT, optimizer={"name": "sgd", "momentum": "high"},
                       global_batch_size=8, context=32, workers=1, max_workers=1, progress=False)
    assert rt.snapshot()["placement_groups"] == [] and troupe.actors() == [] and rt.groups() == []


def test_a_start_that_fails_once_placed_takes_back_what_it_placed(cluster, tmp_path):
    # The newest persisted step is of a model of another shape (context 32, not 64): the trainers
    # refuse to load it after the group is placed, and the start undoes the placement, as the
    # caller gets an error and no group to close().
    from troupe.exceptions import TroupeError
    from troupe.train import ElasticTrainer

    rt = troupe._api.runtime()
    ckpt = str(tmp_path / "ckpt")
    common = dict(model="tinylm", data=TEXT, global_batch_size=8, workers=1, max_workers=1, progress=False,
                  steps_per_call=2)
    with ElasticTrainer(context=32, checkpoint={"dir": ckpt, "snapshot_every": 1, "persist_every": 2}, **common) as t:
        t.fit(2)
    with pytest.raises(TroupeError) as refused:
        ElasticTrainer(context=64, checkpoint={"dir": ckpt, "resume": True}, **common)
    assert "pos_emb" in str(refused.value), refused.value  # the trainers' own refusal, after placement
    assert rt.snapshot()["placement_groups"] == [] and rt.groups() == []
    assert [a["state"] for a in troupe.actors() if a["state"] != "DEAD"] == []
