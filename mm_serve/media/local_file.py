"""A local media file read whole into memory, within a byte cap, and only if it is a regular file.

A caption job's input row, an offline ``LLM`` image path or ``mm-serve generate --image`` may name any
path: a bare ``read()`` of ``/dev/zero`` grows the process until the kernel kills it, and one of a named
pipe with no writer blocks. Here the file is opened without blocking (a FIFO with no writer does not hang the open), checked to
be a regular file, and read up to its cap plus one byte (a file that grows while it is read is refused
too). The server's ``file://`` URLs are read the same way, under their own cap
(:mod:`mm_serve.media.fetch`).
"""

from __future__ import annotations

import errno
import os
import stat

MAX_MEDIA_FILE_BYTES = 1 << 30  # 1 GiB: an image or video file read by the offline API, the caption job or generate


def read_media_file(path: str | os.PathLike[str], max_bytes: int = MAX_MEDIA_FILE_BYTES,
                    follow_symlinks: bool = True) -> bytes:
    """The bytes of the regular file at ``path``, at most ``max_bytes`` of them.

    Args:
        follow_symlinks: False: a symlink as the last component is refused (``O_NOFOLLOW``).

    Raises:
        OSError: it cannot be opened or read (``strerror`` says why); ``EINVAL`` "not a regular file" (a
            device, a pipe, a directory); ``EFBIG`` "larger than the N-byte limit".
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | (0 if follow_symlinks else getattr(os, "O_NOFOLLOW", 0))
    fd = os.open(path, flags)
    try:
        info = os.fstat(fd)  # before Python's file object, which refuses a directory in its own words
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
        if info.st_size > max_bytes:
            raise OSError(errno.EFBIG, f"larger than the {max_bytes}-byte limit", os.fspath(path))
    except BaseException:
        os.close(fd)
        raise
    with open(fd, "rb") as handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise OSError(errno.EFBIG, f"larger than the {max_bytes}-byte limit", os.fspath(path))
    return data
