"""A workload read from a JSONL file: one request per line, optionally traces and conversations.

Each line is a JSON object with ``output_len`` and either ``prompt_len`` (text tokens)
or ``prompt`` (text; length estimated as ``ceil(len(prompt) / 4)`` tokens unless a
token counter is given), and optionally:

* ``num_images`` (default 0): images in this request's user message;
* ``timestamp``: arrival time in seconds; a file whose rows all carry one is a *trace*
  and is replayed in order (at a rate scaled from the spacing of the stamps);
* ``conversation_id`` (string or integer): rows that share it are the turns of one
  conversation, sent closed-loop: a turn goes out once the previous turn has been
  answered (and, in a trace, not before its own timestamp), its ``messages`` holding
  the whole history (the earlier user messages as sent, images included, and the
  answers as assistant messages) then its own user message. ``prompt_len`` is then
  the new text of the turn only;
* ``turn`` (integer >= 0, only with ``conversation_id``): the turn's order in its
  conversation; default the order of the rows in the file. Two rows of one
  conversation may not have the same ``turn``; in a trace, timestamps may not
  decrease from one turn to the next.

Blank lines and lines starting with ``#`` are skipped.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from mm_serve.workloads.spec import RequestSpec, WorkloadError, conversation_groups

Parsed = tuple[RequestSpec, int | None, str]  # a row's spec, its explicit 'turn', where it is


@dataclass(frozen=True)
class JsonlWorkload:
    """Rows read from a JSONL file (format in the module docstring).

    A trace (every row timestamped) is replayed in file order, cycling with the
    time offset of one full pass when more rows are asked for; otherwise rows are
    drawn uniformly with replacement from the seeded generator. With conversations,
    whole conversations are drawn (or cycled) and each copy gets its own id
    (``<id>@<copy>``); rows are kept grouped by conversation, in the order of each
    conversation's first row.
    """

    rows: tuple[RequestSpec, ...]
    name: str = "jsonl"

    @property
    def is_trace(self) -> bool:
        return all(r.arrival_s is not None for r in self.rows)

    @property
    def conversational(self) -> bool:
        """True when some rows are turns of a conversation (closed loop)."""
        return any(r.conversation_id is not None for r in self.rows)

    def sample(self, n: int, seed: int) -> list[RequestSpec]:
        if self.conversational:
            return self._sample_conversations(n, seed)
        if not self.is_trace:
            rng = random.Random(f"jsonl:{seed}")
            return [rng.choice(self.rows) for _ in range(n)]
        span = self._span()
        out = []
        for i in range(n):
            row = self.rows[i % len(self.rows)]
            offset = span * (i // len(self.rows))
            out.append(replace(row, arrival_s=(row.arrival_s or 0.0) + offset))
        return out

    def _span(self) -> float:
        """Seconds one pass of a trace takes, plus one mean gap (the offset of the next pass)."""
        span = max(r.arrival_s or 0.0 for r in self.rows)
        return span + span / max(1, len(self.rows) - 1)

    def _sample_conversations(self, n: int, seed: int) -> list[RequestSpec]:
        """Whole conversations, copies renamed ``<id>@<copy>``, until at least ``n`` rows."""
        units = _units(self.rows)
        rng = random.Random(f"jsonl:{seed}")
        span = self._span() if self.is_trace else 0.0
        out: list[RequestSpec] = []
        copy = 0
        while len(out) < n:
            if self.is_trace:
                unit, offset = units[copy % len(units)], span * (copy // len(units))
            else:
                unit, offset = rng.choice(units), 0.0
            for row in unit:
                cid = None if row.conversation_id is None else f"{row.conversation_id}@{copy}"
                stamp = None if row.arrival_s is None else row.arrival_s + offset
                out.append(replace(row, conversation_id=cid, arrival_s=stamp))
            copy += 1
        return out


def _units(rows: Sequence[RequestSpec]) -> list[list[RequestSpec]]:
    """The rows as conversations (a row without a conversation is one of its own), in order."""
    return [[rows[i] for i in group] for group in conversation_groups([r.conversation_id for r in rows])]


def _row_int(row: dict[str, object], key: str, where: str, default: int | None = None) -> int:
    value = row.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise WorkloadError(f"{where}: '{key}' must be a non-negative integer, got {value!r}")
    return value


def _conversation(row: dict[str, object], where: str) -> tuple[str | None, int | None]:
    """The row's ``conversation_id`` (as a string) and explicit ``turn``, validated."""
    cid = row.get("conversation_id")
    if cid is None:
        if "turn" in row:
            raise WorkloadError(f"{where}: 'turn' needs a 'conversation_id'")
        return None, None
    if isinstance(cid, bool) or not isinstance(cid, (str, int)) or cid == "":
        raise WorkloadError(f"{where}: 'conversation_id' must be a non-empty string or an integer, got {cid!r}")
    return str(cid), (_row_int(row, "turn", where) if "turn" in row else None)


