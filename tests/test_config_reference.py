"""The configuration reference: docs/configuration.md is generated from mm_serve/config.py and current."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from mm_serve.config import ServiceConfig
from mm_serve.config_reference import REGENERATE, check, collect, main, render_reference

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"


def _leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys: list[str] = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += _leaf_keys(annotation, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def test_docs_configuration_md_is_current() -> None:
    problem = check(DOC)
    assert problem is None, problem


def test_every_key_is_in_the_reference_once_with_a_description() -> None:
    rows = [row for section in collect() for row in section.rows]
    assert sorted(row.key for row in rows) == sorted(_leaf_keys(ServiceConfig))
    assert len(rows) == len(set(row.key for row in rows)) == 128
    assert [row.key for row in rows if not row.description] == []


def test_rows_carry_type_default_bounds_and_choices() -> None:
    rows = {row.key: row for section in collect() for row in section.rows}
    port = rows["api.port"]
    assert (port.type, port.default, port.allowed) == ("int", "`8000`", "≥ 0, ≤ 65535")
    assert port.description == "Port of the HTTP server (--port)."
    loop = rows["api.event_loop"]
    assert (loop.type, loop.default, loop.allowed) == ("str", "`auto`", "`auto`, `asyncio`, `uvloop`")
    nice = rows["compute.prefill_worker_nice"]
    assert (nice.type, nice.default, nice.allowed) == ("int or null", "`null`", "≥ 0, ≤ 19")
    margin = rows["admission.margin"]
    assert (margin.type, margin.default, margin.allowed) == ("float", "`-0.2`", "≥ -0.9, ≤ 100, *strict*")
    body = rows["api.max_body_bytes"]
    assert (body.default, body.allowed) == ("`67108864` (64 MiB)", "≥ 1024")
    batch_tier = rows["slo.tiers.batch.attainment"]
    assert (batch_tier.default, batch_tier.allowed) == ("`0.5`", "> 0, ≤ 1")
    assert rows["compute.prefill_cpus"].type == "list of int"
    assert rows["compute.prefill_cpus"].default == "`[]`"


def test_sections_follow_the_models() -> None:
    sections = collect()
    assert [s.prefix for s in sections] == [
        "", "compute", "scheduler", "kv_cache", "cache", "api", "fault", "slo", "slo.tiers",
        "slo.tiers.interactive", "slo.tiers.standard", "slo.tiers.batch", "admission", "batch", "cluster", "placement"]
    assert sections[1].text == "Worker counts and placement of the prefill and decode domains."


def test_table_cells_escape_pipes_and_angle_brackets() -> None:
    text = render_reference()
    assert "'&lt;node_resource>_&lt;i>'" in text
    assert "<key>" not in text


def test_check_exits_1_naming_the_command_on_a_stale_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text(render_reference().replace("`8000`", "`8001`"))
    assert main(["--check", str(stale)]) == 1
    err = capsys.readouterr().err
    assert err == f"{stale} is out of date with mm_serve/config.py; regenerate it with: {REGENERATE}\n"
    assert main(["--check", str(tmp_path / "missing.md")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_check_passes_and_print_matches(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    printed = capsys.readouterr().out
    assert printed == render_reference()
    current = tmp_path / "configuration.md"
    current.write_text(printed)
    assert main(["--check", str(current)]) == 0
    assert capsys.readouterr() == ("", "")
