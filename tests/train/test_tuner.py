"""The resource tuner's decision core (python/troupe/tuner.py) on synthetic metric streams drawn
from a known ground-truth model, with and without noise. Pure: no cluster, no build needed."""
import importlib.util
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[2] / "python" / "troupe" / "tuner.py"
_spec = importlib.util.spec_from_file_location("troupe_tuner_under_test", _PATH)
tuner = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = tuner
_spec.loader.exec_module(tuner)

Observation, ResourceTuner, ThroughputModel = tuner.Observation, tuner.ResourceTuner, tuner.ThroughputModel

# Ground truth: 0.4 s of compute per step for the whole batch, 2 ms per ring hop, 1 GB/s,
# 4 MB of gradients, 10 ms fixed, 50 ms per unit of oversubscription.
TRUTH = {"compute_s": 0.4, "latency_s": 0.002, "s_per_byte": 1e-9, "overhead_s": 0.01, "contention_s": 0.05}
NBYTES = 4e6
BATCH = 64


def truth_split(n, cores, truth=TRUTH, nbytes=NBYTES, threads=None):
    t = threads or tuner.threads_for(n, cores)
    s = max(1.0, n * t / cores)
    ovs = max(0.0, n * t - cores) / cores
    compute = s * truth["compute_s"] / n
    comm = s * (truth["latency_s"] * 2 * (n - 1) + truth["s_per_byte"] * 2 * (n - 1) / n * nbytes) + \
        truth["contention_s"] * ovs
    return compute, comm, s * truth["overhead_s"]


class Cluster:
    """A job on `cores` physical cores with `cpus` logical CPUs; each chunk measures the truth with
    multiplicative log-normal noise on each part of the step."""

    def __init__(self, cores, cpus, truth=TRUTH, noise=0.0, seed=0, split=True, wait_frac=0.0):
        self.cores, self.cpus, self.truth, self.noise, self.split = cores, cpus, truth, noise, split
        self.wait_frac = wait_frac
        self.rng = np.random.default_rng(seed)
        self.chunk = 0

    def jitter(self):
        return float(np.exp(self.rng.normal(0.0, self.noise))) if self.noise else 1.0

    def measure(self, n, threads=None):
        compute, comm, other = truth_split(n, self.cores, self.truth, threads=threads)
        compute, comm, other = compute * self.jitter(), comm * self.jitter(), other * self.jitter()
        step = compute + comm + other
        self.chunk += 1
        return Observation(world_size=n, step_s=step, samples_per_s=BATCH / step,
                           compute_s=compute if self.split else None, comm_s=comm if self.split else None,
                           wait_s=self.wait_frac * step, bytes_allreduced=NBYTES, free_cpus=self.cpus - n,
                           cores=self.cores, step=self.chunk * 10)

    def throughput(self, n):
        return BATCH / sum(truth_split(n, self.cores, self.truth))


def drive(t, cluster, start, chunks):
    """Runs `chunks` chunks, applying each decision; returns the world size of every chunk."""
    n, sizes = start, []
    for _ in range(chunks):
        sizes.append(n)
        n = t.observe(cluster.measure(n)).target
    return sizes


def changes(sizes):
    return sum(1 for a, b in zip(sizes, sizes[1:]) if a != b)


# ---- NNLS ----
def brute_force_nnls(A, b):
    best = (np.linalg.norm(b), np.zeros(A.shape[1]))
    for r in range(1, A.shape[1] + 1):
        for cols in itertools.combinations(range(A.shape[1]), r):
            x = np.zeros(A.shape[1])
            x[list(cols)] = np.linalg.lstsq(A[:, cols], b, rcond=None)[0]
            if (x >= 0).all() and np.linalg.norm(A @ x - b) < best[0] - 1e-12:
                best = (np.linalg.norm(A @ x - b), x)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_nnls_matches_exhaustive_search(seed):
    rng = np.random.default_rng(seed)
    A = rng.normal(size=(9, 5))
    b = rng.normal(size=9)
    x = tuner.nnls(A, b)
    residual, expected = brute_force_nnls(A, b)
    assert (x >= 0).all()
    assert np.linalg.norm(A @ x - b) == pytest.approx(residual, rel=1e-9, abs=1e-12)
    np.testing.assert_allclose(x, expected, atol=1e-8)


def test_nnls_recovers_a_sparse_nonnegative_solution():
    rng = np.random.default_rng(7)
    A = rng.uniform(size=(12, 5))
    x_true = np.array([0.0, 2.0, 0.0, 0.5, 1.0])
    np.testing.assert_allclose(tuner.nnls(A, A @ x_true), x_true, atol=1e-10)


