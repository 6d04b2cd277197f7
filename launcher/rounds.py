"""When a host's supervisor restarts its round of workers: pure decisions over what it knows.

No processes, no store, no torch: the agent (``launcher.elastic_agent``) reads torch's
rendezvous state, the round's store and the lost hosts, calls these functions, and carries
out their answer (the messages, the events, the counts it adds to the store), as
``launcher.recovery`` decides a restore that ``launcher.tiers`` carries out.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field, replace


def round_moved_on(joined: int | None, current: int | None) -> bool:
    """Whether torch's rendezvous is at another round than ``joined``, the one this host
    joined: the job went on without it. False while either number is unknown (before this
    host's first round; a backend that numbers no rounds)."""
    return joined is not None and current is not None and current != joined


@dataclass(frozen=True, kw_only=True)
class WaitingAnswer:
    """What the agent answers torch's monitor loop when it asks for the waiting hosts, and
    what it records first (at most one of ``fence``, ``lost``, ``failed`` and
    ``note_spares``)."""

    count: int
    """The hosts waiting, as the monitor loop is told: above 0 restarts the round."""
    acted_on: frozenset[str]
    """The lost members of this round acted on from now on."""
    fence: bool = False
    """The job went on without this host: it must stop acting on its round."""
    lost: frozenset[str] = frozenset()
    """Members of this round newly confirmed lost, to announce (empty: none)."""
    note_spares: bool = False
    """Hosts wait while the group is full: say, once, that they stay spares."""
    failed: frozenset[str] = frozenset()
    """Members whose workers failed: every host restarts with them (empty: none said so)."""


def answer_waiting(*, waiting: int, moved_on: bool, lost: frozenset[str],
                   members: frozenset[str], host: str, acted_on: frozenset[str],
                   world: int, max_nodes: int, spares_noted: bool,
                   failed: frozenset[str] = frozenset(), left: bool = False
                   ) -> WaitingAnswer:
    """The count of waiting hosts to answer torch's monitor loop, which restarts a healthy
    group whenever it is above 0.

    ``waiting`` is torch's own count; ``moved_on`` whether the rendezvous went on without
    this host (:func:`round_moved_on`); ``lost`` the hosts confirmed lost (lease expired);
    ``members`` the hosts of this host's round and ``host`` this one; ``acted_on`` the lost
    members already restarted for; ``world`` the hosts of the round, ``max_nodes`` the most
    the group may have; ``spares_noted`` whether full-group spares were already noted;
    ``failed`` the hosts that said their workers of this round failed and they restart;
    ``left`` whether a member already left torch's round (fewer participants than
    ``world``: it re-joins after its workers failed, or was dropped as dead).

    * The job went on without this host: 1, and fence it out (it stops its stale workers
      and waits as a spare).
    * A member of this round was newly confirmed lost (a host that froze or vanished
      without a connection reset leaves the survivors' workers waiting on it forever): 1,
      to restart the round without it. A lost member that registered again drops out of
      ``acted_on``, so that its next loss is acted on too.
    * Another member's workers failed (it said so, or it left the round to re-join): 1.
      Every host restarts in the next round at once, as torch's own rendezvous has it,
      instead of waiting for its workers' collectives with the failed ones to time out.
      A member is never a spare.
    * Hosts wait but the group already has ``max_nodes`` hosts and every member is still
      in the round: 0. torch expects the next round to let a waiting host in; a full
      group cannot, and the waiting host would push an original one out of the next
      round, which would then wait and restart the group again. A spare waits until a
      host is lost, a member fails, or the group can grow.
    * Otherwise torch's count.
    """
    if moved_on:
        return WaitingAnswer(count=1, acted_on=acted_on, fence=True)
    lost_members = (lost & members) - {host}
    still_acted_on = acted_on & lost_members
    if lost_members and lost_members != still_acted_on:
        return WaitingAnswer(count=1, acted_on=lost_members, lost=lost_members)
    failed_members = (failed & members) - {host}
    if failed_members or (waiting and left):
        return WaitingAnswer(count=max(1, waiting), acted_on=still_acted_on,
                             failed=failed_members)
    if waiting and world >= max_nodes:
        return WaitingAnswer(count=0, acted_on=still_acted_on, note_spares=not spares_noted)
    return WaitingAnswer(count=waiting, acted_on=still_acted_on)


class AfterFailure(enum.Enum):
    """What a host does once its workers failed: it restarts them (torch's next round), or
    its run ends and it counts itself into torch's exit barrier, where the hosts that
    finished wait for every host of the round."""

    RESTART = "restart"
    """Restart the workers; announce it in the exit barrier (a host that restarted)."""
    PEERS_FINISHED = "peers_finished"
    """Restarts remain, but hosts of this round already finished their workers and the
    others are too few for a new round: end the run instead of waiting for a round that
    cannot form."""
    NO_RESTARTS = "no_restarts"
    """No restarts left: the run ends."""


def after_failure(*, remaining_restarts: int, finished: int, world: int,
                  min_nodes: int) -> AfterFailure:
    """Whether a host whose workers failed restarts them: while restarts remain, unless
    ``finished`` of the round's ``world`` hosts finished their workers (they join no later
    round) and the rest are fewer than the ``min_nodes`` a round needs."""
    if remaining_restarts <= 0:
        return AfterFailure.NO_RESTARTS
    if finished == 0 or world - finished >= min_nodes:
        return AfterFailure.RESTART
    return AfterFailure.PEERS_FINISHED


def stranded(*, finished: int, restarting: int, world: int, min_nodes: int,
             static: bool) -> bool:
    """Whether a host that finished its workers should close the rendezvous: every host of
    the round's ``world`` that has not ``finished`` is ``restarting`` after a failure, and
    those are fewer than the ``min_nodes`` a round needs, so they wait for a round that
    cannot form while this host waits for them in the exit barrier. Never with a
    ``static`` rendezvous, which cannot be closed."""
    if static:
        return False
    return restarting > 0 and finished + restarting >= world and world - finished < min_nodes


# -- the no-progress guard ------------------------------------------------------------
# A script that fails the same way after every restore (a bad batch, a NaN that raises, a
# restored state it cannot take) would be restarted until --max-restarts is spent, each
# time from the same step, and end with the exit code of any worker failure, so that a
# scheduler requeues it and the loop starts again.

#: Signals by which something outside the job ends a worker (an operator, the OOM killer,
#: a scheduler, a fault injected on purpose): such a failure says nothing about the
#: script or its checkpoint, and never counts toward the guard. SIGTERM is also how torch
#: stops a host's other workers once one failed: it counts as outside only when every
#: failed rank got it.
EXTERNAL_SIGNALS = frozenset({signal.SIGKILL, signal.SIGINT, signal.SIGHUP})

Signature = frozenset[tuple[int, int, str]]
"""A failure's signature: per failed global rank, its exit code (minus the signal number
for a signal) and the last line of its error message."""


def failure_signature(failures: Mapping[int, tuple[int, str]]) -> Signature | None:
    """The signature of a failure of ``failures`` (global rank -> exit code, message),
    without the ranks torch stopped (SIGTERM) because another one failed; None when a
    rank was ended from outside (a transient fault: :data:`EXTERNAL_SIGNALS`, or SIGTERM
    to every failed rank)."""
    codes = [code for code, _ in failures.values()]
    if any(code < 0 and -code in EXTERNAL_SIGNALS for code in codes) or all(
            code == -signal.SIGTERM for code in codes):
        return None
    return frozenset((rank, code, _last_line(code, message))
                     for rank, (code, message) in failures.items() if code != -signal.SIGTERM)


def _last_line(code: int, message: str) -> str:
    """The part of torch's failure message that says what failed: the last line of the
    error file's message; not torch's hint for a script without an error file, nor the
    pid in its message for a signal."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    line = (message.strip().splitlines() or [""])[-1][:200]
    return "" if line.startswith("To enable traceback see") else line


@dataclass(frozen=True)
class FailureHistory:
    """What the guard remembers of this host's failures since its newest committed step
    last grew (an episode)."""

    high_water: int = -1
    """The newest step this host's workers ever committed (-1: none)."""
    signature: Signature | None = None
    """What the failures counted in ``same`` had in common (see :func:`guard_failure`)."""
    same: int = 0
    """Failures in a row that were the same, no step beyond ``high_water`` in between."""
    avoid: frozenset[int] = field(default_factory=frozenset)
    """Steps no round of this episode restores again: a failure followed their restore."""


class Guard(enum.Enum):
    """What the guard makes of a failure."""

    RESTART = "restart"
    """Restart as usual (from the newest step every rank holds, except ``avoid``)."""
    RESTART_OLDER = "restart_older"
    """The failure followed the restore of a step before any newer step was committed:
    restart from the next older step (once per episode), so that a bad checkpoint is
    never restored twice."""
    GIVE_UP = "give_up"
    """The same failure ``limit`` times without progress: stop, and do not requeue."""


def guard_failure(history: FailureHistory, *, signature: Signature | None, committed: int,
                  restored: int, limit: int) -> tuple[Guard, FailureHistory]:
    """The guard's answer to a failure of this host's workers, and its new history.

    ``committed`` is the newest step this host's workers committed so far, ``restored``
    the step their round restored (-1: none), ``limit`` ``--max-same-failures`` (0: off).
    Two failures are the same when a rank failed in each with the same exit code and
    message, not necessarily the same rank (which rank dies first of one failure, and
    which of the others die of it or are stopped by torch, changes from one time to the
    next). Progress (a step beyond every step committed
    before) starts a new episode; a transient failure (``signature`` None) neither counts
    nor ends one. Before any step was committed (a script without gemini's Checkpointer,
    or one failing before its first save) progress cannot be seen: restarts are bounded
    by ``--max-restarts`` alone, as with torchrun."""
    if committed < 0:
        return Guard.RESTART, history
    if committed > history.high_water:
        history = FailureHistory(high_water=committed)
    if signature is None:
        return Guard.RESTART, history
    kinds = {(code, message) for _, code, message in history.signature or ()}
    common = frozenset(s for s in signature if s[1:] in kinds)
    history = replace(history, signature=common or signature,
                      same=history.same + 1 if common else 1)
    same = history.same
    if 0 <= restored and committed <= restored and not history.avoid:
        return Guard.RESTART_OLDER, replace(history, avoid=frozenset({restored}))
    if limit > 0 and same >= limit:
        return Guard.GIVE_UP, history
    return Guard.RESTART, history
