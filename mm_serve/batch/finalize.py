"""A batch's results file split into its output file (successes) and error file (failed rows).

The results file holds one OpenAI batch output row per finished ``custom_id``
(:func:`mm_serve.caption.records.batch_row`), in completion order. Rows without
an error go to the output file, rows with one to the error file (OpenAI's split:
``output_file_id`` and ``error_file_id``), each in the order of the input file.
Splitting again after a restart writes the same files under the same ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mm_serve.caption.inputs import CaptionInput
from mm_serve.caption.records import row_succeeded


@dataclass(frozen=True)
class ResultRows:
    """The rows of a results file as encoded lines, by outcome, in input order."""

    succeeded: list[bytes]
    failed: list[bytes]


def count_results(path: Path) -> tuple[int, int]:
    """(rows that succeeded, rows that failed) in the results file at ``path`` (0, 0 if absent).

    The file must have been opened (repaired) by :class:`~mm_serve.caption.output.OutputFile`.
    """
    if not path.exists():
        return 0, 0
    ok = failed = 0
    with open(path, "rb") as handle:
        for line in handle:
            if line.strip():
                if row_succeeded(json.loads(line)):
                    ok += 1
                else:
                    failed += 1
    return ok, failed


def split_results(path: Path, items: list[CaptionInput]) -> ResultRows:
    """The rows of ``path`` split by outcome and put in the order of ``items`` (the input file).

    A ``custom_id`` that is not among ``items`` cannot be there (the results are
    written for these rows only) and is dropped.
    """
    lines: dict[str, bytes] = {}
    succeeded: dict[str, bool] = {}
    if path.exists():
        with open(path, "rb") as handle:
            for line in handle:
                if not line.strip():
                    continue
                row = json.loads(line)
                custom_id = str(row.get("custom_id"))
                lines[custom_id] = line if line.endswith(b"\n") else line + b"\n"
                succeeded[custom_id] = row_succeeded(row)
    ordered = [item.id for item in items if item.id in lines]
    return ResultRows(succeeded=[lines[i] for i in ordered if succeeded[i]],
                      failed=[lines[i] for i in ordered if not succeeded[i]])
