"""The start-up heap is frozen: a full garbage collection afterwards walks only what came later."""

from __future__ import annotations

import json
import subprocess
import sys

# In a fresh process (freezing this one would keep pytest's garbage forever): import torch (as
# every serving process does), freeze, make 1,000 new objects in
# cycles (dead) and 1,000 alive, collect, report what the collector saw.
_SCRIPT = """
import gc, json, time
import torch
from mm_serve.runtime.heap_freeze import freeze_startup_heap
before = len(gc.get_objects())
frozen = freeze_startup_heap()
gc.disable()  # no automatic young collection in between: the explicit one below sees all
kept = [[i] for i in range(1000)]
for _ in range(1000):
    a = []; a.append(a)
del a
tracked = len(gc.get_objects())
collected = gc.collect()
print(json.dumps({"before": before, "frozen": frozen, "tracked": tracked, "collected": collected,
                  "after": len(gc.get_objects()), "kept": len(kept)}))
"""


def test_freezing_moves_the_startup_heap_out_of_reach_and_later_garbage_is_still_collected() -> None:
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    seen = json.loads(out.stdout)
    assert seen["before"] > 50_000  # torch's import alone
    assert seen["frozen"] >= seen["before"]  # all of it, without a collection first
    # only the 2,000 objects made after the freeze (+ the frames and lists of the script) are tracked
    assert 2000 <= seen["tracked"] < 2300, seen
    assert seen["collected"] >= 1000  # the dead cycles made after the freeze are collected
    assert 1000 <= seen["after"] < 1300, seen  # the live ones stay; nothing frozen reappears
