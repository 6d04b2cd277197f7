"""Worker health on one host: hang detection from progress heartbeats.

torch elastic's monitor loop already sees a worker that exits. A worker that stops making
progress without exiting (a deadlock, a stopped process, a stuck collective) is found
here: every worker's ``Checkpointer`` bumps a counter in a small shared-memory segment at
each optimizer step and each ``save()`` (``memory.heartbeat_name``, one cache line per
local rank). A worker whose counter has not moved for ``--hang-timeout`` seconds is hung,
from its first beat in the round until it closes its Checkpointer: the supervisor then
SIGKILLs the round's workers, and torch elastic restarts them as after a crash (counting
a restart); they resume from the in-memory checkpoint.

Workers that never beat (scripts without a Checkpointer) are not watched. The counters
exist without ``--hang-timeout`` too: they tell when every worker of a round is past its
start (:meth:`HealthService.progressed`), which background work waits for.

GPU health: where NVML is available (``nvidia-ml-py``, the ``gpu`` extra) a thread asks
it every few seconds about each GPU this host's workers can see. A GPU that NVML reports
lost (fallen off the bus) or in need of a reset makes this host unhealthy: the supervisor
stops its workers and leaves the job (:class:`HostUnhealthyError`), which the other hosts
then handle as a lost host. Nothing else NVML reports (temperatures, ECC counts) stops
a job.
"""

from __future__ import annotations

import logging
import os
import signal
import struct
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher import memory
from launcher.contract import ENV_HEARTBEAT
from launcher.errors import HostUnhealthyError
from launcher.events import EventLog

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.api import WorkerGroup

logger = logging.getLogger(__name__)

#: Seconds between two NVML checks of the GPUs.
GPU_CHECK_INTERVAL = 2.0


class HealthService:
    """Supervisor service (see ``elastic_agent.SupervisorService``): hang detection (with
    ``hang_timeout`` > 0) and GPU health (where NVML is available)."""

    def __init__(self, prefix: str, local_world_size: int, *, hang_timeout: float,
                 events: EventLog) -> None:
        self.hang_timeout = hang_timeout
        self._events = events
        self._segment = memory.create_segment(memory.heartbeat_name(prefix),
                                              memory.HEARTBEAT_STRIDE * local_world_size)
        os.environ[ENV_HEARTBEAT] = self._segment.name
        self._pids: dict[int, int] = {}  # local rank -> worker pid, this round
        self._last: dict[int, tuple[int, float]] = {}  # local rank -> (count, when it moved)
        self._killed = False
        self.gpus = GpuWatch.start()

    def _count(self, local_rank: int) -> int:
        value: int = struct.unpack_from("Q", self._segment.view,
                                        local_rank * memory.HEARTBEAT_STRIDE)[memory.BEAT]
        return value

    def before_start(self, group: WorkerGroup, store: Any) -> None:
        self._segment.view[:] = bytes(self._segment.size)  # no worker runs: from zero

    def after_start(self, group: WorkerGroup) -> None:
        self._pids = {w.local_rank: int(w.id) for w in group.workers if w.id is not None}
        self._last = {}
        self._killed = False

    def after_stop(self, group: WorkerGroup) -> None:
        self._pids = {}

    def check(self) -> None:
        lost = self.gpus.lost if self.gpus is not None else None
        if lost is not None:
            self._events.write("host_unhealthy", reason=lost)
            raise HostUnhealthyError(f"{lost}: this host leaves the job")
        if self.hang_timeout <= 0 or self._killed or not self._pids:
            return
        now = time.monotonic()
        for local_rank in self._pids:
            count = self._count(local_rank)
            last = self._last.get(local_rank)
            if count == memory.HEARTBEAT_DONE:  # closed its Checkpointer: training is over
                self._last.pop(local_rank, None)
            elif last is None or count != last[0]:
                if count:  # armed from the first beat of the round on
                    self._last[local_rank] = (count, now)
            elif now - last[1] > self.hang_timeout:
                self._kill_hung(local_rank, now - last[1])
                return

    def progress(self) -> list[tuple[int, ...]]:
        """Each running worker's words (indexed by ``memory.BEAT`` ... ``memory.OWN_STEPS``,
        by local rank); [] while no round runs."""
        return [struct.unpack_from(f"{memory.HEARTBEAT_WORDS}Q", self._segment.view,
                                   r * memory.HEARTBEAT_STRIDE)
                for r in sorted(self._pids)]

    def progressed(self) -> bool:
        """Whether every worker of the running round is past its start: it beat at least
        once (its first optimizer step, or a save), or closed its Checkpointer. False
        while no round runs."""
        return bool(self._pids) and all(self._count(r) for r in self._pids)

    def _kill_hung(self, local_rank: int, silent: float) -> None:
        """SIGKILL every worker of the round; torch elastic then restarts them."""
        self._killed = True
        logger.error("local rank %d made no progress for %.0f s (--hang-timeout %g): "
                     "killing this host's workers to restart them", local_rank, silent,
                     self.hang_timeout)
        self._events.write("hang", local_rank=local_rank, silent_seconds=round(silent, 1),
                           hang_timeout=self.hang_timeout, pids=sorted(self._pids.values()))
        for pid in self._pids.values():
            try:  # torch elastic starts each worker in a session of its own
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def close(self) -> None:
        if self.gpus is not None:
            self.gpus.close()
        self._segment.close()
        memory.unlink_segment(self._segment.name)
        memory.release_shm_dir()  # if the slots went first, this segment was the last


