"""TorchTrainer end to end: the user's own eager PyTorch loop in the elastic group (2 Python
trainers on a real local cluster), its accuracy, kill -9 of a trainer (the survivor keeps its
process, every sample trained once per epoch), and its errors."""
import os
import sys
import time
from pathlib import Path

import pytest

from train_testing import needs_trainers, troupe  # noqa: F401 (troupe: the build's package)

torch = pytest.importorskip("torch")
pytestmark = needs_trainers

# The example's data (scikit-learn's digits, its 80% training split) and eager model.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import cloudpickle  # noqa: E402
import train_torch_loop  # noqa: E402
from train_torch_loop import Digits, EagerNet, digits as example_split  # noqa: E402

cloudpickle.register_pickle_by_value(train_torch_loop)  # the workers do not import examples/

CLASSES, DIM = 10, 64


def digits():
    train_x, train_y, _, _, _ = example_split()
    return train_x, train_y


def train_loop(ctx):
    torch.manual_seed(0)
    model = ctx.prepare(EagerNet())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.7)
    ctx.track(model=model, opt=opt, sched=sched)
    for x, y in ctx.batches():
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        ctx.report(loss=loss.item(), acc=(logits.argmax(1) == y).float().mean().item(), pid=os.getpid())


def _make(data, **options):
    from troupe.train import ScalingConfig, TorchTrainer

    return TorchTrainer(train_loop, data=data, global_batch_size=32,
                        scaling=ScalingConfig(min_workers=1, max_workers=2), steps_per_call=5, progress=False,
                        **options)


@pytest.fixture
def dataset():
    x, y = digits()
    return Digits(x, y)


def test_an_eager_loop_trains_to_accuracy_and_survives_a_kill_9_with_every_sample_once(cluster, dataset):
    from troupe import _typed

    with pytest.raises(Exception):
        torch.jit.script(EagerNet())  # the loop's model is eager-only
    n = len(dataset)
    steps_per_epoch = n // 32
    with _make(dataset, _fault={"rank": 1, "kill_at_step": 20}) as t:  # as it takes step 21
        before = {m["rank"]: m for m in t.members() if m["kind"] == "trainer"}
        assert sorted(before) == [0, 1] and {m["kind"] for m in t.members()} == {"trainer", "dataloader",
                                                                                   "checkpoint"}
        history = t.fit(steps=steps_per_epoch + 20)
        # The survivor trains on alone while rank 1's new process starts, which the group takes
        # back at a chunk boundary once its loop waits at the group's gate.
        deadline = time.monotonic() + 60
        while len([m for m in t.members() if m["kind"] == "trainer"]) < 2 and time.monotonic() < deadline:
            history = t.fit(steps=1)
        after = {m["rank"]: m for m in t.members() if m["kind"] == "trainer"}
        loader = next(iter(t._node_services.values()))[0]
        # One recovery; the survivor (rank 0) kept its process, the killed rank is a new one.
        # It restores the newest step both ranks hold: 20 when the kill meets a chunk boundary,
        # an earlier snapshot when a slow machine split the chunks otherwise.
        assert len(t.recoveries) == 1 and 0 < t.recoveries[0]["step"] <= 20, t.recoveries
        assert sorted(after) == [0, 1], [e["text"] for e in t.events]
        assert after[0]["pid"] == before[0]["pid"]
        assert after[1]["pid"] != before[1]["pid"]
        worlds = [r["world_size"] for r in history]
        # The survivor went on alone (for as long as the new process took to start: maybe no
        # step), and took rank 1 back.
        assert worlds[:t.recoveries[0]["step"]] == [2] * t.recoveries[0]["step"], worlds
        assert any("the group trains on with 1" in e["text"] for e in t.events)
        assert any("back: grew from 1 to 2" in e["text"] for e in t.events)
        assert {r["metrics"]["pid"] for r in history[-3:]} == {before[0]["pid"]}  # rank 0's loop, same process
        assert t.step >= steps_per_epoch + 20 and [r["step"] for r in history] == list(range(1, t.step + 1))
        # Exactly once: each step trained the samples the queue planned, the epoch each once.
        for row in history:
            planned = _typed.get(loader, "Dataloader", "stepSamples", step=row["step"] - 1)["ids"]
            assert row["sample_ids"] == sorted(planned)
        first_epoch = [i for r in history[:steps_per_epoch] for i in r["sample_ids"]]
        assert len(first_epoch) == len(set(first_epoch)) == steps_per_epoch * 32
        # Both ranks hold the same parameters, and the loop learned: training accuracy over the
        # last 10 steps of at least 80% (chance: 10%; scikit-learn's digits after 64 steps).
        hashes = [t._kind.reply("hash", h)["hash"] for h in troupe.get([t._kind.call(x, "hash") for x in t.trainers])]
        assert len(set(hashes)) == 1 and hashes[0] != 0
        acc = sum(r["metrics"]["acc"] for r in history[-10:]) / 10
        assert acc >= 0.8, f"accuracy {acc:.2f} after {t.step} steps"
        assert history[-1]["loss"] < 0.5 * history[0]["loss"]


