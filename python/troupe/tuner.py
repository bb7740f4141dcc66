"""The resource tuner's decision core: a throughput model fitted to the job's own step metrics,
and the policy that resizes the group from it (issue 9). Pure Python and numpy: no torch, no
cluster access; the caller feeds one Observation per chunk and applies the Decision.

    tuner = ResourceTuner(min_workers=1, max_workers=4)
    decision = tuner.observe(Observation.from_history(rows, free_cpus=2, cores=2))
    if decision.target != decision.world_size:
        trainer.resize(decision.target)
    json.dumps(tuner.decisions)        # every decision, as plain dicts

The model (ThroughputModel), per step, for N trainers of t intra-op threads sharing `cores` cores
and all-reducing B bytes per rank per step:

    step_s(N) = s * (compute_s / N + latency_s * 2(N-1) + s_per_byte * 2(N-1)/N * B + overhead_s)
                + contention_s * max(0, N*t - cores) / cores
    s = max(1, N*t / cores)

s is time slicing: with more runnable threads than cores every CPU-bound phase runs s times slower
(it has no free parameter). contention_s is what oversubscription costs beyond that (context
switches, a descheduled rank stalling every peer in the ring). All five parameters are >= 0 and
fitted by non-negative least squares to the step time and, when measured, its split: compute_s
(the step's time not blocked on collectives) fits compute_s / N; comm_s (blocked on all-reduces)
fits the latency, bandwidth and contention terms; overhead_s is the rest (optimizer, data wait).
Errors are relative (each observation's rows are divided by its step time).

Not thread-safe: one owner calls observe() (the driver, once per chunk).
"""
import math
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np

__all__ = ["Decision", "Observation", "ResourceTuner", "ThroughputModel", "nnls", "threads_for"]

# Fit order: a parameter joins the fit only if its column is independent of those before it, so
# with few points the model keeps the parameters it can pin down and says which it lacks.
PARAMS = ("overhead_s", "compute_s", "latency_s", "contention_s", "s_per_byte")
# Without these, predictions away from the observed world sizes are guesses (see predict()).
# s_per_byte is not among them: until it is identified, exposed communication is charged to
# latency_s, which grows fastest with N, so growing is judged pessimistically.
_CRITICAL = ("compute_s", "latency_s", "contention_s")
# Minimum ratio of the smallest to the largest singular value of the column-normalised design for
# a parameter to count as identified. Loose on purpose: a column that differs from the others only
# by a few per cent (bytes that drift slightly between chunks) would fit noise, not physics.
_RANK_TOL = 1e-2
# The relative noise assumed while the fit is exact (no residual degrees of freedom).
_NOISE_PRIOR = 0.05
# One-sided 95% quantiles of Student's t by degrees of freedom (beyond 30: the normal's 1.645).
_T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833, 10: 1.812,
        12: 1.782, 15: 1.753, 20: 1.725, 30: 1.697}


def _t95(dof):
    for d in sorted(_T95):
        if dof <= d:
            return _T95[d]
    return 1.645


def threads_for(world_size, cores, max_threads=None):
    """Intra-op threads per trainer: the cores shared evenly among `world_size` trainers, at least 1."""
    t = max(1, int(math.floor(cores / world_size + 1e-9)))
    return min(t, max_threads) if max_threads else t