class GpuWatch:
    """A thread that asks NVML about this host's GPUs every ``GPU_CHECK_INTERVAL`` s;
    :attr:`lost` says why the host is unhealthy once a GPU is lost (else None)."""

    def __init__(self, nvml: Any, handles: dict[str, Any]) -> None:
        self.lost: str | None = None
        self._nvml = nvml
        self._handles = handles
        self._unusable = {nvml.NVML_ERROR_GPU_IS_LOST,
                          getattr(nvml, "NVML_ERROR_RESET_REQUIRED", -1)}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gemini-gpu-health",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def start(cls) -> GpuWatch | None:
        """A watch over the GPUs the workers can see, or None (no NVML, no GPU)."""
        try:
            import pynvml as nvml  # nvidia-ml-py
        except ImportError:
            if Path("/dev/nvidia0").exists():
                logger.warning("GPU health checks are off: install nvidia-ml-py "
                               "(pip install 'gemini-launcher[gpu]')")
            return None
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:  # no driver: a host without GPUs
            logger.debug("NVML unavailable: %s", exc)
            return None
        handles: dict[str, Any] = {}
        lost: str | None = None
        for name in _visible_gpus(nvml.nvmlDeviceGetCount()):
            try:
                handles[name] = (nvml.nvmlDeviceGetHandleByUUID(name) if name.startswith("GPU-")
                                 else nvml.nvmlDeviceGetHandleByIndex(int(name)))
            except nvml.NVMLError as exc:
                if exc.value == nvml.NVML_ERROR_GPU_IS_LOST:
                    lost = f"GPU {name} is lost (NVML: {exc})"
        if not handles and lost is None:
            nvml.nvmlShutdown()
            return None
        watch = cls(nvml, handles)
        watch.lost = lost
        return watch

    def _loop(self) -> None:
        nvml = self._nvml
        while self.lost is None and not self._stop.wait(GPU_CHECK_INTERVAL):
            for name, handle in self._handles.items():
                try:
                    nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
                except nvml.NVMLError as exc:
                    if exc.value in self._unusable:
                        self.lost = f"GPU {name} is lost (NVML: {exc})"
                        logger.error("%s", self.lost)
                        break
                    # anything else (not supported, no permission): no verdict

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass


def _visible_gpus(count: int) -> list[str]:
    """NVML indices (or ``GPU-`` UUIDs) of the GPUs that CUDA_VISIBLE_DEVICES leaves to the
    workers: all ``count`` when it is unset or names MIG devices, none when it is empty."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or "MIG-" in visible:
        return [str(i) for i in range(count)]
    names = []
    for item in (v.strip() for v in visible.split(",")):
        if item.isdigit() and int(item) < count:
            names.append(item)
        elif item.startswith("GPU-"):
            names.append(item)
        else:  # CUDA ignores the entries from the first invalid one on
            break
    return names
