"""`troupe job`: driver scripts run on the cluster by a supervisor; a training job outlives the
driver that submitted it and the death of its own driver, and other drivers watch and stop it."""
import glob
import json
import os
import signal
import textwrap

import pytest

from troupe_testing import BUILD, eventually, free_port, import_troupe

TEXT = "/usr/share/common-licenses/GPL-3"


def start_head(troupe, cpus):
    port = free_port()
    troupe.run("start", "--head", "--port", str(port), "--num-cpus", str(cpus))
    return json.loads((troupe.run_dir() / "cluster.json").read_text())


def job_state(troupe, name):
    return troupe.run("job", "status", name).stdout


def attach_when_made(api, trainer, name):
    """trainer.attach(name) once the job's driver has made its group."""
    def attached():
        try:
            return trainer.attach(name)
        except api.TroupeError:
            return None
    eventually(attached, 60, "the job to create its group")
    return attached()


# What a detached training job's script does after it made its group `t`: train until another
# driver stops it, saying where it started (0, or the step of the group it adopted).
DETACHED_FIT = """
print("start step", t.step, flush=True)
t.fit(until=1_000_000)  # until another driver stops it
print("stopped at", t.step, flush=True)
t.close()
"""


def stop_and_read_the_starts(troupe, job, name, group):
    """Stops the group from this driver, waits for job `name` to succeed; its log, and the steps
    each run of its script started from."""
    group.stop()
    group.wait(timeout=60)  # the script closes its group after fit returns
    eventually(lambda: job.status(name)["state"] == "SUCCEEDED", 30, "the job to end")
    out = troupe.run("job", "logs", name).stdout
    return out, [int(line.split()[-1]) for line in out.splitlines() if line.startswith("start step")]


def kill_the_driver_and_see_it_adopted(job, name, group):
    """kill -9 the job's driver (the coordinator) mid-training: the supervisor starts it again and
    the new driver adopts the running group and goes on from where it was."""
    os.kill(job.status(name)["pid"], signal.SIGKILL)
    eventually(lambda: job.status(name)["restarts"] == 1, 30, "the supervisor to restart the driver")
    eventually(lambda: any("adopted by a new coordinator" in e for e in group.progress()["events"]), 60,
               "the new driver to adopt the group")
    step = group.progress()["step"]
    group.wait(step=step + 4, timeout=60)
    assert group.progress()["world_size"] == 2


def test_a_submitted_job_runs_on_the_cluster_and_keeps_its_output(troupe, tmp_path):
    start_head(troupe, 2)
    script = tmp_path / "hello.py"
    script.write_text(textwrap.dedent("""
        import sys, troupe
        troupe.init()  # TROUPE_ADDRESS: the cluster that runs the job
        @troupe.remote(num_cpus=1)
        class A:
            def f(self): return 6 * 7
        print("answer", troupe.get(A.remote().f.remote()))
        print("args", sys.argv[1:])
    """))
    p = troupe.run("job", "submit", str(script), "--name", "hello", "--", "a", "b")
    assert "job hello submitted" in p.stdout
    eventually(lambda: "SUCCEEDED" in job_state(troupe, "hello"), 60, "the job to succeed")
    out = troupe.run("job", "logs", "hello").stdout
    assert "answer 42" in out and "args ['a', 'b']" in out, out
    assert "hello" in troupe.run("job", "list").stdout

    again = troupe.run("job", "submit", str(script), "--name", "hello", check=False)
    assert again.returncode != 0 and "exists already" in again.stderr
    missing = troupe.run("job", "status", "nope", check=False)
    assert missing.returncode != 0 and "no job named 'nope'" in missing.stderr

    failing = tmp_path / "fail.py"
    failing.write_text("raise SystemExit('bad input file')\n")
    troupe.run("job", "submit", str(failing), "--name", "fails")
    eventually(lambda: "FAILED" in job_state(troupe, "fails"), 60, "the job to fail")
    assert "exit code 1" in job_state(troupe, "fails") and "bad input file" in job_state(troupe, "fails")


@pytest.mark.skipif(not glob.glob(os.path.join(BUILD, "actors", "libtroupe_train_actors.a")),
                    reason="built without LibTorch: no trainer actors")
