"""Hand-off doorbells: a ring ends an idle worker's wait at once; a ring nobody hears is dropped."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from mm_serve.runtime import messages
from mm_serve.transport.doorbell import DoorbellListener, DoorbellRingers, doorbell_address
from tests.factories import front_end_channel


def test_a_ring_ends_an_idle_recv_and_is_drained(tmp_path: Path) -> None:
    with front_end_channel(tmp_path, messages.ToDecode) as (channel, control, _):
        listener = DoorbellListener(doorbell_address(str(tmp_path), 0))
        channel.listen_to(listener)
        ringers = DoorbellRingers([doorbell_address(str(tmp_path), 0)])
        ringer = threading.Timer(0.2, ringers.ring, args=(0,))
        try:
            start = time.monotonic()
            ringer.start()
            assert channel.recv(10_000) == []  # woken by the ring, not by a message
            waited = time.monotonic() - start
            assert 0.15 < waited < 5.0, waited
            assert listener.drain() == 0  # recv drained it
            control.send(messages.encode(messages.StatsQuery()))
            assert [type(m).__name__ for m in channel.recv(5_000)] == ["StatsQuery"]
        finally:
            ringer.cancel()
            ringers.close()
            listener.close()


def test_rings_nobody_listens_to_never_block(tmp_path: Path) -> None:
    ringers = DoorbellRingers([doorbell_address(str(tmp_path), 0), doorbell_address(str(tmp_path), 1)])
    try:
        start = time.monotonic()
        for _ in range(100):
            ringers.ring(1)
        assert time.monotonic() - start < 1.0
        listener = DoorbellListener(doorbell_address(str(tmp_path), 1))  # binds late
        try:
            deadline = time.monotonic() + 5.0
            heard = 0
            while not heard and time.monotonic() < deadline:
                ringers.ring(1)
                time.sleep(0.01)
                heard = listener.drain()
            assert 1 <= heard <= 10  # the queue holds a couple at most; late rings get through
        finally:
            listener.close()
    finally:
        ringers.close()