# ---- The throughput model ----
def test_fit_recovers_ground_truth_on_clean_data():
    m = ThroughputModel()
    for cores, sizes in ((4, (1, 2, 3, 4)), (2, (3, 4))):
        for n in sizes:
            compute, comm, other = truth_split(n, cores)
            m.add(n, compute + comm + other, compute, comm, NBYTES, cores, samples=BATCH)
    params = m.fit()
    assert m.lacks_data() == []
    for name, value in TRUTH.items():
        assert params[name] == pytest.approx(value, rel=1e-3), name
    assert m.error()["rel_rms"] < 1e-9
    p = m.predict(3, cores=4)
    assert p["supported"] and p["step_s"] == pytest.approx(sum(truth_split(3, 4)), rel=1e-6)
    assert p["samples_per_s"] == pytest.approx(BATCH / p["step_s"])


def test_fit_on_step_times_only_recovers_the_step_curve():
    # Without the split, bandwidth is collinear with compute and overhead (2(N-1)/N = 2 - 2/N):
    # the parameters differ from the truth but the predicted step times must not.
    truth = dict(TRUTH, s_per_byte=0.0)
    m = ThroughputModel(global_batch=BATCH)
    for n in (1, 2, 3, 4):
        m.add(n, sum(truth_split(n, 4, truth)), bytes_allreduced=NBYTES, cores=4)
    assert set(m.identified()) == {"overhead_s", "compute_s", "latency_s"}
    for n in (1, 2, 3, 4):
        assert m.step_time(n, cores=4) == pytest.approx(sum(truth_split(n, 4, truth)), rel=1e-6)


def test_fit_recovers_parameters_within_tolerance_on_noisy_data():
    rng = np.random.default_rng(3)
    m = ThroughputModel()
    for _ in range(20):
        for cores, sizes in ((4, (1, 2, 3, 4)), (2, (3, 4))):
            for n in sizes:
                compute, comm, other = (v * np.exp(rng.normal(0, 0.03)) for v in truth_split(n, cores))
                m.add(n, compute + comm + other, compute, comm, NBYTES, cores, samples=BATCH)
    params = m.fit()
    for name in ("compute_s", "overhead_s", "contention_s"):
        assert params[name] == pytest.approx(TRUTH[name], rel=0.1), name
    # Latency and bandwidth trade off against each other; their sum at N=4 must hold.
    comm4 = params["latency_s"] * 6 + params["s_per_byte"] * 1.5 * NBYTES
    assert comm4 == pytest.approx(TRUTH["latency_s"] * 6 + TRUTH["s_per_byte"] * 1.5 * NBYTES, rel=0.1)
    assert 0.01 < m.error()["rel_rms"] < 0.1


def test_one_point_is_a_flat_conservative_model_that_says_it_lacks_data():
    m = ThroughputModel(global_batch=BATCH)
    m.add(2, 0.25, cores=4)
    assert m.identified() == ["overhead_s"]
    assert any("compute" in why for why in m.lacks_data())
    assert m.predict(2)["step_s"] == pytest.approx(0.25) and m.predict(2)["supported"]
    for n in (1, 3, 4):
        p = m.predict(n)
        assert not p["supported"] and not p["optimistic"]
        assert p["samples_per_s"] <= BATCH / 0.25 + 1e-9  # never predicts a gain from one point


def test_unobserved_terms_give_an_optimistic_bound():
    # At N=1 nothing is communicated, so the latency is unknown; the prediction for N=2 leaves it
    # out and is a lower bound on the true step time.
    m = ThroughputModel(global_batch=BATCH)
    compute, comm, other = truth_split(1, 4)
    m.add(1, compute + comm + other, compute, comm, NBYTES, cores=4)
    p = m.predict(2)
    assert not p["supported"] and p["optimistic"]
    assert p["step_s"] <= sum(truth_split(2, 4))
    assert m.predict(1)["supported"]


def test_model_needs_no_torch():
    assert "import torch" not in _PATH.read_text()


# ---- The policy ----
def test_grows_when_the_model_predicts_a_gain_and_cpus_are_free():
    cluster = Cluster(cores=4, cpus=4)
    t = ResourceTuner(min_workers=1, max_workers=4)
    sizes = drive(t, cluster, start=1, chunks=12)
    assert sizes[-1] == 4
    moves = [d for d in t._decisions if d.changed]
    assert moves[0].explore and (moves[0].world_size, moves[0].target) == (1, 2)
    assert moves[1].action == "grow" and not moves[1].explore and moves[1].target == 4
    assert cluster.throughput(sizes[-1]) > 1.1 * cluster.throughput(1)
    assert [d.threads for d in moves] == [2, 1]  # 4 cores shared among the target's trainers


