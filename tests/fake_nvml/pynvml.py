"""A stand-in for nvidia-ml-py's ``pynvml`` on a machine without GPUs (tests only).

It reports two GPUs; GPU 1 counts as fallen off the bus (NVML_ERROR_GPU_IS_LOST) once
the file named by ``FAKE_NVML_LOST`` exists. Only what ``launcher.health`` calls is here,
with NVML's names and error codes.
"""

import os

NVML_TEMPERATURE_GPU = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {15: "GPU is lost", 16: "GPU requires restart"}.get(self.value, "Not Supported")


def _lost() -> bool:
    return os.path.exists(os.environ.get("FAKE_NVML_LOST", "/nonexistent"))


def nvmlInit() -> None:
    pass


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return 2


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    if index == 1 and _lost():
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    return index


def nvmlDeviceGetHandleByUUID(uuid: str) -> int:
    raise NVMLError(NVML_ERROR_NOT_SUPPORTED)


def nvmlDeviceGetTemperature(handle: int, sensor: int) -> int:
    if handle == 1 and _lost():
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    if handle == 0:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)  # no verdict: must not stop anything
    return 40