def nnls(A, b, max_iter=None):
    """min ||A x - b|| subject to x >= 0 (Lawson and Hanson's active-set method). Returns x."""
    A = np.asarray(A, dtype=float)
    b = np.asarray(b, dtype=float)
    m, n = A.shape
    x = np.zeros(n)
    if n == 0 or m == 0:
        return x
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * np.linalg.norm(A, 1) * max(m, n)
    max_iter = max_iter or 3 * n + 10
    w = A.T @ (b - A @ x)
    for _ in range(max_iter):
        free = ~passive
        if not free.any() or w[free].max() <= tol:
            break
        j = np.flatnonzero(free)[np.argmax(w[free])]
        passive[j] = True
        z = np.zeros(n)
        for _ in range(3 * n + 10):
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(A[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                break
            # Step from x towards z until the first passive variable reaches 0; drop it.
            neg = passive & (z <= 0)
            denom = x[neg] - z[neg]
            alpha = np.min(np.where(denom > 0, x[neg] / np.where(denom > 0, denom, 1), 0.0))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
            if not passive.any():
                z = np.zeros(n)
                break
        x = np.maximum(z, 0.0)
        w = A.T @ (b - A @ x)
    return x


@dataclass
class Observation:
    """One chunk's measurements. Times are seconds per step (max over ranks, as in
    ElasticTrainer.history); bytes_allreduced is per rank per step; free_cpus are the cluster's
    CPUs the group could still reserve; cores are the physical cores the trainers share (None:
    assume the reserved CPUs plus free_cpus are real cores)."""

    world_size: int
    step_s: float
    samples_per_s: Optional[float] = None
    compute_s: Optional[float] = None
    comm_s: Optional[float] = None
    wait_s: float = 0.0
    bytes_allreduced: float = 0.0
    free_cpus: float = 0.0
    cores: Optional[float] = None
    threads: Optional[int] = None
    prefetch: Optional[int] = None
    samples: Optional[float] = None
    step: Optional[int] = None

    def __post_init__(self):
        if int(self.world_size) < 1:
            raise ValueError(f"observation world_size {self.world_size}: must be >= 1")
        if not (self.step_s > 0 and math.isfinite(self.step_s)):
            raise ValueError(f"observation step_s {self.step_s}: must be a positive number of seconds")
        self.world_size = int(self.world_size)
        if self.samples is None and self.samples_per_s:
            self.samples = self.samples_per_s * self.step_s
        if self.samples_per_s is None and self.samples:
            self.samples_per_s = self.samples / self.step_s

    @classmethod
    def from_mapping(cls, mapping):
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in mapping.items() if k in known})

    @classmethod
    def from_history(cls, rows, **extra):
        """One observation from a chunk's ElasticTrainer.history rows (one world size); `extra`
        adds what the rows lack (free_cpus, cores, bytes_allreduced, threads, prefetch)."""
        rows = list(rows)
        if not rows:
            raise ValueError("from_history: no rows")
        sizes = {r["world_size"] for r in rows}
        if len(sizes) != 1:
            raise ValueError(f"from_history: rows span world sizes {sorted(sizes)}; pass one chunk")

        def mean(key):
            vals = [r[key] for r in rows if r.get(key) is not None]
            return float(np.mean(vals)) if vals else None

        step_s = mean("step_s")
        samples = mean("samples")
        fields_ = {"world_size": sizes.pop(), "step_s": step_s, "samples": samples,
                   "samples_per_s": samples / step_s if samples else mean("samples_per_s"),
                   "compute_s": mean("compute_s"), "comm_s": mean("comm_s"), "wait_s": mean("wait_s") or 0.0,
                   "step": rows[-1].get("step")}
        if mean("bytes_allreduced") is not None:
            fields_["bytes_allreduced"] = mean("bytes_allreduced")
        fields_.update(extra)
        return cls.from_mapping(fields_)

    def cores_or_default(self, cpus_per_trainer=1.0):
        if self.cores:
            return float(self.cores)
        return self.world_size * cpus_per_trainer + max(0.0, self.free_cpus)


def _features(n, threads, cores, nbytes):
    """The model's columns (in PARAMS order) for one configuration: (step, compute, comm) rows."""
    s = max(1.0, n * threads / cores)
    ovs = max(0.0, n * threads - cores) / cores
    col = {"overhead_s": s, "compute_s": s / n, "latency_s": s * 2 * (n - 1),
           "contention_s": ovs, "s_per_byte": s * 2 * (n - 1) / n * nbytes}
    step = np.array([col[p] for p in PARAMS])
    compute = np.array([col[p] if p == "compute_s" else 0.0 for p in PARAMS])
    comm = np.array([col[p] if p in ("latency_s", "contention_s", "s_per_byte") else 0.0 for p in PARAMS])
    return step, compute, comm