def test_does_not_grow_without_free_cpus():
    t = ResourceTuner(min_workers=1, max_workers=4)
    sizes = drive(t, Cluster(cores=4, cpus=1), start=1, chunks=10)
    assert set(sizes) == {1}
    assert not any(d.explore for d in t._decisions)


def test_does_not_explore_past_the_physical_cores():
    # Logical CPUs are free but the 2 cores are busy with 2 trainers: a third cannot add compute.
    t = ResourceTuner(min_workers=1, max_workers=4)
    sizes = drive(t, Cluster(cores=2, cpus=4), start=2, chunks=10)
    assert set(sizes) == {2}


def test_shrinks_when_trainers_outnumber_cores():
    cluster = Cluster(cores=2, cpus=4)
    t = ResourceTuner(min_workers=1, max_workers=4)
    sizes = drive(t, cluster, start=4, chunks=20)
    assert sizes[-10:] == [2] * 10
    assert changes(sizes) <= 2
    shrink = next(d for d in t._decisions if d.changed)
    assert shrink.action == "shrink" and "add" in shrink.reason
    assert cluster.throughput(2) > cluster.throughput(4)


def test_shrinks_when_the_extra_trainer_adds_almost_nothing():
    # Communication eats the second trainer's compute: it adds < 5%, so the tuner gives it back.
    truth = dict(TRUTH, compute_s=0.1, latency_s=0.024, s_per_byte=0.0)
    cluster = Cluster(cores=4, cpus=4, truth=truth)
    assert cluster.throughput(2) < 1.05 * cluster.throughput(1)
    t = ResourceTuner(min_workers=1, max_workers=4)
    sizes = drive(t, cluster, start=2, chunks=10)
    assert sizes[-1] == 1 and changes(sizes) == 1


def test_keeps_n_when_the_gain_is_under_the_threshold():
    truth = dict(TRUTH, compute_s=0.2, latency_s=0.014, s_per_byte=0.0)
    cluster = Cluster(cores=4, cpus=4, truth=truth)
    gain = cluster.throughput(3) / cluster.throughput(2) - 1
    assert 0.0 < gain < 0.10 and cluster.throughput(2) > 1.05 * cluster.throughput(1)
    t = ResourceTuner(min_workers=1, max_workers=3)
    assert set(drive(t, cluster, start=2, chunks=30)) == {2}
    assert "keep 2" in t.last.reason
    # The same stream with a lower threshold grows.
    t = ResourceTuner(min_workers=1, max_workers=3, grow_gain=0.03, shrink_gain=0.01)
    assert drive(t, Cluster(cores=4, cpus=4, truth=truth), start=2, chunks=10)[-1] == 3


@pytest.mark.parametrize("seed", range(6))
def test_never_leaves_min_max(seed):
    rng = np.random.default_rng(seed)
    truth = {k: v * float(np.exp(rng.normal(0, 1.0))) for k, v in TRUTH.items()}
    cores = int(rng.integers(1, 9))
    t = ResourceTuner(min_workers=2, max_workers=3)
    cluster = Cluster(cores=cores, cpus=cores + 4, truth=truth, noise=0.1, seed=seed)
    drive(t, cluster, start=int(rng.integers(2, 4)), chunks=25)
    assert all(2 <= d.target <= 3 for d in t._decisions)
    # A world size outside the bounds (set by hand, or a failure) is moved back inside.
    assert t.observe(cluster.measure(5)).target == 3
    assert t.observe(cluster.measure(1)).target == 2


def test_bounds_win_over_the_model():
    many_cores = Cluster(cores=16, cpus=16)  # would grow far
    t = ResourceTuner(min_workers=1, max_workers=3)
    assert max(drive(t, many_cores, start=1, chunks=15)) == 3
    comm_bound = Cluster(cores=4, cpus=4, truth=dict(TRUTH, compute_s=0.01, latency_s=0.05))  # wants 1
    t = ResourceTuner(min_workers=2, max_workers=4)
    assert min(drive(t, comm_bound, start=3, chunks=15)) == 2


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("start", [2, 3])
def test_never_flaps_on_noise_around_a_flat_optimum(seed, start):
    # 2 and 3 trainers give the same throughput (within 1%); 10% noise on every part of the step.
    truth = dict(TRUTH, compute_s=0.2, latency_s=0.0165, s_per_byte=0.0)
    cluster = Cluster(cores=4, cpus=4, truth=truth, noise=0.10, seed=seed)
    assert abs(cluster.throughput(3) / cluster.throughput(2) - 1) < 0.01
    t = ResourceTuner(min_workers=1, max_workers=4)
    sizes = drive(t, cluster, start=start, chunks=50)
    assert changes(sizes) <= 1, sizes
    assert set(sizes) <= {2, 3}