def _untracked_loop(ctx):
    model = ctx.prepare(torch.nn.Linear(DIM, CLASSES))
    ctx.track(model=model, lr=0.1)


def _failing_loop(ctx):
    model = ctx.prepare(torch.nn.Linear(DIM, CLASSES))
    ctx.track(model=model)
    for x, y in ctx.batches():
        if ctx.rank == 1 and ctx.step == 3:
            raise ValueError("a bug in the user's loop at step 4")
        model(x).sum().backward()
        ctx.report(loss=0.0)


def _mismatched_loop(ctx):
    model = ctx.prepare(torch.nn.Linear(DIM, CLASSES + ctx.rank))  # rank 1's model is not rank 0's
    ctx.track(model=model)
    for x, y in ctx.batches():
        ctx.report(loss=0.0)


@pytest.mark.parametrize("loop, error, text", [
    (_untracked_loop, "TypeError", r"ctx.track\(lr=...\): a builtins.float has no state_dict\(\)"),
    (_failing_loop, "ValueError", "a bug in the user's loop at step 4"),
    (_mismatched_loop, "RuntimeError", r"params\[0\] in this process with sizes \[1\d, 64\] appears not to match"),
])
def test_an_error_in_the_loop_is_raised_in_the_driver_with_its_rank_and_traceback(cluster, dataset, loop, error,
                                                                                   text):
    import re

    from troupe.train import ScalingConfig, TorchTrainer, TrainLoopError

    with TorchTrainer(loop, data=dataset, global_batch_size=32, scaling=ScalingConfig(min_workers=2, max_workers=2),
                      steps_per_call=5, progress=False) as t:
        with pytest.raises(TrainLoopError) as caught:
            t.fit(steps=10)
        assert t.recoveries == []  # a bug in the loop is not a failure of the group
    e = caught.value
    assert "Traceback" in e.remote_traceback and error in e.remote_traceback
    assert re.search(text, str(e)), str(e)
    if loop is _failing_loop:
        assert e.rank == 1 and "rank 1" in str(e) and "_failing_loop" in e.remote_traceback


def _crashing_loop(ctx):
    model = ctx.prepare(torch.nn.Linear(DIM, CLASSES))
    ctx.track(model=model)
    for x, y in ctx.batches():
        if ctx.rank == 1 and ctx.step == 3:
            os._exit(1)  # a crash of the process (a segfault in an extension, say) at the same step every time
        model(x).sum().backward()
        ctx.report(loss=0.0)


def test_a_rank_that_crashes_at_the_same_step_every_time_ends_fit_instead_of_recovering_forever(cluster, dataset):
    from troupe.train import STUCK_FAILURES, ScalingConfig, TorchTrainer

    with TorchTrainer(_crashing_loop, data=dataset, global_batch_size=32, steps_per_call=5, progress=False,
                      scaling=ScalingConfig(min_workers=2, max_workers=2)) as t:
        with pytest.raises(troupe.TroupeError, match=f"step 4 failed {STUCK_FAILURES} times in a row"):
            t.fit(steps=10)
        # The default max_failures=-1 set no limit: every failure but the last was recovered from,
        # the last STUCK_FAILURES - 1 of them back to step 3 (the first, perhaps, from before it).
        steps = [r["step"] for r in t.recoveries]
        assert steps[-(STUCK_FAILURES - 1):] == [3] * (STUCK_FAILURES - 1) and len(steps) <= STUCK_FAILURES, steps
        assert any("not recovered" in e["text"] for e in t.events), t.events


