"""Goodput: where a run's wall-clock time went, and its effective training time ratio.

Every supervisor keeps a :class:`Ledger` of the run as its host lives it, from the first
worker start of the run on, and publishes it in the coordination store (``goodput/<host>``)
with its other records; ``gemini status`` shows the root's. Each second of wall time goes
to one part:

``useful``
    each step of the run counted once, at the run's median step time (the time between
    two saves less what the saves blocked, over the steps between them). A step run again
    after a restore is not useful again.
``redone``
    the steps run again after a restore (``steps redone x median step``).
``checkpoint``
    what ``save()`` and the waits for its copies blocked the training loop.
``detection``
    from the last step completed before a round ended to the moment this host knew it
    (the in-flight step's work is in it).
``rendezvous``
    from then until the next round's workers started (stopping the old ones, forming the
    round, choosing the step to restore).
``start_up``
    from a round's workers starting to their ``restore()`` (interpreter, imports, process
    group, model): the first round's included.
``restore``
    ``restore()`` itself: loading the chosen step from memory (or a peer, or disk).
``waiting``
    time that no supervisor of this host accounted for: a spare taking a lost host's place,
    a supervisor restarted (the gap since the ledger it took over was last written).
``other``
    the rest: steps slower than the median (the first after a start, a data loader's
    hiccup), evaluation, the end of the run.

ETTR = useful / wall time. The ledger lives in the supervisor: a host whose supervisor
restarts, and a spare that takes over, continue the newest ledger of the run found in
the store, so the figure survives them and is the same, within a step, on every host.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from launcher import memory

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.api import WorkerGroup

    from launcher.events import EventLog

SCHEMA = 1
#: Parts of the time lost, in the order ``gemini status`` shows them.
LOST = ("redone", "checkpoint", "detection", "rendezvous", "start_up", "restore", "waiting",
        "other")
#: Step durations kept for the median (the newest).
SAMPLES = 512
_MEASURED = ("training", "checkpoint", "detection", "rendezvous", "start_up", "restore",
             "waiting")  # "training": the steps' own time, net of checkpoint stalls


class Ledger:
    """The accounting of one run as one host lives it; see the module's docstring.

    Times are wall-clock seconds (``time.time()``), given by the caller: the ledger is
    pure, so that tests can feed it any history. The phases: ``idle`` (no round yet),
    ``starting`` (workers started, not yet restoring), ``restoring``, ``training``,
    ``rendezvous`` (a round ended, the next not yet started), ``done``."""

    def __init__(self) -> None:
        self.t0: float | None = None  # the run's first worker start
        self.mark = 0.0  # every second before it is accounted for
        self.phase = "idle"
        self.seconds = dict.fromkeys(_MEASURED, 0.0)
        self.high_water = 0  # steps done in the run (the newest step + 1)
        self.useful_steps = 0
        self.redone_steps = 0
        self.failures = 0
        self.samples: deque[float] = deque(maxlen=SAMPLES)
        self.resumed = False  # whether it goes on from another supervisor's (resume)
        self._unseen_time = 0.0  # the waiting that resume counted
        self._steps = 0  # steps done in this round, as last seen
        self._stalled = 0.0  # the stall total of this round's worker, as last seen

    # -- what the supervisor sees ----------------------------------------------------------
    def started(self, now: float) -> None:
        """A round's workers started."""
        if self.t0 is None:
            self.t0 = self.mark = now
        else:
            self._account("rendezvous" if self.phase == "rendezvous" else "waiting", now)
        self.phase = "starting"
        self._steps, self._stalled = 0, 0.0

    def ended(self, now: float) -> None:
        """The round ended and this host restarts its workers (a failure here or on a
        peer, or a change of hosts: each counts in ``failures``)."""
        if self.t0 is None or self.phase == "done":
            return
        self._account("detection" if self.phase == "training" else self._open_part(), now)
        self.phase = "rendezvous"
        self.failures += 1

    def finished(self, now: float) -> None:
        """The host's part of the run ended (its workers finished, or it left). A run
        that ends training ends with its last step: the workers' exit is not counted."""
        if self.t0 is not None and self.phase != "done":
            if self.phase != "training":
                self._account(self._open_part(), now)
            self.phase = "done"

    def progress(self, *, steps: int, saved_at: float, stalled: float, restored: int,
                 restore_began: float | None, restore_ended: float | None) -> None:
        """What the round's slowest worker reports: ``steps`` done in the run (the newest
        step it saved or restored, plus one), when its last save returned, the seconds
        its saves blocked it in this round; the steps done as its ``restore()`` returned,
        and when that began and ended (None: not yet, for every worker of the round)."""
        if self.phase == "starting" and restore_began is not None:
            self._account("start_up", restore_began)
            self.phase = "restoring"
        if self.phase == "restoring" and restore_ended is not None:
            self._account("restore", restore_ended)
            self.phase = "training"
            self._steps, self._stalled = restored, 0.0  # a new process: no stall yet
            if self.resumed and restored > self.high_water:
                # Steps the ledger it went on from had not seen: done in the time counted
                # as waiting, which gives their (median) time back to the steps.
                unseen = restored - self.high_water
                self.useful_steps += unseen
                moved = min(self._unseen_time, unseen * self.step_time())
                self.seconds["waiting"] -= moved
                self.seconds["training"] += moved
                self._unseen_time -= moved
            self.high_water = max(self.high_water, restored)  # else: done by an earlier job
        if self.phase == "starting" and steps > 0 and saved_at > 0:  # never calls restore()
            self._account("start_up", saved_at)
            self.phase = "training"
            self._steps, self._stalled = steps, stalled
            self.useful_steps += max(0, steps - self.high_water)
            self.high_water = max(self.high_water, steps)
            return
        if self.phase != "training" or steps <= self._steps:
            return
        done = steps - self._steps
        blocked = max(0.0, stalled - self._stalled)
        elapsed = max(0.0, saved_at - self.mark)
        new = max(0, steps - max(self._steps, self.high_water))
        self.useful_steps += new
        self.redone_steps += done - new
        self.high_water = max(self.high_water, steps)
        self.samples.append(max(0.0, elapsed - blocked) / done)
        self.seconds["checkpoint"] += min(blocked, elapsed)
        self.seconds["training"] += elapsed - min(blocked, elapsed)
        self.mark = max(self.mark, saved_at)
        self._steps, self._stalled = steps, stalled

    def _open_part(self) -> str:
        return {"starting": "start_up", "restoring": "restore", "rendezvous": "rendezvous",
                "training": "training"}.get(self.phase, "waiting")

    def _account(self, part: str, until: float) -> None:
        if until > self.mark:
            self.seconds[part] += until - self.mark
            self.mark = until

    # -- what it shows ---------------------------------------------------------------------
    def step_time(self) -> float:
        """The median step time of the run (seconds; 0 before two saves)."""
        return statistics.median(self.samples) if self.samples else 0.0

    def report(self, now: float) -> dict[str, Any]:
        """ETTR and where the wall time went, as of ``now`` (the open phase's time so far
        in its part; a finished ledger stops at its last step). The parts add up to the
        wall time: the steps' time (``training``) is useful, redone or other, and useful
        plus redone is never more than the time the steps took."""
        lost = dict.fromkeys(LOST, 0.0)
        if self.t0 is None:
            return {"ettr": None, "wall_s": 0.0, "useful_s": 0.0, "lost_s": lost,
                    "step_s": 0.0, "steps": 0, "redone_steps": 0, "failures": 0}
        seconds = dict(self.seconds)
        end = self.mark if self.phase == "done" else max(now, self.mark)
        seconds[self._open_part()] += end - self.mark
        step = self.step_time()
        useful, redone = self.useful_steps * step, self.redone_steps * step
        if useful + redone > seconds["training"]:  # steps faster than the median
            scale = seconds["training"] / (useful + redone)
            useful, redone = useful * scale, redone * scale
        for part in LOST:
            lost[part] = seconds.get(part, 0.0)
        lost["redone"] = redone
        lost["other"] = seconds["training"] - useful - redone
        wall = end - self.t0
        return {"ettr": useful / wall if wall > 0 else None, "wall_s": wall, "useful_s": useful,
                "lost_s": lost, "step_s": step, "steps": self.high_water,
                "redone_steps": self.redone_steps, "failures": self.failures}

    # -- in the store ----------------------------------------------------------------------
    def to_json(self, now: float) -> dict[str, Any]:
        """The ledger as the store keeps it: its state and its :meth:`report`."""
        return {"v": SCHEMA, "as_of": now, "t0": self.t0, "phase": self.phase,
                "seconds": self.seconds, "high_water": self.high_water,
                "useful_steps": self.useful_steps, "redone_steps": self.redone_steps,
                "failures": self.failures, "samples": list(self.samples),
                "report": self.report(now)}

    @classmethod
    def resume(cls, record: Mapping[str, Any], now: float, *, own: bool = True) -> Ledger:
        """A ledger that goes on from ``record`` (another supervisor's, as stored; ``own``:
        of this host, before its supervisor restarted, else a peer's, for a spare): the
        time since it was written is ``waiting`` (nobody here accounted for it), and a
        record written while training counts one failure more: the one that ended its
        writer, or the round that this host joins to replace it. So does this host's own
        record written while its workers started or restored: its supervisor's end
        interrupted them (a peer's was written after it counted the failure that this
        host's round replaces). ValueError if the record is not a ledger of this schema."""
        ledger = cls()
        ledger.resumed = True
        if record.get("v") != SCHEMA:
            raise ValueError("not a goodput ledger of this version")
        t0, as_of = _finite(record.get("t0")), _finite(record.get("as_of"))
        seconds = record.get("seconds")
        if t0 is None or as_of is None or not isinstance(seconds, dict):
            raise ValueError("a goodput ledger without its times")
        ledger.t0 = t0
        for part in _MEASURED:
            ledger.seconds[part] = max(0.0, _finite(seconds.get(part)) or 0.0)
        for name in ("high_water", "useful_steps", "redone_steps", "failures"):
            value = record.get(name)
            setattr(ledger, name, value if isinstance(value, int) and value >= 0 else 0)
        samples = record.get("samples")
        for value in samples if isinstance(samples, list) else []:
            if (sample := _finite(value)) is not None and sample >= 0:
                ledger.samples.append(sample)
        # Accounted up to t0 + its parts (so that they add up whatever the record says);
        # what the writer had not accounted for yet, and the time since, nobody here saw.
        if record.get("phase") == "training" or own and record.get("phase") in (
                "starting", "restoring"):
            ledger.failures += 1  # its writer's end is a failure it missed
        ledger.mark = t0 + sum(ledger.seconds.values())
        ledger._unseen_time = max(0.0, now - ledger.mark)
        ledger._account("waiting", now)
        return ledger