def test_cooldown_holds_after_a_change():
    t = ResourceTuner(min_workers=1, max_workers=4, cooldown=3)
    cluster = Cluster(cores=2, cpus=4)
    sizes = drive(t, cluster, start=4, chunks=12)
    first = next(i for i, (a, b) in enumerate(zip(sizes, sizes[1:])) if a != b)
    assert first == 2  # two chunks of cool-down, then the change
    assert "cool-down" in t._decisions[0].reason and "cool-down" in t._decisions[1].reason


def test_explores_each_world_size_at_most_once():
    # Step times only (no compute/comm split): the model needs a point per world size.
    t = ResourceTuner(min_workers=1, max_workers=4)
    sizes = drive(t, Cluster(cores=4, cpus=4, split=False, noise=0.05), start=1, chunks=40)
    explored = [d.target for d in t._decisions if d.explore]
    assert explored and len(explored) == len(set(explored))
    assert sizes[-1] == 4


def test_prediction_error_is_recorded_after_a_change():
    cluster = Cluster(cores=2, cpus=4)
    t = ResourceTuner(min_workers=1, max_workers=4)
    drive(t, cluster, start=4, chunks=6)
    shrink = next(d for d in t._decisions if d.changed)
    assert shrink.measured_world_size == 2
    assert shrink.measured_samples_per_s == pytest.approx(cluster.throughput(2))
    assert shrink.predicted_samples_per_s and shrink.predicted_current_samples_per_s
    assert shrink.prediction_error == pytest.approx(
        abs(shrink.predicted_samples_per_s - cluster.throughput(2)) / cluster.throughput(2))
    assert shrink.prediction_error < 0.15
    assert t.prediction_errors() == [(4, 2, shrink.prediction_error)]


def test_decisions_serialise_to_json():
    t = ResourceTuner(min_workers=1, max_workers=4)
    drive(t, Cluster(cores=2, cpus=4, noise=0.05), start=4, chunks=8)
    text = json.dumps(t.decisions, allow_nan=False)
    back = json.loads(text)
    assert back == t.decisions and len(back) == 8
    for key in ("action", "explore", "world_size", "target", "threads", "prefetch", "reason", "inputs", "params",
                "predicted_samples_per_s", "predicted_current_samples_per_s", "prediction_error", "lacks_data",
                "candidates", "model_error"):
        assert key in back[-1]
    assert back[-1]["inputs"]["world_size"] == 2 and set(back[-1]["params"]) == set(TRUTH)


def test_prefetch_deepens_while_trainers_wait_for_data():
    t = ResourceTuner(min_workers=1, max_workers=1, prefetch=2, max_prefetch=8)
    depths = [t.observe(Cluster(cores=1, cpus=1, wait_frac=0.2).measure(1)).prefetch for _ in range(4)]
    assert depths == [4, 8, 8, 8]
    t = ResourceTuner(min_workers=1, max_workers=1, prefetch=2)
    assert t.observe(Cluster(cores=1, cpus=1, wait_frac=0.01).measure(1)).prefetch == 2


def test_observation_from_elastic_trainer_history_rows():
    rows = [{"step": s, "loss": 1.0, "world_size": 2, "compute_s": 0.1, "comm_s": 0.02, "wait_s": 0.001,
             "samples": 16, "step_s": 0.125, "samples_per_s": 128.0} for s in range(11, 21)]
    obs = Observation.from_history(rows, free_cpus=1, cores=2, bytes_allreduced=1e6)
    assert (obs.world_size, obs.step, obs.samples, obs.free_cpus) == (2, 20, 16, 1)
    assert obs.samples_per_s == pytest.approx(128.0) and obs.comm_s == pytest.approx(0.02)
    d = ResourceTuner(min_workers=1, max_workers=2).observe({**rows[0], "free_cpus": 0, "cores": 2})
    assert d.action == "keep" and d.world_size == 2
    with pytest.raises(ValueError, match="world sizes"):
        Observation.from_history(rows + [dict(rows[0], world_size=3)])


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="min_workers"):
        ResourceTuner(min_workers=3, max_workers=2)
    with pytest.raises(ValueError, match="hysteresis"):
        ResourceTuner(min_workers=1, max_workers=2, grow_gain=0.05, shrink_gain=0.1)
    with pytest.raises(ValueError, match="step_s"):
        Observation(world_size=1, step_s=0.0)


