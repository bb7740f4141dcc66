"""The troupe package as a library: its version, its type information, the trainer's configuration
objects and how the trainer tells an infeasible placement from other errors. Nothing here starts a
cluster: the configs are checked before the trainer connects, and placement is tried against a
fake runtime that raises what the real one would."""
import json
import math

import pytest

from troupe_testing import BUILD, PYTHON_PACKAGE, import_troupe

troupe = import_troupe()
from troupe import _group, train  # noqa: E402 (after the build's package is on sys.path)
from troupe.exceptions import ResourceExhaustedError, UnavailableError  # noqa: E402
from troupe.train import (CheckpointConfig, ElasticTrainer, FailureConfig, GroupPlacementError,  # noqa: E402
                          ScalingConfig)

TEXT = "/usr/share/common-licenses/GPL-3"


def test_version_is_meson_projects():
    info = json.loads((BUILD / "meson-info" / "intro-projectinfo.json").read_text())
    assert info["version"] and troupe.__version__ == info["version"]


def test_the_built_package_is_typed():
    assert (PYTHON_PACKAGE / "troupe" / "py.typed").is_file()
    assert (PYTHON_PACKAGE / "troupe" / "_version.py").is_file()


def test_configs_are_exported_and_frozen():
    for name in ("ScalingConfig", "FailureConfig", "CheckpointConfig"):
        assert name in train.__all__
    with pytest.raises(AttributeError):
        ScalingConfig().min_workers = 3


@pytest.mark.parametrize("make, field, value", [
    (lambda: ScalingConfig(min_workers=0), "ScalingConfig.min_workers", "0"),
    (lambda: ScalingConfig(max_workers=2.5), "ScalingConfig.max_workers", "2.5"),
    (lambda: ScalingConfig(min_workers=1, max_workers=2, workers=3), "ScalingConfig.workers", "3"),
    (lambda: ScalingConfig(threads_per_worker=True), "ScalingConfig.threads_per_worker", "True"),
    (lambda: ScalingConfig(tuner="yes"), "ScalingConfig.tuner", "'yes'"),
    (lambda: FailureConfig(max_failures=-2), "FailureConfig.max_failures", "-2"),
    (lambda: FailureConfig(hang_timeout=0), "FailureConfig.hang_timeout", "0"),
    (lambda: FailureConfig(recovery_timeout=math.inf), "FailureConfig.recovery_timeout", "inf"),
    (lambda: FailureConfig(replace_timeout="10"), "FailureConfig.replace_timeout", "'10'"),
    (lambda: CheckpointConfig(snapshot_every=0), "CheckpointConfig.snapshot_every", "0"),
    (lambda: CheckpointConfig(persist_every=-1), "CheckpointConfig.persist_every", "-1"),
    (lambda: CheckpointConfig(keep=0), "CheckpointConfig.keep", "0"),
    (lambda: CheckpointConfig(dir=""), "CheckpointConfig.dir", "''"),
])
def test_a_bad_value_names_its_field_and_value(make, field, value):
    with pytest.raises(ValueError) as e:
        make()
    assert field in str(e.value) and value in str(e.value), str(e.value)


def test_settings_that_depend_on_each_other_are_checked_together():
    with pytest.raises(ValueError, match="need 1 <= min_workers <= max_workers, got 3 and 2"):
        ScalingConfig(min_workers=3)
    with pytest.raises(ValueError, match="multiples of it"):
        ScalingConfig(min_workers=1, max_workers=4, sequence_parallel=2)
    with pytest.raises(ValueError, match="zero must be 0"):
        ScalingConfig(zero=3)
    with pytest.raises(ValueError, match="needs the checkpoint's 'dir'"):
        CheckpointConfig(resume=True)


def test_checkpoint_argument_takes_a_config_a_dict_or_a_directory(tmp_path):
    want = CheckpointConfig(dir=str(tmp_path), resume=True, snapshot_every=2)
    assert CheckpointConfig.of(want) is want
    assert CheckpointConfig.of({"dir": str(tmp_path), "resume": True, "snapshot_every": 2}) == want
    assert CheckpointConfig.of(tmp_path) == CheckpointConfig(dir=str(tmp_path))
    assert CheckpointConfig.of(str(tmp_path)) == CheckpointConfig(dir=str(tmp_path))
    assert CheckpointConfig.of(None) == CheckpointConfig()
    with pytest.raises(TypeError, match=r"unknown key\(s\) \['persist_evry'\]"):
        CheckpointConfig.of({"dir": str(tmp_path), "persist_evry": 5})
    with pytest.raises(TypeError, match="checkpoint must be"):
        CheckpointConfig.of(5)


