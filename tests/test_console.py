"""mm_serve.ground.console.say: a status line on a stream whose reader has gone."""

from __future__ import annotations

import os

import pytest

from mm_serve.ground.console import say


def test_a_line_to_a_closed_pipe_is_dropped_and_later_lines_go_to_devnull() -> None:
    read_end, write_end = os.pipe()
    with open(write_end, "w") as stream:
        say("first", stream)
        assert os.read(read_end, 100) == b"first\n"
        os.close(read_end)  # the reader leaves
        say("second", stream)  # EPIPE: dropped, not raised
        assert os.readlink(f"/proc/self/fd/{stream.fileno()}") == os.devnull
        say("third", stream)


def test_a_closed_file_object_still_raises() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)
    stream = open(write_end, "w")
    stream.close()
    with pytest.raises(ValueError):
        say("line", stream)
