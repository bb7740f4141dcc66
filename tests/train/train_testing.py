"""What the elastic group's end-to-end tests share: the build's troupe package, a real text to
train on, groups made with small defaults, and the group's record."""
import glob
import os

import pytest

import troupe_testing
from troupe_testing import BUILD, import_troupe

troupe = import_troupe()

TEXT = "/usr/share/common-licenses/GPL-3"

# Every test of a module that uses trainers: skipped in a build without LibTorch.
needs_trainers = pytest.mark.skipif(not glob.glob(os.path.join(BUILD, "actors", "libtroupe_train_actors.a")),
                                    reason="built without LibTorch: no trainer actors")


def make(**overrides):
    """An ElasticTrainer of tinylm on TEXT: global batch 8 in micro-batches of 4, 1-2 trainers,
    3 steps per call, a memory snapshot every step; `overrides` replace any of it."""
    from troupe.train import ElasticTrainer

    options = dict(model="tinylm", data=TEXT, optimizer={"name": "adamw", "lr": 3e-3}, global_batch_size=8,
                   max_micro_batch=4, min_workers=1, max_workers=2, context=32, steps_per_call=3, progress=False,
                   seed=7, checkpoint={"snapshot_every": 1})
    options.update(overrides)
    return ElasticTrainer(**options)


def group_record(trainer):
    return troupe._api.runtime().group(trainer.group_id)


def events(trainer):
    return group_record(trainer)["events"]


def local_cluster(num_cpus):
    """troupe.init with `num_cpus` on this machine; yields the run root; checks nothing is left."""
    yield from troupe_testing.local_cluster(num_cpus=num_cpus)
