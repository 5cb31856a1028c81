"""Named POSIX shared-memory segments with explicit ownership.

Why not ``multiprocessing.shared_memory.SharedMemory`` as is: on Python < 3.13
*attaching* registers the segment with the attaching process's resource
tracker, which then unlinks it (with a "leaked shared_memory" warning) when that
process exits, i.e. early, under the owner's feet. The usual workaround,
unregistering right after attaching, breaks when the attacher was started by
``multiprocessing`` (spawn/forkserver): it shares the owner's tracker, so the
unregister drops the *owner's* registration, and the owner's later unlink makes
the tracker print a ``KeyError``. So here only the creator registers the segment
(its tracker still cleans up after a crashed owner); an attacher maps the
segment without telling any tracker.

Also unlike ``SharedMemory.close()``, :meth:`ShmSegment.close` never unmaps
memory that a tensor may still view (``torch.frombuffer`` keeps a reference to
the mmap, not a buffer export, so an explicit unmap would leave it dangling):
it drops this object's reference and the mapping goes when the last view does.

POSIX only (Linux: segments appear as ``/dev/shm/<name>``).
"""

from __future__ import annotations

import _posixshmem  # CPython's shm_open/shm_unlink binding, as used by multiprocessing
import mmap
import os
from collections.abc import Mapping
from multiprocessing import resource_tracker

import torch

_TRACKER_TYPE = "shared_memory"  # the resource type multiprocessing's tracker unlinks


class ShmSegment:
    """One named shared-memory segment mapped read-write into this process.

    Build with :meth:`create` (owner) or :meth:`attach`. ``buffer`` is the
    mmap; wrap it with ``numpy.frombuffer`` / ``torch.frombuffer``.
    """

    def __init__(self, name: str, buffer: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.owner = owner
        self.size = len(buffer)
        self._buffer: mmap.mmap | None = buffer
        self._unlinked = False

    @classmethod
    def create(cls, name: str, size: int) -> ShmSegment:
        """Create segment ``name`` (no leading slash) of ``size`` bytes, zero-filled.

        The segment is registered with this process's resource tracker, which
        unlinks it if this process dies without calling :meth:`unlink`.

        Raises:
            FileExistsError: a segment of that name exists (names must be unique).
            ValueError: ``size`` < 1.
        """
        if size < 1:
            raise ValueError(f"segment size must be >= 1 byte, got {size}")
        path = "/" + name
        fd = _posixshmem.shm_open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.ftruncate(fd, size)  # new pages read as zeros
            buffer = mmap.mmap(fd, size)
        except BaseException:
            _posixshmem.shm_unlink(path)
            raise
        finally:
            os.close(fd)  # the mapping keeps its own reference
        resource_tracker.register(path, _TRACKER_TYPE)
        return cls(name, buffer, owner=True)

    @classmethod
    def attach(cls, name: str, min_size: int) -> ShmSegment:
        """Map the existing segment ``name``; not registered with any resource tracker.

        Raises:
            FileNotFoundError: no such segment (not created yet, or already unlinked).
            ValueError: the segment is smaller than ``min_size`` bytes (another layout).
        """
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            size = os.fstat(fd).st_size
            if size < min_size:
                raise ValueError(f"segment {name!r} has {size} bytes, expected >= {min_size}")
            buffer = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, buffer, owner=False)

    @property
    def buffer(self) -> mmap.mmap:
        """The mapping. Raises RuntimeError after :meth:`close`."""
        if self._buffer is None:
            raise RuntimeError(f"shared-memory segment {self.name!r} is closed")
        return self._buffer

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A ``shape`` tensor over the start of the segment; it keeps the mapping alive.

        Raises:
            ValueError: the segment is too small for ``shape``.
        """
        count = 1
        for size in shape:
            count *= size
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self.buffer, dtype=dtype, count=count).view(shape)

    def close(self) -> None:
        """Drop this object's reference to the mapping; idempotent.

        The memory is unmapped once no array or tensor views it any more.
        """
        self._buffer = None

    def unlink(self) -> None:
        """Remove the segment's name (owner only; idempotent). Mapped views stay valid.

        Raises:
            RuntimeError: this side attached rather than created the segment.
        """
        if not self.owner:
            raise RuntimeError(f"only the creator may unlink segment {self.name!r}")
        if self._unlinked:
            return
        self._unlinked = True
        path = "/" + self.name
        try:
            _posixshmem.shm_unlink(path)
        except FileNotFoundError:
            pass  # removed behind our back (e.g. by hand); nothing left to do
        resource_tracker.unregister(path, _TRACKER_TYPE)


def create_segments(sizes: Mapping[str, int]) -> list[ShmSegment]:
    """Create one segment per ``name: size`` entry, in order; all or none.

    Raises:
        FileExistsError: a name is taken (the segments created so far are unlinked).
    """
    segments: list[ShmSegment] = []
    try:
        for name, size in sizes.items():
            segments.append(ShmSegment.create(name, size))
    except BaseException:
        for segment in segments:
            segment.unlink()
        raise
    return segments


def attach_segments(min_sizes: Mapping[str, int]) -> list[ShmSegment]:
    """Attach one segment per ``name: min_size`` entry, in order.

    Raises:
        FileNotFoundError, ValueError: as :meth:`ShmSegment.attach`.
    """
    return [ShmSegment.attach(name, size) for name, size in min_sizes.items()]