def _finite(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and \
            value == value and abs(value) != float("inf"):
        return float(value)
    return None


def newest(records: Iterable[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The ledger record written last among ``records`` (None if none is one)."""
    best: Mapping[str, Any] | None = None
    for record in records:
        as_of = _finite(record.get("as_of")) if isinstance(record, Mapping) else None
        if as_of is not None and (best is None or as_of > best["as_of"]):
            best = record
    return best


class GoodputService:
    """Supervisor service (see ``elastic_agent.SupervisorService``): keeps this host's
    :class:`Ledger` from the agent's events and its workers' progress words, read at
    every monitor tick (``HealthService.progress``)."""

    def __init__(self, progress: Callable[[], Sequence[tuple[int, ...]]], events: EventLog,
                 stored: Callable[[], Mapping[str, Mapping[str, Any]]] = dict,
                 host: str = "") -> None:
        """``stored`` reads the ledgers of the run in the store, by host: as this host
        (``host``) starts its first round, it goes on from the newest that has not
        finished (its own, from before its supervisor restarted; a running host's, for a
        spare)."""
        self._progress = progress
        self._stored = stored
        self._host = host
        self._lock = threading.Lock()
        self.ledger = Ledger()
        events.add_sink(self._on_event)

    def _on_event(self, event: str, fields: dict[str, Any]) -> None:
        now = time.time()
        with self._lock:
            if event == "start":
                if self.ledger.t0 is None:
                    self._resume(now)
                self.ledger.started(now)
            elif event == "restart":
                self.ledger.ended(now)
            elif event == "exit":
                self.ledger.finished(now)

    def _resume(self, now: float) -> None:
        stored = {host: r for host, r in self._stored().items() if r.get("phase") != "done"}
        found = newest(stored.values())
        if found is not None:
            try:
                self.ledger = Ledger.resume(found, now, own=stored.get(self._host) is found)
            except ValueError:
                pass

    def before_start(self, group: WorkerGroup, store: object) -> None:
        pass

    def after_start(self, group: WorkerGroup) -> None:
        pass

    def after_stop(self, group: WorkerGroup) -> None:
        pass

    def check(self) -> None:
        words = self._progress()
        if not words:
            return
        offset = time.time() - time.monotonic()  # CLOCK_MONOTONIC -> wall clock
        slowest = min(words, key=lambda w: w[memory.STEPS_DONE])

        def wall(field: int, of: Sequence[tuple[int, ...]]) -> float | None:
            stamps = [w[field] for w in of]
            return max(stamps) / 1e9 + offset if all(stamps) else None

        with self._lock:
            self.ledger.progress(steps=slowest[memory.STEPS_DONE],
                                 saved_at=wall(memory.SAVED_AT, [slowest]) or 0.0,
                                 stalled=slowest[memory.STALLED] / 1e9,
                                 restored=min(w[memory.RESTORED] for w in words),
                                 restore_began=wall(memory.RESTORE_BEGAN, words),
                                 restore_ended=wall(memory.RESTORE_ENDED, words))

    def record(self) -> dict[str, Any] | None:
        """The ledger as of now, for the store (None before the host's first round: a
        supervisor about to go on from its predecessor's must not overwrite it)."""
        with self._lock:
            return None if self.ledger.t0 is None else self.ledger.to_json(time.time())

    def close(self) -> None:
        pass


# -- the planner (``gemini plan --mtbf``) ---------------------------------------------------

#: Recovery times measured on this project's benchmarks (benchmarks/RESULTS.md), the
#: planner's defaults: a worker crash, kill -> next step at hundreds of MB per rank; a host
#: loss with a hot spare (the frozen host's longer detection averaged in).
WORKER_RECOVERY = 1.2
HOST_RECOVERY = 2.5


@dataclass(frozen=True)
class Cluster:
    """What the planner is told about a job and its cluster (seconds, bytes)."""

    nodes: int
    job_mtbf: float
    """Mean time between failures of the whole job (a host's MTBF / nodes)."""
    step_time: float
    host_bytes: int
    """One host's checkpoint (its ranks' state)."""
    host_share: float = 0.6
    """The share of failures that take a host away (a lost GPU, a crashed or frozen
    machine); the rest are worker crashes that a restart on the same host cures."""
    network_bytes_per_s: float = 1.25e9
    """What one host can send to a peer while it trains (10 Gb/s)."""
    storage_bytes_per_s: float = 1e9
    """What one host writes to (and reads from) the shared file system."""
    restart_time: float = 60.0
    """Restarting the whole job from storage: rescheduling, start-up, process groups."""
    replace_time: float = 300.0
    """Getting a replacement host when no spare waits."""
    stall: float = 0.001
    """What one in-memory checkpoint blocks the training loop."""
    worker_recovery: float = WORKER_RECOVERY
    host_recovery: float = HOST_RECOVERY


@dataclass(frozen=True)
class Setting:
    """gemini's configuration as the planner weighs it."""

    replicas: int = 2
    replicate_every: int = 0
    """0: as measured at run time (the steps one replication takes)."""
    spares: int = 1


def replication_steps(cluster: Cluster, setting: Setting) -> int:
    """The steps between two replicated steps: as set, or the steps one replication of a
    host's checkpoint to its m - 1 peers takes at the network's rate (at least 1)."""
    if setting.replicate_every:
        return setting.replicate_every
    seconds = cluster.host_bytes * (setting.replicas - 1) / cluster.network_bytes_per_s
    return max(1, math.ceil(seconds / cluster.step_time))


def gemini_waste(cluster: Cluster, setting: Setting) -> dict[str, float]:
    """Expected seconds lost per failure, by kind, and the blocked fraction of each step.

    A worker crash restores the newest step in the host's own memory: its recovery plus
    the step in flight and, on average, half a step more (the newest step may still be
    copying). A host loss restores the newest replicated step: its recovery (a spare's,
    or the wait for a replacement host) plus the step in flight and the replication lag,
    on average the spacing k. Without replicas, a host loss restarts from storage as the
    baseline does."""
    step = cluster.step_time
    worker = cluster.worker_recovery + step
    if setting.replicas < 2:
        host = cluster.restart_time + cluster.host_bytes / cluster.storage_bytes_per_s
    else:
        host = (cluster.host_recovery if setting.spares else cluster.replace_time) + step / 2 \
            + replication_steps(cluster, setting) * step
    share = cluster.host_share
    return {"worker": worker, "host": host, "per_failure": (1 - share) * worker + share * host,
            "checkpoint_fraction": min(1.0, cluster.stall / step)}


def gemini_ettr(cluster: Cluster, setting: Setting) -> float:
    """ETTR with gemini: the steps' unblocked share, less the failures' waste (first
    order: waste per failure / MTBF)."""
    waste = gemini_waste(cluster, setting)
    return max(0.0, (1 - waste["checkpoint_fraction"]) * (1 - waste["per_failure"]
                                                           / cluster.job_mtbf))


def storage_baseline(cluster: Cluster) -> dict[str, float]:
    """Checkpointing to storage at Young's optimal interval sqrt(2 C M) (C: the blocking
    write of a host's checkpoint, M: the job's MTBF), restarting the job from the last
    one after each failure: expected waste fraction C / tau + (tau / 2 + R) / M, where R
    is the restart and the read of the checkpoint (Young 1974, Daly 2006, first order)."""
    write = cluster.host_bytes / cluster.storage_bytes_per_s
    interval = max(cluster.step_time, math.sqrt(2 * write * cluster.job_mtbf))
    restart = cluster.restart_time + write
    per_failure = interval / 2 + restart
    waste = write / interval + per_failure / cluster.job_mtbf
    return {"ettr": max(0.0, 1 - waste), "interval_s": interval, "write_s": write,
            "per_failure": per_failure}


def group_mtbf(cluster: Cluster, setting: Setting, host_mtbf: float) -> float:
    """Mean time until every holder of some host's checkpoint is lost at once: m hosts of
    a group failing within the window that re-replicating a lost host's checkpoint takes
    (its recovery and one transfer): host_mtbf^m / (N ((m - 1) W)^(m - 1))."""
    m = max(1, setting.replicas)
    window = cluster.host_recovery + cluster.host_bytes / cluster.network_bytes_per_s
    return host_mtbf ** m / (cluster.nodes * ((m - 1) * window) ** (m - 1)) if m > 1 \
        else host_mtbf / cluster.nodes


def recommend(cluster: Cluster, host_mtbf: float) -> dict[str, Any]:
    """Among replicas 2-3 and spares 0-1 (replication spaced as measured), the setting
    with the best goodput per host, a spare being a host that does not train (ETTR x
    N / (N + spares)), fewer replicas on a tie; and a persist interval for the losses no
    replica covers (Young's interval against the mean time between losses of a whole
    placement group)."""
    def value(setting: Setting) -> tuple[float, int]:
        share = cluster.nodes / (cluster.nodes + setting.spares)
        return round(gemini_ettr(cluster, setting) * share, 6), -setting.replicas

    best = max((Setting(replicas=m, spares=s) for m in (2, 3) for s in (1, 0)
                if m <= cluster.nodes), key=value, default=Setting(replicas=1))
    write = cluster.host_bytes / cluster.storage_bytes_per_s
    persist = math.sqrt(2 * write * group_mtbf(cluster, best, host_mtbf))
    return {"replicas": best.replicas, "spares": best.spares,
            "replicate_every": replication_steps(cluster, best),
            "persist_every_s": persist, "ettr": gemini_ettr(cluster, best)}