class ThroughputModel:
    """Step time as a function of world size, fitted to observed points (see the module
    docstring for the formula). add() points, then fit() (predict() fits if needed)."""

    PARAMS = PARAMS

    def __init__(self, global_batch=None, max_points=256):
        self.global_batch = global_batch
        self.max_points = max_points
        self._points = []
        self._fitted = False
        self._params = {p: 0.0 for p in PARAMS}
        self._identified = []
        self._dropped = []
        self._zero_columns = set(PARAMS)
        self._error = None
        self._cov = np.zeros((len(PARAMS), len(PARAMS)))
        self._sigma, self._dof = _NOISE_PRIOR, 0

    # ---- Data ----
    def add(self, world_size, step_s, compute_s=None, comm_s=None, bytes_allreduced=0.0, cores=None,
            threads=None, samples=None):
        """One observed point. cores defaults to world_size * threads (no oversubscription);
        threads defaults to threads_for(world_size, cores)."""
        if int(world_size) < 1 or not step_s > 0:
            raise ValueError(f"add: need world_size >= 1 and step_s > 0, got {world_size} and {step_s}")
        n = int(world_size)
        if threads is None:
            threads = threads_for(n, cores) if cores else 1
        cores = float(cores) if cores else float(n * threads)
        self._points.append({"n": n, "step_s": float(step_s), "compute_s": compute_s, "comm_s": comm_s,
                             "bytes": float(bytes_allreduced or 0.0), "cores": cores, "threads": int(threads)})
        del self._points[:-self.max_points]
        if samples:
            self.global_batch = float(samples)
        self._fitted = False

    def add_observation(self, obs, cpus_per_trainer=1.0):
        cores = obs.cores_or_default(cpus_per_trainer)
        threads = obs.threads if obs.threads else threads_for(obs.world_size, cores)
        self.add(obs.world_size, obs.step_s, obs.compute_s, obs.comm_s, obs.bytes_allreduced, cores, threads,
                 obs.samples)

    @property
    def points(self):
        return len(self._points)

    def world_sizes(self):
        return sorted({p["n"] for p in self._points})

    # ---- Fit ----
    def _design(self):
        rows, ys, kinds = [], [], []
        for p in self._points:
            step, compute, comm = _features(p["n"], p["threads"], p["cores"], p["bytes"])
            w = 1.0 / p["step_s"]
            rows.append(step * w)
            ys.append(p["step_s"] * w)
            kinds.append("step")
            if p["compute_s"] is not None:
                rows.append(compute * w)
                ys.append(p["compute_s"] * w)
                kinds.append("compute")
            if p["comm_s"] is not None:
                rows.append(comm * w)
                ys.append(p["comm_s"] * w)
                kinds.append("comm")
        return np.array(rows).reshape(len(rows), len(PARAMS)), np.array(ys), kinds

    def fit(self):
        """Fits the identifiable parameters; returns params()."""
        self._fitted = True
        self._params = {p: 0.0 for p in PARAMS}
        self._identified = []
        self._dropped = []
        self._error = None
        if not self._points:
            self._zero_columns = set(PARAMS)
            return self.params()
        X, y, kinds = self._design()
        norms = np.linalg.norm(X, axis=0)
        self._zero_columns = {p for p, nrm in zip(PARAMS, norms) if nrm == 0}

        def independent(base, j):
            cand = base + [j]
            sv = np.linalg.svd(X[:, cand] / norms[cand], compute_uv=False)
            return len(sv) == len(cand) and sv[-1] > _RANK_TOL * sv[0]

        def solve(cols):
            theta = np.zeros(len(PARAMS))
            if cols:
                theta[cols] = nnls(X[:, cols] / norms[cols], y) / norms[cols]
            return theta

        chosen = []
        for j in range(len(PARAMS)):
            if norms[j] > 0 and independent(chosen, j):
                chosen.append(j)
        theta = solve(chosen)
        # A parameter pushed to its bound (0) may only stand in for a term the fit left out (step
        # times that grow with N make compute_s/N want to be negative when latency is not in the
        # fit yet). If a left-out term becomes independent once the zeros are set aside, it takes
        # their place and the zeros count as not identified.
        dropped = set()
        for _ in range(len(PARAMS)):
            zeros = [j for j in chosen if theta[j] <= 0]
            if not zeros:
                break
            kept = [j for j in chosen if theta[j] > 0]
            added = []
            for j in range(len(PARAMS)):
                if j not in chosen and j not in dropped and norms[j] > 0 and independent(kept + added, j):
                    added.append(j)
            if not added:
                break
            dropped.update(zeros)
            chosen = sorted(kept + added)
            theta = solve(chosen)
        self._identified = [PARAMS[j] for j in chosen]
        self._dropped = [PARAMS[j] for j in sorted(dropped)]
        self._cov = np.zeros((len(PARAMS), len(PARAMS)))
        self._params = {p: float(v) for p, v in zip(PARAMS, theta)}
        # Parameter covariance of the unconstrained least-squares solution (rows are relative, so
        # sigma is the relative noise of one measurement): it bounds predicted gains in gain().
        dof = int(len(y) - len(chosen))
        sse = float(np.sum((X @ theta - y) ** 2))
        self._sigma = math.sqrt(sse / dof) if dof > 0 else _NOISE_PRIOR
        self._dof = dof
        # Parameters at their bound keep their variance: fixing them would hide how much, say,
        # latency and bandwidth can trade for each other.
        if chosen:
            M = X[:, chosen] / norms[chosen]
            cov = self._sigma ** 2 * np.linalg.pinv(M.T @ M) / np.outer(norms[chosen], norms[chosen])
            self._cov[np.ix_(chosen, chosen)] = cov
        step_rows = np.array([k == "step" for k in kinds])
        rel = X[step_rows] @ theta - y[step_rows]  # rows are already divided by the measured step
        self._error = {"rel_rms": float(np.sqrt(np.mean(rel ** 2))), "rel_max": float(np.max(np.abs(rel))),
                       "sigma": self._sigma, "points": len(self._points), "dof": dof}
        return self.params()

    def _ensure_fit(self):
        if not self._fitted:
            self.fit()

    def params(self):
        """The fitted parameters (seconds; s_per_byte in seconds per byte); 0 where not identified."""
        self._ensure_fit()
        return dict(self._params)

    def identified(self):
        self._ensure_fit()
        return list(self._identified)

    def lacks_data(self):
        """Why some parameters are not identified yet (empty when the model is complete)."""
        self._ensure_fit()
        if not self._points:
            return ["no observations"]
        why = {"compute_s": "compute: needs compute_s, or step times at two world sizes",
               "latency_s": "latency: needs a world size > 1 (with comm_s, or step times at three world sizes)",
               "contention_s": "contention: needs runs at more sizes, at least one with more trainer threads "
                               "than cores",
               "s_per_byte": "bandwidth: needs comm_s at two world sizes > 1 and bytes_allreduced "
                             "(charged to latency meanwhile)",
               "overhead_s": "overhead: not separable from the other terms"}
        return [f"{why[p].split(':')[0]}: pushed to 0 by the data and set aside for a term that fits better"
                if p in self._dropped else why[p] for p in PARAMS if p not in self._identified]

    def error(self):
        """Residuals of the fitted step times: relative RMS and max over the points, points, degrees
        of freedom (rows minus fitted parameters; 0 means the fit is exact and says nothing about
        noise). None before any point."""
        self._ensure_fit()
        return dict(self._error) if self._error else None

    # ---- Predictions ----
    def _last(self, key):
        return self._points[-1][key] if self._points else None

    def step_time(self, world_size, threads=None, cores=None, bytes_allreduced=None):
        """Predicted seconds per step; cores and bytes default to the newest point's, threads to
        threads_for(world_size, cores)."""
        self._ensure_fit()
        cores = float(cores or self._last("cores") or world_size)
        threads = threads or threads_for(world_size, cores)
        nbytes = self._last("bytes") if bytes_allreduced is None else bytes_allreduced
        step, _, _ = _features(int(world_size), threads, cores, nbytes or 0.0)
        return float(step @ np.array([self._params[p] for p in PARAMS]))

    def gain(self, world_size, current, threads=None, current_threads=None, cores=None, bytes_allreduced=None):
        """Predicted throughput at `world_size` relative to `current`, minus 1, with a one-sided 95%
        band from the fit's residuals: {"gain", "low", "high"}. The band uses Student's t on the
        residual degrees of freedom (an exact fit assumes 5% noise), so a handful of noisy chunks
        cannot justify a move that many chunks would not."""
        self._ensure_fit()
        if not self._points:
            return None
        cores = float(cores or self._last("cores"))
        nbytes = self._last("bytes") if bytes_allreduced is None else bytes_allreduced
        f_k, _, _ = _features(int(world_size), threads or threads_for(world_size, cores), cores, nbytes or 0.0)
        f_n, _, _ = _features(int(current), current_threads or threads_for(current, cores), cores, nbytes or 0.0)
        theta = np.array([self._params[p] for p in PARAMS])
        s_k, s_n = float(f_k @ theta), float(f_n @ theta)
        if s_k <= 0 or s_n <= 0:
            return None
        log_ratio = math.log(s_n / s_k)
        g = f_n / s_n - f_k / s_k
        se = math.sqrt(max(0.0, float(g @ self._cov @ g)))
        margin = _t95(max(self._dof, 1)) * se
        return {"gain": math.exp(log_ratio) - 1, "low": math.exp(log_ratio - margin) - 1,
                "high": math.exp(log_ratio + margin) - 1}

    def predict(self, world_size, threads=None, cores=None, bytes_allreduced=None):
        """{world_size, step_s, samples_per_s (for the fixed global batch; None if unknown),
        supported, optimistic}. `supported`: world_size was observed, or every parameter that
        matters there is identified. An unsupported prediction is `optimistic` when the missing
        parameters were zero in every observation, so the fit did not absorb them: the predicted
        step time is then a lower bound (throughput an upper bound)."""
        self._ensure_fit()
        n = int(world_size)
        if not self._points:
            return {"world_size": n, "step_s": None, "samples_per_s": None, "supported": False, "optimistic": False}
        cores = float(cores or self._last("cores"))
        threads = threads or threads_for(n, cores)
        step_s = self.step_time(n, threads, cores, bytes_allreduced)
        feats, _, _ = _features(n, threads, cores, self._last("bytes") if bytes_allreduced is None
                                else bytes_allreduced)
        missing = [p for p in _CRITICAL if p not in self._identified and feats[PARAMS.index(p)] > 0]
        supported = n in self.world_sizes() or not missing
        optimistic = not supported and all(p in self._zero_columns for p in missing)
        sps = self.global_batch / step_s if self.global_batch and step_s > 0 else None
        return {"world_size": n, "step_s": step_s, "samples_per_s": sps, "supported": bool(supported),
                "optimistic": bool(optimistic)}


