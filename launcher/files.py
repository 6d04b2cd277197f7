"""Reading the small files a user names on the command line: the config file, the secret
file, an etcd store's certificates and password file.

Each is a regular file, read whole up to a bound: a FIFO would block ``open`` until
someone writes to it (a hang, not an error), a device like ``/dev/zero`` never ends, and
a directory is a mistake worth naming. The file is opened without blocking and checked
with ``fstat`` on the open descriptor, so a name swapped between a check and the read
changes nothing.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from launcher.errors import ConfigError


def read_user_file(path: str | Path, what: str, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (``~`` expanded), at most ``limit`` + 1 of
    them (the caller tells a file over ``limit``); ConfigError naming ``what`` when it
    cannot be read or is not a regular file."""
    name = os.path.expanduser(str(path))
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"the {what} {path} is not a regular file")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