def test_does_not_explore_when_even_the_best_case_cannot_pay():
    # 90% of the step is fixed overhead: at N=1 the latency is unknown, but even without it a second
    # trainer would add < 10%, so the tuner does not spend a chunk measuring it.
    truth = dict(TRUTH, compute_s=0.02, overhead_s=0.2)
    t = ResourceTuner(min_workers=1, max_workers=4)
    assert set(drive(t, Cluster(cores=4, cpus=4, truth=truth), start=1, chunks=10)) == {1}
    assert not t.model.predict(2)["supported"] and t.model.predict(2)["optimistic"]


@pytest.mark.parametrize("seed", range(5))
def test_shrinks_on_contention_through_noise(seed):
    cluster = Cluster(cores=2, cpus=4, noise=0.10, seed=seed)
    t = ResourceTuner(min_workers=1, max_workers=4)
    sizes = drive(t, cluster, start=4, chunks=30)
    assert sizes[-10:] == [2] * 10 and changes(sizes) <= 2
    assert sizes == sorted(sizes, reverse=True)  # only ever down: no back and forth


def test_warmup_chunks_are_not_fitted_and_the_outcome_waits_for_them():
    t = ResourceTuner(min_workers=1, max_workers=4, warmup_chunks=1)
    cluster = Cluster(cores=2, cpus=4)
    assert "warm-up" in t.observe(cluster.measure(4)).reason
    assert "cool-down" in t.observe(cluster.measure(4)).reason
    assert t.observe(cluster.measure(4)).target == 2
    assert t.model.points == 2
    slow = cluster.measure(2)
    slow.step_s *= 3  # the first chunk after a resize pays for it
    slow.samples_per_s /= 3
    d = t.observe(slow)
    assert "warm-up" in d.reason and t.model.points == 2
    shrink = next(x for x in t._decisions if x.changed)
    assert shrink.measured_samples_per_s is None
    t.observe(cluster.measure(2))
    assert shrink.measured_samples_per_s == pytest.approx(cluster.throughput(2))


def test_the_outcome_of_a_change_is_measured_even_with_an_unmeasured_keep_before_it():
    # Warm-up keeps at 4 are still unmeasured when a world of 5 (outside [1, 4]) forces a change
    # back to 4: the first measurement after the warm-up at 4 judges that change, not the keep.
    cluster = Cluster(cores=4, cpus=8)
    t = ResourceTuner(min_workers=1, max_workers=4, warmup_chunks=2)
    first = t.observe(cluster.measure(4))
    assert not first.changed
    change = t.observe(cluster.measure(5))
    assert change.changed and change.target == 4
    for _ in range(3):
        t.observe(cluster.measure(4))
    assert change.measured_samples_per_s is not None and change.measured_world_size == 4


@pytest.mark.parametrize("scenario", ["explore up", "explore down", "into bounds"])
def test_every_change_carries_a_prediction_made_before_it(scenario):
    # Explorations go where the model is not supported yet, and a move back into [min, max] can
    # come before anything is fitted: each still carries the samples/s it expects there, and the
    # next measurement there judges it.
    if scenario == "explore up":
        t, cluster = ResourceTuner(min_workers=1, max_workers=4), Cluster(cores=4, cpus=4, split=False)
        drive(t, cluster, start=1, chunks=20)
    elif scenario == "explore down":
        t, cluster = ResourceTuner(min_workers=1, max_workers=4), Cluster(cores=2, cpus=4, split=False)
        drive(t, cluster, start=4, chunks=20)
    else:
        t, cluster = ResourceTuner(min_workers=1, max_workers=4, warmup_chunks=2), Cluster(cores=4, cpus=8)
        t.observe(cluster.measure(5))
        drive(t, cluster, start=4, chunks=4)
    moves = [d for d in t._decisions if d.changed]
    assert moves and (scenario == "into bounds" or any(d.explore for d in moves)), [d.reason for d in moves]
    for d in moves:
        assert d.predicted_samples_per_s and d.predicted_samples_per_s > 0, d.as_dict()
        assert d.prediction_basis in ("model", "partial model", "this chunk")
        assert d.prediction_error is not None and d.measured_world_size == d.target, d.as_dict()
    assert {d.prediction_basis for d in moves} & {"partial model", "this chunk"}