@pytest.mark.parametrize("member", ["Dataloader", "Checkpoint"])
def test_a_kill_9_of_a_dataloader_or_checkpoint_actor_keeps_both_trainer_processes(cluster, dataset, member):
    import signal

    from troupe_testing import eventually

    with _make(dataset) as t:
        t.fit(steps=5)
        pids = {m["rank"]: m["pid"] for m in t.members() if m["kind"] == "trainer"}
        victim = next(m for m in t.members() if m["kind"] == member.lower())
        os.kill(victim["pid"], signal.SIGKILL)
        eventually(lambda: any(a["id"] == victim["actor_id"] and a["restarts"] >= 1 for a in troupe.actors()), 10,
                   f"the {member} to be restarted")
        t.fit(steps=5)
        assert t.step == 10 and [r["step"] for r in t.history] == list(range(1, 11))
        assert {m["rank"]: m["pid"] for m in t.members() if m["kind"] == "trainer"} == pids
        assert len(set(t.parameter_hash())) == 1


def test_shrink_and_grow_keep_every_step_and_the_new_member_takes_the_group_s_state(cluster, dataset):
    with _make(dataset) as t:
        t.fit(steps=5)
        t.resize(1)
        t.fit(steps=5)
        t.resize(2)  # the new member is restored from its node mate's snapshot of step 10
        t.fit(steps=5)
        assert [r["step"] for r in t.history] == list(range(1, 16))
        assert [r["world_size"] for r in t.history] == [2] * 5 + [1] * 5 + [2] * 5
        hashes = t.parameter_hash()
        assert len(hashes) == 2 and hashes[0] == hashes[1]


def test_a_persisted_step_loads_into_plain_torch_objects_and_a_new_trainer_resumes_from_it(cluster, dataset,
                                                                                          tmp_path):
    from troupe import checkpoint as ckpt
    from troupe.torch_trainer import _state_hash

    from troupe_testing import eventually

    directory = str(tmp_path / "ck")
    with _make(dataset, checkpoint={"dir": directory, "persist_every": 5, "snapshot_every": 1}) as t:
        t.fit(steps=10)
        eventually(lambda: 10 in ckpt.steps(directory), 30, "step 10 to be persisted")
        expected = t.parameter_hash()[0]
    # No cluster needed: the tracked objects' state_dicts, for the user's plain objects.
    states, step = ckpt.load_tracked(directory)
    model = EagerNet()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.7)
    model.load_state_dict(states["model"])  # strict: the module's own keys, not DDP's "module."
    opt.load_state_dict(states["opt"])
    sched.load_state_dict(states["sched"])
    assert step == 10 and sched.last_epoch == 10
    assert all(int(s["step"]) == 10 for s in opt.state_dict()["state"].values())
    assert f"{_state_hash({'model': model.state_dict()}):016x}" == expected
    assert sorted(states) == ["__rng__", "model", "opt", "sched"]
    with _make(dataset, checkpoint={"dir": directory, "persist_every": 5, "resume": True}) as again:
        assert again.step == 10
        again.fit(steps=2)
        assert [r["step"] for r in again.history] == [11, 12]


