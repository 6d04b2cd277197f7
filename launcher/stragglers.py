"""Stragglers: a host that is slow rather than dead, found from each rank's own work.

In a synchronous job every rank takes the same time per step: the fast ones wait for the
slowest in the gradient all-reduce. What differs is the time a rank spends on its own
work before it waits. :class:`PaceClock` (in the worker, started by the ``Checkpointer``)
measures it without a change to the training script and without a synchronisation: from
the start of one optimizer step to the moment the next backward pass accumulated the
rank's last gradient (a ``post_accumulate_grad`` hook on each parameter). That span holds
the optimizer's update, the checkpoint save, data loading, forward and backward; the wait
for the other ranks comes after it (DDP waits for its all-reduces once every gradient is
done; a hand-written loop all-reduces after ``backward()``). On CUDA the span is timed
with CUDA events on the current stream, read one step later when they completed (the
host's clock would time kernel launches, not kernels). Under FSDP a parameter's gradient
is its reduce-scattered shard, so the wait is inside the span and the signal is lost:
FSDP jobs are not judged.

Each host's supervisor (:class:`StragglerService`) reads its ranks' totals from the
heartbeat segment at every monitor tick, keeps the mean own work per step of its slowest
rank over the last ``window`` seconds, and publishes it (``pace/<host>`` in the store).
The root compares the hosts (:func:`judge`): a host whose own work is at least
``threshold`` times the median host's, in every evaluation for a whole window and with
enough steps in each, is a straggler; it stops being one once it is under the threshold
again for a window. One slow step, a data loader's hiccup or a checkpoint persist moves a
window's mean a little and for less than a window; an evaluation has no optimizer steps
(no sample); a data loader slow on every rank moves the median with it. The verdict is
written to the store (``stragglers``) with an event when a host becomes or stops being a
straggler; with ``--replace-stragglers`` and a ready spare, the named host leaves the job
(exit code 6, as an unhealthy host) and the spare takes its node slot as after a host
loss.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from launcher import memory
from launcher.errors import HostUnhealthyError

if TYPE_CHECKING:
    import torch
    from torch.distributed.elastic.agent.server.api import WorkerGroup

    from launcher.events import EventLog

logger = logging.getLogger(__name__)

#: Steps a host's window must hold to be judged.
MIN_STEPS = 5
#: Optimizer steps in a row without the learned last gradient before every parameter is
#: hooked again (see :class:`PaceClock`).
RELEARN = 10


class PaceClock:
    """A rank's own work per optimizer step, added to two words of its heartbeat line
    (``memory.OWN_NS``, ``memory.OWN_STEPS``). :meth:`watch` the parameters, call
    :meth:`step` at every optimizer step (its pre-step hook).

    The first timed step learns which parameter's gradient comes last; from then on only
    that parameter keeps a hook (one call per step, whatever the model's size). When it
    gets no gradient for :data:`RELEARN` steps in a row (frozen, or no longer last),
    every parameter is hooked again to learn anew."""

    def __init__(self, view: memoryview) -> None:
        self._view: memoryview | None = view
        self._params: dict[int, torch.Tensor] = {}  # every parameter watched, by id
        self._handles: dict[int, Any] = {}  # the hooks in place, by parameter id
        self._boundary = 0  # perf_counter_ns of the last optimizer step's start
        self._last_grad = 0  # ... of the last gradient accumulated since
        self._cuda = False
        self._last_param: int | None = None  # the parameter whose gradient comes last
        self._last_seen: int | None = None  # ... in the step under way, while learning
        self._missed = 0  # steps in a row without the learned parameter's gradient
        self._events: deque[tuple[Any, Any]] = deque()  # (boundary, last gradient) on CUDA
        self._boundary_event: Any = None
        self._grad_event: Any = None
        self._own = self._steps = 0

    def watch(self, params: Iterable[torch.Tensor]) -> None:
        """Time the gradients of ``params`` (the ones not watched yet)."""
        new = [p for p in params if p.requires_grad and id(p) not in self._params]
        for param in new:
            self._params[id(param)] = param
            self._cuda = self._cuda or param.is_cuda
        if new:
            self._learn_again()

    def _learn_again(self) -> None:
        self._last_param = None
        for key, param in self._params.items():
            if key not in self._handles:
                self._handles[key] = param.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    self._grad)

    def _grad(self, param: torch.Tensor) -> None:
        self._last_grad = time.perf_counter_ns()
        self._last_seen = id(param)
        if self._cuda and id(param) == self._last_param:  # the step's last, on the stream
            self._grad_event = _record()

    def step(self) -> None:
        """An optimizer step starts: the span since the last one ends at its last gradient."""
        if self._view is None:
            return
        now = time.perf_counter_ns()
        graded = bool(self._boundary) and self._last_grad > self._boundary
        if self._last_param is None:
            if graded:  # learned: from now on only its hook stays
                self._last_param = self._last_seen
                for key in [k for k in self._handles if k != self._last_param]:
                    self._handles.pop(key).remove()
        elif not graded and self._boundary:
            self._missed += 1
            if self._missed >= RELEARN:
                self._missed = 0
                self._learn_again()
        elif self._cuda:
            self._missed = 0
            self._read_cuda()
        else:
            self._missed = 0
            self._add(self._last_grad - self._boundary)
        if self._cuda and self._last_param is not None:
            self._boundary_event, self._grad_event = _record(), None
        self._boundary = now

    def _read_cuda(self) -> None:
        if self._boundary_event is not None and self._grad_event is not None:
            self._events.append((self._boundary_event, self._grad_event))
        while self._events and self._events[0][1].query():  # completed: read them
            began, ended = self._events.popleft()
            self._add(int(began.elapsed_time(ended) * 1e6))
        while len(self._events) > 4:  # never completed (a device reset?): forget them
            self._events.popleft()

    def _add(self, nanoseconds: int) -> None:
        self._own += max(0, nanoseconds)
        self._steps += 1
        if self._view is not None:
            self._view[memory.OWN_NS] = self._own
            self._view[memory.OWN_STEPS] = self._steps

    def close(self) -> None:
        """Stop: remove the hooks, write nothing more."""
        self._view = None
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
        self._params.clear()
        self._events.clear()


def _record() -> Any:
    import torch

    event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    event.record()
    return event


# -- judging ----------------------------------------------------------------------------------

@dataclass
class Judgement:
    """The root's view: each host's score (own work / the median host's), the stragglers,
    and since when each host has been above (or, a straggler, below) the threshold."""

    scores: dict[str, float] = field(default_factory=dict)
    stragglers: set[str] = field(default_factory=set)
    since: dict[str, float] = field(default_factory=dict)


def judge(paces: Mapping[str, tuple[float, int]], previous: Judgement, now: float, *,
          threshold: float, window: float) -> Judgement:
    """The next judgement from each host's (mean own work per step, steps) over the last
    window: a host is a straggler once its score has stayed at or above ``threshold`` for
    ``window`` seconds, and no longer once it has stayed below it for as long. Hosts with
    fewer than :data:`MIN_STEPS` steps in their window are not judged (an evaluation, a
    restart), nor is anyone while fewer than two hosts are."""
    judged = {host: own for host, (own, steps) in paces.items() if steps >= MIN_STEPS and own > 0}
    if len(judged) < 2:
        return Judgement(stragglers=previous.stragglers & set(paces), since={})
    median = statistics.median(judged.values())
    scores = {host: own / median for host, own in judged.items()}
    stragglers, since = set(previous.stragglers & set(paces)), {}
    for host, score in scores.items():
        flipping = (score >= threshold) != (host in stragglers)
        if not flipping:
            continue
        since[host] = previous.since.get(host, now)
        if now - since[host] >= window:
            stragglers ^= {host}
            del since[host]
    return Judgement(scores=scores, stragglers=stragglers, since=since)


class StragglerService:
    """Supervisor service (see ``elastic_agent.SupervisorService``): this host's pace
    from its workers' words, and, while root, the judgement of every host's."""

    def __init__(self, progress: Callable[[], Sequence[tuple[int, ...]]], events: EventLog,
                 host_id: str, *, threshold: float, window: float, replace: bool) -> None:
        self._progress = progress
        self._events = events
        self.host_id = host_id
        self.threshold, self.window, self.replace = threshold, window, replace
        self._samples: deque[tuple[float, int, int]] = deque()  # (time, own ns, steps)
        self._lock = threading.Lock()
        self.judgement = Judgement()
        self.leave: str | None = None
        """Why this host leaves the job: the root named it a straggler to replace."""

    # -- this host's pace -------------------------------------------------------------------
    def before_start(self, group: WorkerGroup, store: object) -> None:
        with self._lock:
            self._samples.clear()  # the counters start again with the new workers

    def after_start(self, group: WorkerGroup) -> None:
        pass

    def after_stop(self, group: WorkerGroup) -> None:
        pass

    def check(self) -> None:
        if self.leave is not None:
            raise HostUnhealthyError(self.leave)
        words = self._progress()
        if not words:
            return
        now = time.monotonic()
        # the slowest rank's totals: the one with the most own work per step
        own, steps = max(((w[memory.OWN_NS], w[memory.OWN_STEPS]) for w in words),
                         key=lambda t: t[0] / t[1] if t[1] else 0.0)
        with self._lock:
            self._samples.append((now, own, steps))
            while self._samples and self._samples[0][0] < now - self.window:
                self._samples.popleft()

    def pace(self) -> dict[str, Any] | None:
        """This host's mean own work per step over the window, for the store (None before
        two samples)."""
        with self._lock:
            if len(self._samples) < 2:
                return None
            (_, own0, steps0), (_, own1, steps1) = self._samples[0], self._samples[-1]
        steps = steps1 - steps0
        return {"own_s": (own1 - own0) / 1e9 / steps if steps > 0 else 0.0, "steps": steps,
                "window_s": self.window, "updated": time.time()}

    # -- the root's judgement --------------------------------------------------------------
    def evaluate(self, paces: Mapping[str, Mapping[str, Any]], ready_spares: int
                 ) -> dict[str, Any]:
        """Judge the hosts' published paces (the root, every few seconds); write an event
        for each host that became or stopped being a straggler; the verdict to store,
        with the hosts to replace (``--replace-stragglers``, one per ready spare)."""
        parsed = {}
        for host, record in paces.items():
            own, steps = record.get("own_s"), record.get("steps")
            if isinstance(own, (int, float)) and isinstance(steps, int) and own == own:
                parsed[host] = (float(own), steps)
        before = self.judgement.stragglers
        self.judgement = judge(parsed, self.judgement, time.monotonic(),
                               threshold=self.threshold, window=self.window)
        for host in sorted(self.judgement.stragglers - before):
            score = self.judgement.scores.get(host, 0.0)
            logger.warning("host %s is a straggler: its own work per step is %.2fx the "
                           "median host's", host, score)
            self._events.write("straggler", straggler=host, score=round(score, 3),
                               threshold=self.threshold)
        for host in sorted(before - self.judgement.stragglers):
            self._events.write("straggler_cleared", straggler=host,
                               score=round(self.judgement.scores.get(host, 0.0), 3))
        replace = sorted(self.judgement.stragglers, key=lambda h: -self.judgement.scores.get(
            h, 0.0))[:ready_spares] if self.replace else []
        return {"scores": {h: round(s, 4) for h, s in self.judgement.scores.items()},
                "stragglers": sorted(self.judgement.stragglers), "replace": replace,
                "threshold": self.threshold, "updated": time.time()}

    def verdict(self, record: Mapping[str, Any]) -> None:
        """The root's verdict as stored: this host leaves when it is named to be replaced."""
        replace = record.get("replace")
        if self.replace and isinstance(replace, list) and self.host_id in replace:
            score = (record.get("scores") or {}).get(self.host_id)
            self.leave = (f"this host is a straggler (own work {score}x the median host's, "
                          f"--straggler-threshold {self.threshold}): a ready spare takes its "
                          "place (--replace-stragglers)")

    def close(self) -> None:
        pass