KEYWORDS = dict(min_workers=2, max_workers=4, workers=2, threads_per_worker=2, sequence_parallel=2, zero=1,
                tuner={"warmup_chunks": 2}, recovery_timeout=12.0, replace_timeout=3.0, hang_timeout=40.0)


def test_configs_and_keywords_give_the_same_settings():
    by_keyword = _group._configs(None, None, {"dir": "/tmp/c", "persist_every": 5}, KEYWORDS)
    by_config = _group._configs(
        ScalingConfig(min_workers=2, max_workers=4, workers=2, threads_per_worker=2, sequence_parallel=2, zero=1,
                      tuner={"warmup_chunks": 2}),
        FailureConfig(recovery_timeout=12.0, replace_timeout=3.0, hang_timeout=40.0),
        CheckpointConfig(dir="/tmp/c", persist_every=5), {})
    assert by_keyword == by_config
    # Nothing given: the configs' defaults, which are the keywords' old defaults.
    assert _group._configs(None, None, None, {}) == (ScalingConfig(min_workers=1, max_workers=2, threads_per_worker=1,
                                                                  sequence_parallel=1, zero=0, tuner=False),
                                                    FailureConfig(recovery_timeout=30.0, replace_timeout=10.0,
                                                                  hang_timeout=120.0),
                                                    CheckpointConfig())


def test_a_config_may_be_completed_by_the_keywords_of_the_other_config():
    scaling, failure, _ = _group._configs(ScalingConfig(max_workers=3), None, None, {"hang_timeout": 5.0})
    assert scaling.max_workers == 3 and failure.hang_timeout == 5.0


@pytest.mark.parametrize("config, keyword", [
    ({"scaling": ScalingConfig()}, {"min_workers": 1}),
    ({"scaling": ScalingConfig()}, {"tuner": False}),
    ({"failure": FailureConfig()}, {"hang_timeout": 60.0}),
])
def test_a_setting_given_both_ways_is_a_type_error(config, keyword):
    # Raised before the trainer connects: no cluster is running here.
    with pytest.raises(TypeError, match=f"{list(keyword)[0]}.*both as keyword"):
        ElasticTrainer(data=TEXT, progress=False, **config, **keyword)


def test_a_config_of_the_wrong_class_is_a_type_error():
    with pytest.raises(TypeError, match="scaling must be a ScalingConfig, not FailureConfig"):
        ElasticTrainer(data=TEXT, scaling=FailureConfig())


def test_the_trainer_checks_keywords_before_connecting():
    # No cluster runs in this module: a trainer that connected first would raise TroupeError.
    with pytest.raises(ValueError, match=r"ScalingConfig.min_workers must be an int >= 1, got 0"):
        ElasticTrainer(data=TEXT, min_workers=0)
    with pytest.raises(ValueError, match="FailureConfig.replace_timeout"):
        ElasticTrainer(data=TEXT, replace_timeout=-1.0)
    with pytest.raises(TypeError, match="unknown key"):
        ElasticTrainer(data=TEXT, checkpoint={"snapshot_evry": 1})


class FakeRuntime:
    """Placement groups as troupe._core.Runtime answers them: `errors[n]` is raised for a group of
    n bundles, other groups are CREATED (or PENDING for sizes in `pending`)."""

    def __init__(self, errors=None, pending=()):
        self.errors, self.pending = errors or {}, set(pending)
        self.asked, self.removed = [], []

    def create_placement_group(self, strategy, bundles, name):
        n = len(bundles)
        self.asked.append(n)
        if n in self.errors:
            raise self.errors[n]
        if n in self.pending:
            return {"id": f"pg{n}", "state": "PENDING", "pending_reason": "waiting for CPU"}
        return {"id": f"pg{n}", "state": "CREATED", "bundle_nodes": ["n"] * n}

    def remove_placement_group(self, pg_id):
        self.removed.append(pg_id)