@dataclass
class Decision:
    """What the tuner decided after one chunk. action is keep, grow or shrink (target against
    world_size); explore marks a move made to measure an unknown world size. A change always
    carries predicted_samples_per_s (unless no samples/s was ever measured); prediction_basis says
    what it rests on: "model" (supported), "partial model" (a size the fit does not support yet,
    see ResourceTuner._predict_target) or "this chunk" (nothing fitted yet). The measured_*
    fields and prediction_error (|predicted - measured| / measured, samples/s at the target) are
    filled in by the next observation."""

    index: int
    step: Optional[int]
    action: str
    explore: bool
    world_size: int
    target: int
    threads: int
    prefetch: int
    reason: str
    inputs: dict
    params: dict
    identified: list
    lacks_data: list
    model_error: Optional[dict]
    predicted_samples_per_s: Optional[float]
    predicted_current_samples_per_s: Optional[float]
    prediction_basis: Optional[str] = None
    candidates: dict = field(default_factory=dict)
    measured_samples_per_s: Optional[float] = None
    measured_world_size: Optional[int] = None
    prediction_error: Optional[float] = None

    @property
    def changed(self):
        return self.target != self.world_size

    def as_dict(self):
        return _plain(asdict(self))


def _plain(value):
    """JSON-safe copy: numpy scalars to Python numbers, NaN/inf to None."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else None
    return value


class ResourceTuner:
    """The policy: one observe() per chunk returns a Decision (world size, threads per trainer,
    dataloader prefetch depth, and why). See docs/design/tuner.md.

    Objective: the most predicted samples/s, where trainers cost something. A grow needs the low
    end of the predicted gain's 95% band (ThroughputModel.gain) to reach `grow_gain` (10%) and free
    CPUs for the new trainers; when several sizes qualify, the fewest trainers within `grow_gain`
    of the best one. A shrink happens when even the high end of what the trainers above a smaller
    size add stays under `shrink_gain` (5%; negative under contention); the target is the best
    smaller size (the fewest within `shrink_gain` of it). Between the two thresholds N stays
    (hysteresis). A change needs `cooldown` fitted chunks at the current size; the first
    `warmup_chunks` after a change are recorded but not fitted. Only sizes the model supports
    (observed, or every relevant parameter identified) and the free CPUs allow are candidates.
    When the model decides nothing, a never-measured neighbour (N+1, or N-1 when oversubscribed)
    is explored once if it is in [min, max], fits the free CPUs and (up) the physical cores, and
    the model knows nothing there or predicts a move there it cannot confirm.

    Threads per trainer: threads_for(target, cores). Prefetch: doubled (up to max_prefetch) while
    the data wait exceeds `wait_high` (5%) of the step."""

    def __init__(self, min_workers, max_workers, grow_gain=0.10, shrink_gain=0.05, cooldown=2,
                 cpus_per_trainer=1.0, max_threads=None, prefetch=2, max_prefetch=8, wait_high=0.05,
                 warmup_chunks=0, model=None):
        if not 1 <= min_workers <= max_workers:
            raise ValueError(f"need 1 <= min_workers <= max_workers, got {min_workers} and {max_workers}")
        if not 0 <= shrink_gain <= grow_gain:
            raise ValueError(f"need 0 <= shrink_gain <= grow_gain (hysteresis), got {shrink_gain} and {grow_gain}")
        if cooldown < 1:
            raise ValueError(f"cooldown {cooldown}: must be >= 1 chunk")
        self.min_workers, self.max_workers = int(min_workers), int(max_workers)
        self.grow_gain, self.shrink_gain = float(grow_gain), float(shrink_gain)
        self.cooldown = int(cooldown)
        self.cpus_per_trainer = float(cpus_per_trainer)
        self.max_threads = max_threads
        self.prefetch = int(prefetch)
        self.max_prefetch = int(max_prefetch)
        self.wait_high = float(wait_high)
        self.warmup_chunks = int(warmup_chunks)
        self.model = model or ThroughputModel()
        self.explored = set()
        self._decisions = []
        self._pending = None  # the last decision still waiting for its measurement
        self._current = None  # world size of the previous observation
        self._chunks_here = 0

    @property
    def decisions(self):
        """Every decision so far, oldest first, as plain JSON-serialisable dicts."""
        return [d.as_dict() for d in self._decisions]

    @property
    def last(self):
        return self._decisions[-1] if self._decisions else None

    def prediction_errors(self):
        """(world_size, target, prediction_error) of every change whose outcome was measured."""
        return [(d.world_size, d.target, d.prediction_error) for d in self._decisions
                if d.changed and d.prediction_error is not None]

    # ---- The loop ----
    def observe(self, obs):
        """Takes one chunk's Observation (or a dict of its fields) and returns the Decision."""
        if not isinstance(obs, Observation):
            obs = Observation.from_mapping(obs)
        n = obs.world_size
        if n != self._current:
            self._current = n
            self._chunks_here = 0
        self._chunks_here += 1
        if obs.prefetch:
            self.prefetch = int(obs.prefetch)
        warming = self._chunks_here <= self.warmup_chunks
        if not warming:
            self._record_outcome(obs)
            self.model.add_observation(obs, self.cpus_per_trainer)
        decision = self._decide(obs, warming)
        self._decisions.append(decision)
        # The next measurement judges the newest change; an unmeasured keep before it does not
        # hold its place (it did, and a change's outcome then went unmeasured: a flaky test).
        if decision.changed or self._pending is None or self._pending.measured_samples_per_s is not None:
            self._pending = decision
        return decision

    def _record_outcome(self, obs):
        d = self._pending
        if d is None or d.measured_samples_per_s is not None or obs.samples_per_s is None:
            return
        d.measured_samples_per_s = float(obs.samples_per_s)
        d.measured_world_size = obs.world_size
        if d.predicted_samples_per_s and obs.world_size == d.target and obs.samples_per_s > 0:
            d.prediction_error = abs(d.predicted_samples_per_s - obs.samples_per_s) / obs.samples_per_s
        self._pending = None

    def _decide(self, obs, warming):
        n = obs.world_size
        cores = obs.cores_or_default(self.cpus_per_trainer)
        grow_room = int(math.floor(max(0.0, obs.free_cpus) / self.cpus_per_trainer + 1e-9))
        model = self.model
        preds = {}
        for k in range(self.min_workers, self.max_workers + 1):
            p = model.predict(k, threads_for(k, cores, self.max_threads), cores, obs.bytes_allreduced)
            p["feasible"] = k <= n + grow_room
            preds[k] = p
        current = model.predict(n, obs.threads or threads_for(n, cores, self.max_threads), cores,
                                obs.bytes_allreduced)
        if self.min_workers <= n <= self.max_workers:
            preds[n] = {**current, "feasible": True}
        t_cur = current["samples_per_s"]
        for k, p in preds.items():
            p["gain"] = None if k == n else model.gain(k, n, threads_for(k, cores, self.max_threads),
                                                        obs.threads or threads_for(n, cores, self.max_threads),
                                                        cores, obs.bytes_allreduced)

        target, explore, reason = n, False, None
        if n < self.min_workers or n > self.max_workers:
            target = min(max(n, self.min_workers), self.max_workers)
            reason = f"world size {n} outside [{self.min_workers}, {self.max_workers}]: move to {target}"
        elif warming:
            reason = f"warm-up: chunk {self._chunks_here} of {self.warmup_chunks} at {n} trainer(s) not fitted"
        elif self._chunks_here - self.warmup_chunks < self.cooldown:
            reason = (f"cool-down: {self._chunks_here - self.warmup_chunks} of {self.cooldown} chunk(s) "
                      f"measured at {n} trainer(s)")
        elif t_cur is None:
            reason = "no samples/s measured yet (unknown global batch)"
        else:
            target, reason = self._exploit(n, t_cur, preds)
            if target == n:
                probe = self._explore_candidate(n, t_cur, preds, cores)
                if probe is not None:
                    target, reason = probe
                    explore = True
                    self.explored.add(target)

        action = "keep" if target == n else ("grow" if target > n else "shrink")
        threads = threads_for(target, cores, self.max_threads)
        prefetch_note = self._tune_prefetch(obs)
        if prefetch_note:
            reason += "; " + prefetch_note
        predicted, basis = self._predict_target(obs, target, preds, current, cores)
        return Decision(
            index=len(self._decisions), step=obs.step, action=action, explore=explore, world_size=n, target=target,
            threads=threads, prefetch=self.prefetch, reason=reason,
            inputs=_plain(asdict(obs)), params=model.params(), identified=model.identified(),
            lacks_data=model.lacks_data() if model.points else ["no observations"], model_error=model.error(),
            predicted_samples_per_s=predicted, prediction_basis=basis, predicted_current_samples_per_s=t_cur,
            candidates={str(k): {"samples_per_s": v["samples_per_s"], "supported": v["supported"],
                                 "feasible": v["feasible"], "gain": v["gain"]} for k, v in sorted(preds.items())})

    def _predict_target(self, obs, target, preds, current, cores):
        """(samples/s predicted at the target, basis). Every change carries a prediction, made
        now, before the group moves; a keep carries one only where the model is supported."""
        p = preds.get(target, current)
        if p.get("supported") and p["samples_per_s"]:
            return p["samples_per_s"], "model"
        if target == obs.world_size:
            return None, None
        # An exploration (or a move back into [min, max]) goes where the model is not supported:
        # refusing such sizes would stop the model from ever learning them. Its point estimate
        # still stands (the missing terms charged to those fitted, or an upper bound where they
        # were never observed), and its error is recorded like any other.
        if p["samples_per_s"]:
            return p["samples_per_s"], "partial model"
        # No fitted point yet (a move back into bounds during warm-up): the model of this chunk
        # alone, whose warm-up cost makes it a low estimate.
        alone = ThroughputModel(global_batch=self.model.global_batch)
        alone.add_observation(obs, self.cpus_per_trainer)
        sps = alone.predict(target, threads_for(target, cores, self.max_threads), cores,
                            obs.bytes_allreduced)["samples_per_s"]
        return (sps, "this chunk") if sps else (None, None)

    def _exploit(self, n, t_cur, preds):
        """The model's choice among supported, feasible sizes: (target, reason)."""
        usable = {k: p for k, p in preds.items()
                  if k != n and p["supported"] and p["feasible"] and p["samples_per_s"] and p["gain"]}
        # Grow: even the low end of the predicted gain reaches grow_gain.
        up = {k: p for k, p in usable.items() if k > n and p["gain"]["low"] >= self.grow_gain}
        if up:
            best = max(p["samples_per_s"] for p in up.values())
            k = min(k for k, p in up.items() if p["samples_per_s"] * (1 + self.grow_gain) >= best)
            g = up[k]["gain"]
            return k, (f"grow {n} -> {k}: predicted {up[k]['samples_per_s']:.1f} samples/s vs {t_cur:.1f} at {n} "
                       f"({100 * g['gain']:+.0f}%, at least {100 * g['low']:+.0f}% >= {100 * self.grow_gain:.0f}%), "
                       f"CPUs free")
        # Shrink: even the high end of what the trainers above k add stays under shrink_gain.
        down = {}
        for k, p in usable.items():
            if k < n:
                g = p["gain"]  # of k against n; what the extra trainers add is 1 / (1 + g) - 1
                added, added_high = 1 / (1 + g["gain"]) - 1, 1 / (1 + g["low"]) - 1
                if added_high < self.shrink_gain:
                    down[k] = (p, added, added_high)
        if down:
            best = max(p["samples_per_s"] for p, _, _ in down.values())
            k = min(k for k, (p, _, _) in down.items() if p["samples_per_s"] * (1 + self.shrink_gain) >= best)
            p, added, added_high = down[k]
            return k, (f"shrink {n} -> {k}: the trainers above {k} add {100 * added:+.0f}% (at most "
                       f"{100 * added_high:+.0f}% < {100 * self.shrink_gain:.0f}%); predicted "
                       f"{p['samples_per_s']:.1f} samples/s vs {t_cur:.1f}")
        if usable:
            k = max(usable, key=lambda k: usable[k]["gain"]["gain"])
            g = usable[k]["gain"]
            return n, (f"keep {n}: best alternative {k} predicts {100 * g['gain']:+.0f}% "
                       f"(band {100 * g['low']:+.0f}%..{100 * g['high']:+.0f}%; grow needs at least "
                       f"{100 * self.grow_gain:.0f}%, shrink needs the extra trainers to add under "
                       f"{100 * self.shrink_gain:.0f}%)")
        return n, f"keep {n}: no other world size is both supported by the model and feasible"

    def _explore_candidate(self, n, t_cur, preds, cores):
        """A neighbour worth measuring once: (target, reason), or None. Worth it when the model
        knows nothing there, or its prediction (an upper bound, or a band) says it could win."""
        options = []
        observed = set(self.model.world_sizes())
        for k in (n + 1, n - 1):
            p = preds.get(k)
            if p is None or k in observed or k in self.explored or not p["feasible"]:
                continue
            if k > n and k * threads_for(k, cores, self.max_threads) > cores:
                continue  # more trainers than cores cannot add compute
            g = p["gain"]
            if p["supported"] or p["optimistic"]:
                # Supported: the model predicts a move there but its band is too wide to commit.
                # Unsupported but optimistic: even the best case must predict a move.
                if not g or not (g["gain"] >= self.grow_gain if k > n
                                 else 1 / (1 + g["gain"]) - 1 < self.shrink_gain):
                    continue
                why = ("the model predicts a gain it cannot confirm yet" if p["supported"]
                       else "its best case could pay")
            else:
                why = "; ".join(self.model.lacks_data()) or "no data"
            options.append((k, why))
        if not options:
            return None
        oversubscribed = n * threads_for(n, cores, self.max_threads) > cores
        k, why = min(options) if oversubscribed else max(options)
        return k, f"explore {n} -> {k}: no measurement at {k} trainer(s) and {why}"

    def _tune_prefetch(self, obs):
        frac = (obs.wait_s or 0.0) / obs.step_s
        if frac > self.wait_high and self.prefetch < self.max_prefetch:
            old, self.prefetch = self.prefetch, min(self.max_prefetch, max(1, self.prefetch) * 2)
            return (f"prefetch {old} -> {self.prefetch}: waiting for data {100 * frac:.0f}% of the step "
                    f"(> {100 * self.wait_high:.0f}%)")
        return None
