"""The exhaustive search for the throughput-optimal thresholds B* (docs/throughput-model.md, "The
optimum"): its results, the memo of solved chains, and batched, optionally parallel solving, in
child processes (`ChildProcess`, this module's `__main__`; the router's background re-solve runs
in one too).
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
import os
from pathlib import Path
import pickle
import queue
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterable, Sequence

from .dtmc import DEFAULT_MAX_STATES, DTMCResult, feasible_thresholds, solve_many
from .inputs import SystemSpec, check_concurrency
from .learned import TuningCancelled
from .statespace import BudgetExceeded

# -------------------- the memo of solved chains --------------------
# Memo of solved chains, keyed by the rounded inputs.
#
# Key: (N, P rounded to P_DECIMALS, C, quanta table d[i, b], delta, contention
# rounded to KAPPA_DECIMALS, B).  The solve itself uses the same rounded P and
# contention (`rounded_spec`), so a key always determines its value.

P_DECIMALS = 6  # P is rounded to this many decimals for the cache and the solve
KAPPA_DECIMALS = 4  # contention shares likewise (measured to a few %, so nothing is lost)


class SolveCache:
    """Thread-safe LRU of DTMCResult keyed by (N, rounded P, C, quanta, delta, B)."""

    def __init__(self, maxsize: int = 8192) -> None:
        self.maxsize = maxsize
        self._data: OrderedDict[tuple, DTMCResult] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def model_key(spec: SystemSpec, N: int) -> tuple:
        d = spec.quanta_table(N)
        return (
            N,
            tuple(tuple(round(p, P_DECIMALS) for p in row) for row in spec.P),
            tuple(tuple(round(c, 9) for c in row) for row in spec.C),
            tuple(tuple(int(x) for x in row[1:]) for row in d),
            spec.delta,
            None if spec.contention is None else spec.contention.rounded(KAPPA_DECIMALS).points,
        )

    def get(self, key: tuple) -> DTMCResult | None:
        with self._lock:
            r = self._data.get(key)
            if r is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return r

    def put(self, key: tuple, value: DTMCResult) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)


def rounded_spec(spec: SystemSpec) -> SystemSpec:
    """The spec actually solved: P rounded (then renormalised) and contention rounded like the
    cache key."""
    P = []
    for row in spec.P:
        r = [round(p, P_DECIMALS) for p in row]
        s = sum(r)
        P.append([x / s for x in r])
    con = None if spec.contention is None else spec.contention.rounded(KAPPA_DECIMALS)
    return SystemSpec.build(P, spec.C, spec.latency, spec.delta, con)


# -------------------- results and the feasible set --------------------
# Result types of the threshold search (the feasible set it covers: dtmc.feasible_thresholds).


@dataclass(frozen=True)
class SearchResult:
    """B* for one N, with the predicted throughput of every feasible candidate."""

    N: int
    best: tuple[int, ...]
    best_throughput: float
    candidates: tuple[DTMCResult, ...]  # one per feasible B, in feasible_thresholds order
    seconds: float

    def throughput_of(self, B: Sequence[int]) -> float:
        key = tuple(B)
        for r in self.candidates:
            if r.B == key:
                return r.throughput
        raise KeyError(f"B = {key} is not a feasible candidate for N = {self.N}")

    @property
    def result(self) -> DTMCResult:
        return next(r for r in self.candidates if r.B == self.best)


@dataclass(frozen=True)
class ThresholdTable:
    """SearchResult for every N in a range (the router's start-up table)."""

    rows: tuple[SearchResult, ...]
    seconds: float

    def __getitem__(self, N: int) -> SearchResult:
        for r in self.rows:
            if r.N == N:
                return r
        raise KeyError(f"no row for N = {N}")

    def best(self, N: int) -> tuple[int, ...]:
        return self[N].best

    @property
    def concurrencies(self) -> tuple[int, ...]:
        return tuple(r.N for r in self.rows)


# -------------------- batched solving --------------------
# Batched, cached, optionally parallel solving of many (N, B) chains.
#
# Chains of one N are enumerated and solved together in batches of similar
# predicted size (predicted from the same B at N - 1), so the per-level numpy
# overhead of small chains is shared; a batch that outgrows its state budget is
# split in halves.  Solved results go to a SolveCache.

BATCH_STATES = 300_000  # target total states per BFS batch
UNKNOWN_SIZE = 2_000  # size guess for a B never solved at a smaller N
PARALLEL_MIN_STATES = 1_000_000  # below this much work a process pool costs more than it saves


def solve_batch(args: tuple) -> list[DTMCResult]:
    """Solve one batch; split it in halves while it is over its state budget."""
    spec, N, Bs, max_states, budget = args
    try:
        return solve_many(spec, N, Bs, max_states=max_states, budget=budget)
    except BudgetExceeded:
        h = len(Bs) // 2
        return solve_batch((spec, N, Bs[:h], max_states, budget)) + solve_batch(
            (spec, N, Bs[h:], max_states, budget)
        )


def _make_batches(
    Bs: list[tuple[int, ...]], guess: dict[tuple[int, ...], float], target: int
) -> list[tuple[list[tuple[int, ...]], int]]:
    """Greedy packing of similar-size chains into batches of ~target states."""
    order = sorted(Bs, key=lambda b: guess.get(b, UNKNOWN_SIZE))
    batches: list[tuple[list[tuple[int, ...]], int]] = []
    cur: list[tuple[int, ...]] = []
    tot = 0.0
    for b in order:
        g = guess.get(b, UNKNOWN_SIZE)
        if cur and tot + g > target:
            batches.append((cur, int(tot)))
            cur, tot = [], 0.0
        cur.append(b)
        tot += g
    if cur:
        batches.append((cur, int(tot)))
    return batches


class Searcher:
    """Solves many (N, B) with batching, caching and size prediction."""

    def __init__(self, spec: SystemSpec, max_states: int, cache: SolveCache | None,
                 workers: int | None, progress: bool) -> None:
        self.spec = spec
        self.solve_spec = rounded_spec(spec)
        self.max_states = max_states
        # No process-wide memo: a caller that solves again keeps its own (the Tuner does).
        self.cache = SolveCache() if cache is None else cache
        self.workers = default_workers() if workers is None else max(1, int(workers))
        self.progress = progress
        self.sizes: dict[int, dict[tuple[int, ...], int]] = {}

    def _guess(self, N: int, Bs: Iterable[tuple[int, ...]]) -> dict[tuple[int, ...], float]:
        """Predicted states of each B at N, from N - 1 (and N - 2 for the growth)."""
        prev, prev2 = self.sizes.get(N - 1, {}), self.sizes.get(N - 2, {})
        common = [b for b in prev if b in prev2]
        # The ratio of totals, not the largest ratio: one chain that grew from
        # 2 states to 300 would otherwise inflate every guess 150-fold and cut
        # the batches so small that per-level overhead dominated.
        growth = (sum(prev[b] for b in common) / max(1, sum(prev2[b] for b in common))
                  if common else 3.0)
        out = {}
        for b in Bs:
            # A B new at this N: its neighbour with one threshold lower.
            near = [prev[b]] if b in prev else [
                prev[c] for j in range(len(b)) if b[j] > 1
                for c in [b[:j] + (b[j] - 1,) + b[j + 1:]] if c in prev]
            if near:
                out[b] = max(near) * growth
        return out

    def run(self, Ns: Sequence[int]) -> list[SearchResult]:
        M = self.spec.M
        out: list[SearchResult] = []
        bar = None
        if self.progress:
            from tqdm import tqdm

            total = sum(len(feasible_thresholds(M, N)) for N in Ns)
            bar = tqdm(total=total, desc="DTMC threshold search", unit="B", leave=False)
        pool: ThreadPoolExecutor | None = None  # its threads each drive one child process
        children: queue.SimpleQueue[ChildProcess] = queue.SimpleQueue()
        started: list[ChildProcess] = []
        ok = False
        try:
            for N in Ns:
                t0 = time.perf_counter()
                cands = feasible_thresholds(M, N)
                mkey = SolveCache.model_key(self.spec, N)
                got: dict[tuple[int, ...], DTMCResult] = {}
                for b in cands:
                    r = self.cache.get(mkey + (b,))
                    if r is not None:
                        got[b] = r
                todo = [b for b in cands if b not in got]
                if bar is not None:
                    bar.update(len(cands) - len(todo))
                guess = self._guess(N, todo)
                work = sum(guess.get(b, UNKNOWN_SIZE) for b in todo)
                parallel = self.workers > 1 and work >= PARALLEL_MIN_STATES
                # Enough batches to keep every worker busy, none too large.
                target = BATCH_STATES if not parallel else int(
                    max(BATCH_STATES // 10, min(BATCH_STATES, work / (2 * self.workers))))
                batches = _make_batches(todo, guess, target)
                batches.sort(key=lambda bg: -bg[1])  # largest first (LPT scheduling)
                args = [
                    (self.solve_spec, N, bs, self.max_states, max(3 * g, target))
                    for bs, g in batches
                ]
                if parallel and pool is None:
                    pool = ThreadPoolExecutor(self.workers, thread_name_prefix="aiorouter-search")
                    started = [ChildProcess() for _ in range(self.workers)]
                    for c in started:
                        children.put(c)
                if parallel and len(args) > 1:
                    futures = [pool.submit(_in_child, children, solve_batch, a) for a in args]
                    results_iter = (f.result() for f in as_completed(futures))
                else:
                    results_iter = map(solve_batch, args)
                for res in results_iter:
                    for r in res:
                        got[r.B] = r
                        self.cache.put(mkey + (r.B,), r)
                    if bar is not None:
                        bar.update(len(res))
                self.sizes[N] = {b: r.num_states for b, r in got.items()}
                ordered = tuple(got[b] for b in cands)
                best = max(ordered, key=lambda r: r.throughput)
                out.append(SearchResult(N, best.B, best.throughput, ordered,
                                        time.perf_counter() - t0))
            ok = True
        finally:
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
                for c in started:  # idle once every batch answered; mid-solve after an error
                    if ok:
                        c.close()
                    else:
                        c.kill()
            if bar is not None:
                bar.close()
        return out


def default_workers() -> int:
    """Worker processes used for workers=None: the CPUs, at most 4."""
    return max(1, min(4, os.cpu_count() or 1))


# -------------------- search --------------------
# Full search for the throughput-optimal thresholds B* (docs/throughput-model.md, "The optimum").
#
# Every feasible B (sum_i (B_i - 1) < N, 1 <= B_i <= N) is solved exactly; no
# heuristic can miss the optimum.  Work is shared three ways:
#
# * chains of one N are enumerated and solved in batches (one BFS, one
#   block-diagonal solve), grouped by size predicted from the previous N;
# * results are memoised in an LRU keyed by the rounded inputs;
# * batches can be spread over worker processes.


def best_thresholds(
    spec: SystemSpec,
    N: int,
    *,
    max_states: int = DEFAULT_MAX_STATES,
    cache: SolveCache | None = None,
    workers: int | None = 1,
    progress: bool = False,
) -> SearchResult:
    """B* = argmax_B T(B) over all feasible B for concurrency N (exhaustive)."""
    N = check_concurrency(N)
    return Searcher(spec, max_states, cache, workers, progress).run([N])[0]


def threshold_table(
    spec: SystemSpec,
    max_concurrency: int,
    *,
    min_concurrency: int = 1,
    max_states: int = DEFAULT_MAX_STATES,
    cache: SolveCache | None = None,
    workers: int | None = 1,
    progress: bool = False,
) -> ThresholdTable:
    """B* and every candidate's throughput for N = min..max concurrency."""
    hi = check_concurrency(max_concurrency)
    lo = check_concurrency(min_concurrency)
    if lo > hi:
        raise ValueError(f"min_concurrency {lo} > max_concurrency {hi}")
    t0 = time.perf_counter()
    # Ascending N: each N's chain sizes predict the next N's, for batching.
    rows = Searcher(spec, max_states, cache, workers, progress).run(list(range(lo, hi + 1)))
    return ThresholdTable(tuple(rows), time.perf_counter() - t0)


def solve_grid(
    spec: SystemSpec,
    N: int,
    Bs: Sequence[Sequence[int]],
    *,
    max_states: int = DEFAULT_MAX_STATES,
) -> list[DTMCResult]:
    """Solve an arbitrary list of B for one N (batched, memory-bounded), in order."""
    N = check_concurrency(N)
    grid = [tuple(int(x) for x in b) for b in Bs]
    out: dict[tuple[int, ...], DTMCResult] = {}
    unique = list(dict.fromkeys(grid))
    for i in range(0, len(unique), 16):
        chunk = unique[i:i + 16]
        for r in solve_batch((spec, N, chunk, max_states, BATCH_STATES)):
            out[r.B] = r
    return [out[b] for b in grid]


# -------------------- child processes --------------------
# Work in another process: the search's batches when it runs in parallel, and the router's
# re-solves while serving (service.BackgroundSolver: one child at the lowest CPU priority, so
# that the models keep their cores and the GIL).
#
# A child is a fresh interpreter that runs `child_main` and imports
# only `aiorouter.tuning` (0.6 s). A multiprocessing "spawn" child also re-imports the parent's
# main script and, with it, torch and the router (2.5 s more of CPU, and the whole script for one
# without a main guard); a "fork" child of a server inherits whatever lock another thread held.
# Requests (fn, args) and answers are pickled through its stdin and stdout, one after another,
# until its stdin closes. `kill` ends it at once, mid-solve or idle, and nothing of it outlives
# its owner.

NICE = 19  # the lowest niceness, for platforms without SCHED_IDLE (and set under it too)


class ChildCancelled(TuningCancelled):
    """The child was killed (`ChildProcess.kill`: its owner closed) before it answered."""


def lowest_priority() -> str:
    """Put this process at the lowest CPU priority the platform offers -> which one it got. Under
    SCHED_IDLE (Linux) a model's thread that wakes takes its core back at once, where at nice 19
    the scheduler still gives the child a slice."""
    got = "normal"
    try:
        os.nice(NICE)
        got = "nice 19"
    except (AttributeError, OSError):
        pass
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        got = "SCHED_IDLE"
    except (AttributeError, OSError):
        pass
    return got


class ChildProcess:
    """`run(fn, *args)` in a child interpreter (started on first use), blocking the calling thread
    until it answers. `fn` and `args` must be picklable (a module-level function and plain data);
    what `fn` raises is raised here. `idle`: the child runs at the lowest CPU priority."""

    def __init__(self, idle: bool = False) -> None:
        self.idle = idle
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._killed = False

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._lock:
            if self._killed:
                raise ChildCancelled("the child process was killed")
            if self._proc is None:
                self._proc = subprocess.Popen(
                    [sys.executable, "-c", _CHILD_MAIN] + (["--idle"] if self.idle else []),
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            proc = self._proc
        try:
            pickle.dump((fn, args), proc.stdin)
            proc.stdin.flush()
            ok, value = pickle.load(proc.stdout)
        except Exception:
            if self._killed:
                raise ChildCancelled("the child process was killed before it answered") from None
            raise RuntimeError(f"a child process of the search died (exit code {proc.poll()})") from None
        if not ok:
            raise value
        return value

    @property
    def exit_code(self) -> int | None:
        """The child's exit status once it has ended (negative: the signal that killed it)."""
        with self._lock:
            proc = self._proc
        return None if proc is None else proc.poll()

    def close(self, timeout: float = 5.0) -> None:
        """End an idle child the way it expects (its stdin closes, `child_main` returns); one that
        has not exited within `timeout` seconds is killed."""
        with self._lock:
            proc = self._proc
        if proc is None:
            return
        try:
            proc.stdin.close()
            proc.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):  # (a broken pipe: it is gone already)
            pass
        self.kill()

    def kill(self) -> None:
        """End the child now, solving or not, and refuse later runs."""
        with self._lock:
            self._killed = True
            proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc is not None:
            proc.stdin.close()
            proc.stdout.close()


def _in_child(children: "queue.SimpleQueue[ChildProcess]", fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) in whichever child is free (a thread of the search's pool waits for its answer)."""
    child = children.get()
    try:
        return child.run(fn, *args)
    finally:
        children.put(child)


# The child runs the code its parent runs: this aiorouter's folder goes first on its path (else a
# second checkout, or a package the parent found through its own sys.path alone, or an `aiorouter`
# folder in the working directory would be imported instead).
_CHILD_MAIN = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r}); "
               "from aiorouter.tuning.search import child_main; child_main()")


def child_main() -> None:
    """A child process: reads pickled (fn, args) on stdin, writes the pickled (True, fn(*args)) or
    (False, the exception) on stdout for each, until stdin closes."""
    if "--idle" in sys.argv[1:]:
        lowest_priority()
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout = sys.stderr  # anything the solve prints must not mix with the answers
    while True:
        try:
            fn, args = pickle.load(sys.stdin.buffer)
        except EOFError:
            break
        try:
            answer = (True, fn(*args))
        except BaseException as e:  # everything goes back to the parent, which raises it there
            answer = (False, e)
        try:
            data = pickle.dumps(answer)
        except Exception as e:  # (an unpicklable answer or exception)
            data = pickle.dumps((False, RuntimeError(f"a child process's answer could not be pickled: {e!r}")))
        out.write(data)
        out.flush()