def test_an_infeasible_group_is_placed_smaller():
    rt = FakeRuntime({3: ResourceExhaustedError("infeasible: the request needs CPU 3")}, pending=[2])
    assert _group._reserve_trainers(rt, "g", 3, 1, 1)["id"] == "pg1"
    assert rt.asked == [3, 2, 1] and rt.removed == ["pg2"]


def test_a_group_that_fits_nowhere_says_why():
    rt = FakeRuntime({n: ResourceExhaustedError(f"infeasible {n}") for n in (1, 2)})
    with pytest.raises(GroupPlacementError, match="at least 1 trainer.*2 trainer\\(s\\): infeasible 2"):
        _group._reserve_trainers(rt, "g", 2, 1, 1)


@pytest.mark.parametrize("error", [UnavailableError("the controller is gone"), RuntimeError("a bug"),
                                   ValueError("bad bundle")])
def test_other_errors_of_placement_are_not_read_as_infeasible(error):
    rt = FakeRuntime({2: error})
    with pytest.raises(type(error)) as raised:
        _group._reserve_trainers(rt, "g", 2, 1, 1)
    assert raised.value is error and not isinstance(raised.value, GroupPlacementError)
    assert rt.asked == [2], "a smaller group was tried after an error that is not infeasibility"


def _public_functions(module):
    """(name, function) for every function, and every public method of every class, that
    `module` exports in __all__."""
    import inspect

    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isclass(obj):
            if issubclass(obj, BaseException) and "__init__" not in vars(obj):
                continue
            for attr, fn in vars(obj).items():
                if attr.startswith("_") and attr != "__init__":
                    continue
                fn = fn.__func__ if isinstance(fn, (classmethod, staticmethod)) else fn
                fn = fn.fget if isinstance(fn, property) else fn
                if inspect.isfunction(fn):
                    yield f"{name}.{attr}", fn
        elif inspect.isfunction(obj):
            yield name, obj


@pytest.mark.parametrize("module_name", ["troupe", "troupe.train", "troupe.util", "troupe.job", "troupe.checkpoint",
                                         "troupe.optim", "troupe.exceptions"])
def test_the_public_api_is_annotated_and_its_annotations_resolve(module_name):
    import importlib
    import inspect
    import typing

    torch = pytest.importorskip("torch")  # annotations of troupe.train and troupe.optim name torch types
    if module_name == "troupe.optim" and not list((PYTHON_PACKAGE / "troupe").glob("_optim*.so")):
        pytest.skip("troupe.optim is not built (no LibTorch)")
    module = importlib.import_module(module_name)
    missing = []
    for where, fn in _public_functions(module):
        hints = typing.get_type_hints(fn, localns={"torch": torch})  # raises on a name that does not resolve
        params = [p for p in inspect.signature(fn).parameters.values() if p.name not in ("self", "cls")]
        missing += [f"{where}({p.name})" for p in params if p.name not in hints]
        if "return" not in hints:
            missing.append(f"{where} -> ?")
    assert missing == []


def test_every_error_of_the_package_is_a_troupe_error_keeping_its_python_base():
    from troupe import checkpoint

    for cls, base in [(checkpoint.CheckpointError, RuntimeError), (checkpoint.CheckpointNotFoundError, FileNotFoundError),
                      (checkpoint.CheckpointSpaceError, OSError), (checkpoint.CheckpointCorruptError, RuntimeError)]:
        assert issubclass(cls, troupe.TroupeError) and issubclass(cls, base), cls
    e = checkpoint.CheckpointNotFoundError("NOT_FOUND", "no step")
    assert e.code == "NOT_FOUND" and str(e) == "NOT_FOUND: no step"


def test_group_states_are_an_enum_that_the_json_record_spells_by_name():
    from troupe.train import GroupState

    assert [s.name for s in GroupState] == ["STARTING", "JOINING", "RUNNING", "RECOVERING", "ADOPTING", "HUNG",
                                            "STOPPED", "FAILED", "CLOSED"]
    assert json.loads(json.dumps({"state": GroupState.HUNG})) == {"state": "HUNG"}
    assert GroupState("RUNNING") is GroupState.RUNNING
    with pytest.raises(ValueError):
        GroupState("RUNNNING")