def test_a_training_job_survives_its_driver_and_is_watched_and_stopped_from_another(troupe, tmp_path):
    cluster = start_head(troupe, 2)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import troupe
        from troupe.train import ElasticTrainer
        troupe.init()
        t = ElasticTrainer(model="tinylm", data={TEXT!r}, optimizer="adamw", global_batch_size=8, context=32,
                           min_workers=1, max_workers=2, steps_per_call=2, progress=False, seed=3,
                           checkpoint={{"snapshot_every": 1}}, name="run1", detached=True)
    """) + DETACHED_FIT)
    # The submitting command returns at once: nothing of the job depends on it.
    troupe.run("job", "submit", str(script), "--name", "trainjob", "--max-restarts", "1")
    api = import_troupe()
    from troupe import job
    from troupe.train import ElasticTrainer

    api.init(cluster["controller_address"], token=cluster["token"])
    try:
        group = attach_when_made(api, ElasticTrainer, "run1")
        group.wait(step=4, timeout=60)

        kill_the_driver_and_see_it_adopted(job, "trainjob", group)
        assert group.progress()["coordinator_alive"]

        group.resize(1)  # carried out by the coordinator at its next chunk
        eventually(lambda: group.progress()["world_size"] == 1, 60, "the group to shrink to one trainer")
        step = group.progress()["step"]
        group.wait(step=step + 2, timeout=60)

        out, starts = stop_and_read_the_starts(troupe, job, "trainjob", group)
        assert starts[0] == 0 and len(starts) == 2 and starts[1] > 0, out  # the second adopted, not restarted
        assert "stopped at" in out and "incarnation 1" in out, out
    finally:
        api.shutdown()


def test_your_own_torch_loop_as_a_detached_job_is_adopted_by_its_restarted_driver(troupe, tmp_path):
    """TorchTrainer(name=..., detached=True) in a job: a kill -9 of the driver leaves the trainers
    training nothing (they wait for a chunk), the supervisor restarts the script, whose
    TorchTrainer adopts the group (the trainers keep their processes) and goes on; another
    driver watches and stops it as it does an ElasticTrainer's."""
    pytest.importorskip("torch")
    cluster = start_head(troupe, 2)
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent("""
        import torch, troupe
        from troupe.train import ScalingConfig, TorchTrainer

        def train_loop(ctx):
            torch.manual_seed(0)
            model = ctx.prepare(torch.nn.Linear(8, 2))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            ctx.track(model=model, opt=opt)
            for x, y in ctx.batches():
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                ctx.report(loss=loss.item())

        g = torch.Generator().manual_seed(0)
        xs, ys = torch.randn(256, 8, generator=g), torch.randint(0, 2, (256,), generator=g)
        data = [(xs[i], int(ys[i])) for i in range(256)]
        troupe.init()
        t = TorchTrainer(train_loop, data=data, global_batch_size=16, scaling=ScalingConfig(min_workers=1, max_workers=2),
                         steps_per_call=2, progress=False, name="loop1", detached=True)
    """) + DETACHED_FIT)
    troupe.run("job", "submit", str(script), "--name", "loopjob", "--max-restarts", "1")
    api = import_troupe()
    from troupe import job
    from troupe.train import ElasticTrainer, TorchTrainer

    api.init(cluster["controller_address"], token=cluster["token"])
    try:
        group = attach_when_made(api, TorchTrainer, "loop1")
        group.wait(step=4, timeout=60)
        trainers = {a["id"]: a["pid"] for a in api.actors()
                    if a["type"] == "py:_TorchTrainerActor" and a["state"] == "ALIVE"}
        assert len(trainers) == 2, api.actors()
        with pytest.raises(api.TroupeError, match="TorchTrainer"):  # not an ElasticTrainer's to adopt
            ElasticTrainer(model="tinylm", data=TEXT, name="loop1", detached=True, progress=False)

        kill_the_driver_and_see_it_adopted(job, "loopjob", group)
        now = {a["id"]: a["pid"] for a in api.actors()
               if a["type"] == "py:_TorchTrainerActor" and a["state"] == "ALIVE"}
        assert now == trainers  # the same processes train on

        out, starts = stop_and_read_the_starts(troupe, job, "loopjob", group)
        assert starts[0] == 0 and len(starts) == 2 and starts[1] > 0, out  # the second adopted, not restarted
        assert "stopped at" in out, out
    finally:
        api.shutdown()


def test_a_flooding_job_keeps_its_output_within_the_cap_and_stop_removes_it(troupe, tmp_path):
    """Issue 34 finding 7: a job's driver.log had no cap and stayed in /tmp/troupe-job-* after
    `troupe stop`. A driver that floods its output for 3 s keeps at most 2 x TROUPE_LOG_MAX_BYTES
    (driver.log and driver.log.1) in its job directory under the run directory, `troupe job logs`
    shows its last line, and `troupe stop` removes the directory."""
    mb = 1 << 20
    troupe.env["TROUPE_LOG_MAX_BYTES"] = str(mb)
    start_head(troupe, 1)
    script = tmp_path / "flood.py"
    script.write_text(textwrap.dedent("""
        import os, time
        line = (b"z" * 1023 + b"\\n") * 64
        end, n = time.monotonic() + 3, 0
        while time.monotonic() < end:
            n += os.write(1, line)
        print("flooded", n, flush=True)
    """))
    jobs = troupe.run_dir() / "jobs"
    troupe.run("job", "submit", str(script), "--name", "flood")
    largest = 0
    while "RUNNING" in job_state(troupe, "flood"):
        for f in jobs.glob("troupe-job-flood-*/driver.log*"):
            try:
                largest = max(largest, sum(g.stat().st_size for g in f.parent.glob("driver.log*")))
            except FileNotFoundError:
                pass  # renamed while we looked
    eventually(lambda: "SUCCEEDED" in job_state(troupe, "flood"), 60, "the job to succeed")
    logs = list(jobs.glob("troupe-job-flood-*/driver.log*"))
    kept = sum(f.stat().st_size for f in logs)
    flooded = int(troupe.run("job", "logs", "flood").stdout.rsplit("flooded", 1)[1].split()[0])
    print("flooded", flooded, "largest", largest, "kept", kept)
    assert flooded > 10 * mb, flooded  # before: every byte stayed in driver.log
    assert {f.name for f in logs} == {"driver.log", "driver.log.1"}
    assert largest <= 2 * mb and kept <= 2 * mb, (largest, kept)
    assert not glob.glob(f"/tmp/troupe-job-flood-*")
    troupe.run("stop")
    assert not jobs.exists()
