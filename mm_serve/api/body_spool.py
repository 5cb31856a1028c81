"""A large request body written to a temporary file as it arrives, so that the API process never holds
(or copies) it whole: the parse process reads it from there (:mod:`mm_serve.api.body_parser`)."""

from __future__ import annotations

import os
import tempfile

SPOOL_PREFIX = "mmsrv-body-"


class BodySpool:
    """A temporary file (in the system's temp folder) receiving a body's chunks; :meth:`close` deletes it.

    Raises (from the constructor and :meth:`write`):
        OSError: the file cannot be created or written (a full disk).
    """

    def __init__(self) -> None:
        fd, self.path = tempfile.mkstemp(prefix=SPOOL_PREFIX)
        self._fd: int | None = fd
        self.size = 0

    def write(self, chunk: bytes) -> None:
        """Append ``chunk`` (``os.write`` releases the GIL while the kernel copies it)."""
        assert self._fd is not None, "closed"
        view = memoryview(chunk)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        self.size += len(chunk)

    def close(self) -> None:
        """Close and delete the file (once; later calls do nothing)."""
        if self._fd is None:
            return
        os.close(self._fd)
        self._fd = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