def _parse_row(row: dict[str, object], where: str, image_tokens: int,
               count_tokens: Callable[[str], int] | None) -> tuple[RequestSpec, int | None]:
    """One JSON object as a spec (turn not yet numbered) and its explicit ``turn``."""
    if "prompt_len" in row:
        prompt = _row_int(row, "prompt_len", where)
    elif isinstance(row.get("prompt"), str):
        text = str(row["prompt"])
        prompt = count_tokens(text) if count_tokens else math.ceil(len(text) / 4)
    else:
        raise WorkloadError(f"{where}: needs 'prompt_len' or 'prompt'")
    output = _row_int(row, "output_len", where)
    if output < 1:
        raise WorkloadError(f"{where}: 'output_len' must be >= 1")
    stamp = row.get("timestamp")
    if stamp is not None and (isinstance(stamp, bool) or not isinstance(stamp, (int, float))
                              or not math.isfinite(stamp) or stamp < 0):
        raise WorkloadError(f"{where}: 'timestamp' must be a number >= 0 (seconds), got {stamp!r}")
    images = _row_int(row, "num_images", where, 0)
    if prompt + images * image_tokens < 1 and not (images and image_tokens == 0):
        raise WorkloadError(f"{where}: a request needs at least one prompt token (or an image)")
    cid, turn = _conversation(row, where)
    spec = RequestSpec(prompt, output, images, image_tokens if images else 0,
                       None if stamp is None else float(stamp), conversation_id=cid)
    return spec, turn


def _number_turns(p: Path, parsed: list[Parsed]) -> list[RequestSpec]:
    """Group the rows by conversation (in the order of each one's first row), order each
    conversation by ``turn`` (else by file order) and number its turns 0, 1, ..."""
    rows: list[RequestSpec] = []
    for group in conversation_groups([spec.conversation_id for spec, _, _ in parsed]):
        rows += _ordered_turns(p, [parsed[i] for i in group])
    return rows


def _ordered_turns(p: Path, unit: list[Parsed]) -> list[RequestSpec]:
    """One conversation's rows in turn order, numbered; raises on a repeated or partial ``turn``."""
    spec0, _, where0 = unit[0]
    if spec0.conversation_id is None:
        return [spec0]
    cid = spec0.conversation_id
    explicit = [turn for _, turn, _ in unit if turn is not None]
    if explicit and len(explicit) < len(unit):
        raise WorkloadError(f"{where0}: conversation {cid!r}: give 'turn' on all of its rows or on none")
    if len(set(explicit)) < len(explicit):
        twice = sorted(t for t in set(explicit) if explicit.count(t) > 1)[0]
        raise WorkloadError(f"{p}: conversation {cid!r} has turn {twice} twice")
    if explicit:
        unit = sorted(unit, key=lambda item: item[1] or 0)
    rows: list[RequestSpec] = []
    for t, (spec, _, where) in enumerate(unit):
        before = rows[-1].arrival_s if rows else None
        if before is not None and spec.arrival_s is not None and spec.arrival_s < before:
            raise WorkloadError(f"{where}: conversation {cid!r}: a turn has an earlier 'timestamp' "
                                "than the turn before it")
        rows.append(replace(spec, turn=t))
    return rows


def load_jsonl_workload(
    path: str | Path, image_tokens: int = 0, count_tokens: Callable[[str], int] | None = None
) -> JsonlWorkload:
    """Read a JSONL workload file; raises :class:`WorkloadError` naming the bad line."""
    p = Path(path)
    if p.is_dir():
        raise WorkloadError(f"workload {p} is a directory, not a JSONL file")
    if not p.is_file():
        raise WorkloadError(f"workload file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    parsed: list[Parsed] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{p}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{where}: not JSON: {exc.msg}") from None
        if not isinstance(row, dict):
            raise WorkloadError(f"{where}: each line must be a JSON object")
        spec, turn = _parse_row(row, where, image_tokens, count_tokens)
        parsed.append((spec, turn, where))
    if not parsed:
        raise WorkloadError(f"{p}: no requests")
    stamped = sum(spec.arrival_s is not None for spec, _, _ in parsed)
    if 0 < stamped < len(parsed):
        raise WorkloadError(f"{p}: {stamped} of {len(parsed)} rows have a 'timestamp': give every "
                            "row one (a trace) or none (arrivals drawn at the requested rate)")
    if stamped and len({spec.arrival_s for spec, _, _ in parsed}) < 2:
        raise WorkloadError(f"{p}: a trace needs at least two different 'timestamp' values "
                            "(it is replayed at a rate scaled from their spacing)")
    if stamped:  # arrival order, first at 0: epoch or offset timestamps replay the same
        parsed.sort(key=lambda item: item[0].arrival_s or 0.0)
        first = parsed[0][0].arrival_s or 0.0
        parsed = [(replace(s, arrival_s=(s.arrival_s or 0.0) - first), t, w) for s, t, w in parsed]
    return JsonlWorkload(tuple(_number_turns(p, parsed)), name=p.stem)
