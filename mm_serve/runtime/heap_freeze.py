"""Keep a serving process's start-up heap out of Python's cyclic garbage collector.

Before it serves, each of our processes imports torch and transformers and builds its model,
tokenizer or app: a few hundred thousand objects that live as long as the process (385 k in the
API process on the llava bench model). A collection of the oldest generation walks all of them,
and it runs on whatever thread allocated last: the API process's event loop (every response,
stream and refusal waits for it) or a worker's step loop (every request in the step waits).
Such a collection takes 75-318 ms on a 2-core machine, growing with the heap, and shows under
load as a stall of the event loop of about half a second outside every request phase
(benchmarks/results/2026-12-04-admission-load.md). ``gc.freeze()`` (Python 3.7+, the ``gc``
module's documentation) moves every object alive now to a permanent generation that later
collections skip; objects created afterwards are collected as before, so a full collection
costs what the serving state costs, not what the imports do.

Start-up itself pays for the collector too: importing torch and transformers and building a
model makes objects by the hundred thousand, and each collection of the oldest generation on
the way walks all made so far (seven of them, 0.03-0.23 s each, about 1 s in all, in the API
process; as much in each worker). :func:`defer_collection` turns the collector off at a process's
entry; :func:`freeze_startup_heap` freezes and turns it back on.

The freeze is not preceded by a collection: one walks the whole start-up heap (355 k objects in a
decode worker, 630 k in a prefill worker, 690 k in the API process) for 0.27-0.31 s, on the path
of every start (the prefill worker's load and the API process's first 200 from ``/health`` come
last), to free the few cycles the imports and loading left (7-11 k small objects, no tensor
storage: measured on the tiny llava checkpoint). Those few stay, frozen: as the ``gc`` module's
documentation has it for ``gc.freeze()`` before a fork, a disabled collector and a freeze need no
collection first.
"""

from __future__ import annotations

import gc


def defer_collection() -> None:
    """Turn the cyclic garbage collector off until :func:`freeze_startup_heap` (call first thing
    at a serving process's entry, before its heavy imports). Reference counting still frees
    everything not in a cycle; the cycles made meanwhile wait for that one collection."""
    gc.disable()


def freeze_startup_heap() -> int:
    """Move every object tracked now (the start-up's cyclic garbage included, see the module's
    note) out of the collector's reach, and turn the collector on (again, after
    :func:`defer_collection`).

    Call when start-up is done (model, tokenizer and app built), before serving; calling it
    again later freezes what was created in between (harmless, but those objects are then
    never collected if they die).

    Returns:
        The number of objects in the permanent generation (``gc.get_freeze_count()``).
    """
    gc.freeze()
    gc.enable()
    return gc.get_freeze_count()