def _noisy_loop(ctx):
    """train_loop with input noise: the RNG state a snapshot holds decides the trained bits. The
    model is made by ctx.prepare (a survivor keeps its module: the restore writes its tensors)."""
    torch.manual_seed(0)
    model = ctx.prepare(EagerNet)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ctx.track(model=model, opt=opt)
    for x, y in ctx.batches():
        loss = torch.nn.functional.cross_entropy(model(x + 0.05 * torch.randn_like(x)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.report(loss=loss.item(), module=id(model.module), pid=os.getpid())


def _worlds(history):
    """[(world size, steps)] of a run's history, one pair per stretch of equal world size."""
    out = []
    for row in history:
        if out and out[-1][0] == row["world_size"]:
            out[-1][1] += 1
        else:
            out.append([row["world_size"], 1])
    return out


def test_a_run_with_a_kill_9_and_a_shrink_ends_bitwise_equal_to_one_that_made_the_same_resizes(cluster, dataset):
    # The killed rank's step is restored from its snapshot (state and RNG), the data rewinds to
    # it, the survivor trains on alone until the killed rank's new process is taken back, and
    # the steps are trained again in the same order of additions: the same bits as a run that
    # resized at the same steps without a failure.
    from troupe.train import ScalingConfig, TorchTrainer

    def make(**fault):
        return TorchTrainer(_noisy_loop, data=dataset, global_batch_size=32, steps_per_call=5, progress=False,
                            scaling=ScalingConfig(min_workers=1, max_workers=2), **fault)

    with make(_fault={"rank": 1, "kill_at_step": 5}) as t:  # as it takes step 6
        t.fit(steps=10)
        t.resize(1)
        t.fit(steps=5)
        assert [r["step"] for r in t.history] == list(range(1, 16))
        worlds = _worlds(t.history)
        # The survivor trained alone from the kill until the new process was back (if it took
        # longer than the recovery), then the group shrank by the resize.
        assert worlds[0][0] == 2 and worlds[0][1] >= 5 and worlds[-1][0] == 1, worlds
        assert [r["step"] for r in t.recoveries] == [5]  # from the snapshot of step 5, not from the seed
        # Rank 0 survived in its process with the module it made on its first entry.
        assert len({(r["metrics"]["pid"], r["metrics"]["module"]) for r in t.history}) == 1
        killed = t.parameter_hash(), [r["loss"] for r in t.history]
    with make() as t:
        for world, steps in worlds:
            t.resize(world)
            t.fit(steps=steps)
        assert _worlds(t.history) == worlds and t.recoveries == []
        clean = t.parameter_hash(), [r["loss"] for r in t.history]
    assert killed == clean


def _make_hanging_loop(flag):
    def loop(ctx):
        import time

        model = ctx.prepare(torch.nn.Linear(64, CLASSES))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ctx.track(model=model, opt=opt)
        for x, y in ctx.batches():
            if ctx.rank == 1 and ctx.step == 3 and not os.path.exists(flag):  # once: not its restarted process
                open(flag, "w").close()
                time.sleep(3600)  # a bug: rank 1 never reaches the step's all-reduce
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ctx.report(loss=loss.item())

    return loop


def test_a_hung_rank_is_reported_naming_the_peer_the_others_wait_on(cluster, dataset, tmp_path):
    import re
    import signal
    import threading

    from troupe.train import FailureConfig, ScalingConfig, TorchTrainer

    from troupe_testing import eventually

    with TorchTrainer(_make_hanging_loop(str(tmp_path / "hung")), data=dataset, global_batch_size=32,
                      scaling=ScalingConfig(min_workers=2, max_workers=2), failure=FailureConfig(hang_timeout=2.0),
                      steps_per_call=5, progress=False) as t:
        result = {}
        runner = threading.Thread(target=lambda: result.update(history=t.fit(steps=8)), daemon=True)
        runner.start()

        def report():
            events = troupe._api.runtime().group(t.group_id)["events"]
            return next((e for e in events if "no progress for" in e), None)

        eventually(report, 60, "the hang to be reported")
        text = report()
        # Rank 0 sits in step 4's all-reduce, and its communicator names the peer that never came.
        assert re.search(r"rank 0 [^;]*waiting on rank 1 \([^)]*\): has not started allreduce #\d+", text), text
        hung = next(m for m in t.members() if m["kind"] == "trainer" and m["rank"] == 1)
        os.kill(hung["pid"], signal.SIGKILL)  # the group recovers and the run completes
        runner.join(timeout=120)
        assert not runner.is_alive() and result["history"][-1]["step"] == 8
        assert len(t.recoveries) == 1


def test_troupe_timeline_shows_each_ranks_steps(cluster, dataset):
    from troupe import timeline

    with _make(dataset, name="torch-traced") as t:
        t.fit(steps=5)
        trace = timeline.collect("torch-traced")
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert trace["otherData"]["world_size"] == 2
    for rank in (0, 1):
        for name in ("data wait", "step", "snapshot"):
            assert {e["args"]["step"] for e in spans if e["pid"] == rank and e["name"] == name} == {1, 2, 3, 4, 5}, \
                (rank, name)
    # A step's span follows its data wait on the rank's clock.
    waits = {(e["pid"], e["args"]["step"]): e for e in spans if e["name"] == "data wait"}
    for e in spans:
        if e["name"] == "step":
            wait = waits[(e["pid"], e["args"]["step"])]
            assert wait["ts"] + wait["dur"] <= e["ts"] + 1000 and e["dur"] > 0


def _accumulating_loop(ctx):
    torch.manual_seed(0)
    model = ctx.prepare(EagerNet, gradient_as_bucket_view=True)  # DDP's options pass through
    assert model.gradient_as_bucket_view
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    ctx.track(model=model, opt=opt, sched=sched)
    for x, y in ctx.batches():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if ctx.sync_gradients:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        ctx.report(loss=loss.item(), rows=len(x))


def test_gradient_accumulation_keeps_the_global_batch_one_rank_trains_the_bits_of_two(cluster, dataset):
    # Global batch 32 in micro-batches of at most 16: one rank trains its share as two
    # micro-batches, the two ranks' shares, and adds the same gradients in the same order as
    # DDP over two ranks does (each weighed by half, then summed): the same bits. The scheduler
    # and optimizer step once per step, and the gradient is clipped once, at the last.
    from troupe.train import ScalingConfig, TorchTrainer

    def run(workers):
        with TorchTrainer(_accumulating_loop, data=dataset, global_batch_size=32, steps_per_call=4,
                          progress=False, max_micro_batch=16,
                          scaling=ScalingConfig(min_workers=workers, max_workers=workers)) as t:
            t.fit(steps=8)
            return (t.parameter_hash()[0], [r["sample_ids"] for r in t.history],
                    [r["metrics"]["rows"] for r in t.history])

    one, two = run(1), run(2)
    assert one[2] == two[2] == [16.0] * 8  # micro-batches of 16 rows on one rank, shares of 16 on two
    assert one[1] == two[1]  # the same samples each step
    assert one[0] == two[0]


def test_max_micro_batch_is_checked():
    from troupe.train import TorchTrainer

    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_micro_batch must be an integer >= 1"):
            TorchTrainer(_accumulating_loop, data=[(torch.zeros(DIM), 0)] * 4, global_batch_size=4,
                         max_micro_batch=bad)


def test_a_kill_in_the_middle_of_a_chunk_keeps_one_row_per_step(cluster, dataset):
    # Rank 1 dies taking step 8, in the chunk of steps 6..10: steps 6 and 7 were done on both
    # ranks (snapshots of each), so the group restores step 7, and their rows come from the
    # survivor, though the chunk's run() replies were lost.
    from troupe import _typed

    with _make(dataset, checkpoint={"snapshot_every": 1}, _fault={"rank": 1, "kill_at_step": 7}) as t:
        history = t.fit(steps=15)
        loader = next(iter(t._node_services.values()))[0]
        assert [r["step"] for r in history] == list(range(1, t.step + 1))
        assert [r["step"] for r in t.recoveries] == [7]
        lost = [r for r in history if r.get("from_failed_chunk")]
        assert [r["step"] for r in lost] == [6, 7]
        assert all(r["loss"] == r["loss"] and r["world_size"] == 2 and "metrics" in r for r in lost), lost
        for row in history:
            planned = _typed.get(loader, "Dataloader", "stepSamples", step=row["step"] - 1)["ids"]
            assert row["sample_ids"] == sorted(planned)


def _make_slow_forward_loop(log):
    def loop(ctx):
        import signal
        import time

        class Layer(torch.nn.Module):
            def __init__(self, i):
                super().__init__()
                self.i, self.weight = i, torch.nn.Parameter(torch.eye(DIM))

            def forward(self, x):
                with open(log, "a") as f:
                    f.write(f"{os.getpid()} {entered} {ctx.step + 1} {self.i}\n")
                if ctx.rank == 1 and ctx.step == 3 and self.i == 5 and not os.path.exists(f"{log}.killed"):
                    open(f"{log}.killed", "w").close()  # once: not in its restarted process
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(0.05)  # stands for the layer's compute: the forward takes a second
                return x @ self.weight

        entered = time.monotonic()
        # A new module on each entry (not a kept one): its layers log this entry's `entered`.
        model = ctx.prepare(torch.nn.Sequential(*[Layer(i) for i in range(20)], torch.nn.Linear(DIM, CLASSES)))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        ctx.track(model=model, opt=opt)
        for x, y in ctx.batches():
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ctx.report(loss=loss.item())

    return loop


def test_a_survivor_stops_its_forward_within_a_layer_of_a_peer_s_death(cluster, dataset, tmp_path):
    # Rank 1 dies in layer 5 of step 4's forward; rank 0 is then in the same forward, a second
    # long. It learns of the death from the kernel (its peer's life lock) and stops at its next
    # layer, instead of computing the forward and backward to fail at the first all-reduce.
    from troupe.train import ScalingConfig, TorchTrainer

    log = tmp_path / "layers"
    with TorchTrainer(_make_slow_forward_loop(str(log)), data=dataset, global_batch_size=32, steps_per_call=5,
                      progress=False, scaling=ScalingConfig(min_workers=1, max_workers=2)) as t:
        survivor = next(m["pid"] for m in t.members() if m["kind"] == "trainer" and m["rank"] == 0)
        t.fit(steps=5)
        assert [r["step"] for r in t.recoveries] == [3] and t.step == 5
    layers = {}
    for line in log.read_text().splitlines():
        pid, entered, step, _ = line.split()
        layers.setdefault((int(pid), entered, int(step)), []).append(line)
    runs = [len(v) for (pid, _, step), v in sorted(layers.items()) if pid == survivor and step == 4]
    assert len(runs) == 2 and runs[0] < 12 and runs[1] == 20, runs  # stopped early, then step 4 again


def test_a_trainer_that_dies_between_chunks_while_the_group_is_configured_is_recovered(cluster, dataset):
    # Between chunks the coordinator sets the members' snapshot interval and threads; rank 1
    # dies in that call. The driver does not see the failure: the next chunk recovers it.
    with _make(dataset, _fault={"rank": 1, "kill_when_threads_set_to": 7}) as t:
        t.fit(steps=5)
        assert t._configure_between_chunks(threads=7) is False
        assert "not applied at step 5" in t.events[-1]["text"]
        t.fit(steps=5)
        assert [r["step"] for r in t.history] == list(range(1, 11))
        assert [r["step"] for r in t.recoveries] == [5]


def test_a_dataset_reaches_a_node_that_does_not_see_the_drivers_files(cluster, dataset):
    # A node on another host without a shared file system does not see the files the driver
    # wrote the Dataset to: the group sends them to it through the cluster. (copy_data makes
    # this node act so: the test bed's hosts share one file system.)
    import shutil
    import signal

    from troupe import _typed

    with _make(dataset, _fault={"copy_data": True}) as t:
        t.fit(steps=5)
        assert any(e["text"].startswith("data: staged ") for e in t.events), [e["text"] for e in t.events]
        # A node whose services are made again after its stager ended gets the files from a new one.
        rt = troupe._api.runtime()
        node, stager = next(iter(t._kind.stagers.items()))
        os.kill(rt.actor_info(stager.actor_id)["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while rt.actor_info(stager.actor_id)["state"] != "DEAD" and time.monotonic() < deadline:
            time.sleep(0.05)
        spec = t._kind.data_for(t, node, 0)
        assert t._kind.stagers[node].actor_id != stager.actor_id
        assert os.path.getsize(spec["features"]) == os.path.getsize(os.path.join(t._workdir, "features.npy"))
        # The driver's copy goes; a dataloader killed now starts again from the node's copy.
        shutil.rmtree(t._workdir)
        loader = next(m for m in t.members() if m["kind"] == "dataloader")
        os.kill(loader["pid"], signal.SIGKILL)
        t.fit(steps=5)
        assert [r["step"] for r in t.history] == list(range(1, t.step + 1)) and t.step >= 10
        handle = next(iter(t._node_services.values()))[0]
        for row in t.history:
            planned = _typed.get(handle, "Dataloader", "stepSamples", step=row["step"] - 1)["ids"]
            assert row["sample_ids"] == sorted(planned)
