"""A large request body written to a temporary file as it arrives, so that the API process never holds
(or copies) it whole: the parse process reads it from there (:mod:`mm_serve.api.body_parser`). The API
process calls it from a thread (``asyncio.to_thread``): a write can wait for the disk to take dirty
pages, and the event loop must not."""

from __future__ import annotations

import os
import tempfile
import threading

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
        self._lock = threading.Lock()  # a close waits for a write under way in another thread (the fd's number
        # must not be reused while a write still holds it)

    def write(self, chunk: bytes) -> None:
        """Append ``chunk`` (``os.write`` releases the GIL while the kernel copies it)."""
        with self._lock:
            if self._fd is None:
                raise OSError("the body's spool file is closed")
            view = memoryview(chunk)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
            self.size += len(chunk)

    def write_all(self, chunks: list[bytes]) -> None:
        """:meth:`write` each of ``chunks`` in order."""
        for chunk in chunks:
            self.write(chunk)

    def close(self) -> None:
        """Close and delete the file (once; later calls do nothing)."""
        with self._lock:
            if self._fd is None:
                return
            os.close(self._fd)
            self._fd = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
