"""``python -m mm_serve.shapes draw``: the scene it writes matches the caption it prints."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from mm_serve.shapes.__main__ import main
from mm_serve.shapes.targets import parse_caption


def test_draw_writes_the_scene_and_prints_its_caption(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "scene.png"
    assert main(["draw", "--out", str(out), "--seed", "3", "--count", "2", "--size", "200", "120"]) == 0
    caption = capsys.readouterr().out.strip()
    shapes = parse_caption(caption)
    assert shapes is not None and len(shapes) == 2
    with Image.open(out) as image:
        assert image.size == (200, 120)
        colours = {pixel for _, pixel in image.getcolors(maxcolors=200 * 120)}  # type: ignore[union-attr]
    assert len(colours) >= 3  # background plus two filled shapes
    # same seed, same scene
    assert main(["draw", "--out", str(tmp_path / "again.png"), "--seed", "3", "--count", "2", "--size", "200", "120"]) == 0
    assert capsys.readouterr().out.strip() == caption
    assert (tmp_path / "again.png").read_bytes() == out.read_bytes()


@pytest.mark.parametrize("argv, message", [
    (["--size", "20", "600"], "--size sides must be in [48, 512]"),
    (["--out", "/nonexistent-dir/x.png"], "cannot write"),
])
def test_draw_rejects_bad_arguments(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["draw", *argv]) == 2
    assert message in capsys.readouterr().err
