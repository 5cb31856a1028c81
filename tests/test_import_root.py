"""One import root: mm-serve installs only ``mm_serve``, so Hugging Face's ``kernels`` (which
transformers >= 5.25 requires) sits beside it and transformers binds to HF's, not to ours.

The collision test runs tests/import_root_probe.py in a fresh interpreter with this checkout first
on ``PYTHONPATH``. When the venv lacks HF ``kernels``, it is pip-installed into a throw-away
``--target`` folder (the version range transformers declares for it); the test is skipped only
when pip cannot reach a package registry. The wheel test builds the distribution from a copy of
the sources and reads the wheel's names and RECORD.
"""

from __future__ import annotations

import csv
import importlib.metadata
import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import transformers
from packaging.requirements import Requirement

from tests.import_root_probe import NEW_TOKENS

ROOT = Path(__file__).resolve().parents[1]
# what pip prints when no registry answers (urllib3 / socket errors); anything else is a failure
OFFLINE_MARKERS = ("NewConnectionError", "Failed to establish a new connection", "Network is unreachable",
                   "Temporary failure in name resolution", "Name or service not known",
                   "ConnectTimeoutError", "ProxyError", "No route to host")
# the inputs of the build: the package (its symlinks kept), the folders they point at, the metadata
BUILD_SOURCES = ("pyproject.toml", "README.md", "mm_serve", "kernels", "vision_prefill", "text_decode")
# folder in this checkout, file pattern, folder in the wheel that must hold them as real files
LINKED_FOLDERS = (("kernels/csrc", "*.cpp", "mm_serve/kernels/csrc"),
                  ("vision_prefill", "*.py", "mm_serve/vision_prefill"),
                  ("text_decode", "*.py", "mm_serve/text_decode"))


def kernels_requirement() -> str:
    """The ``kernels`` requirement of the installed transformers, without its marker: the hard
    dependency (transformers >= 5.25), else the one of its ``kernels`` extra, else ``"kernels"``."""
    found = "kernels"
    for text in importlib.metadata.requires("transformers") or []:
        req = Requirement(text)
        if req.name != "kernels":
            continue
        if req.marker is None:
            return f"kernels{req.specifier}"
        if req.marker.evaluate({"extra": "kernels"}):
            found = f"kernels{req.specifier}"
    return found


@pytest.fixture(scope="module")
def hf_kernels_site() -> Iterator[Path | None]:
    """None when the venv has HF ``kernels`` installed; else a temporary ``pip install --target``
    folder holding it (and its dependencies), removed after the module."""
    try:
        importlib.metadata.distribution("kernels")
        yield None
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    requirement = kernels_requirement()
    with tempfile.TemporaryDirectory(prefix="mm-serve-hf-kernels-") as tmp:
        target = Path(tmp) / "site"
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-input", "--no-compile",
               "--disable-pip-version-check", "--retries", "1", "--timeout", "20",
               "--target", str(target), requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        log = proc.stdout + proc.stderr
        offline = [line.strip() for line in log.splitlines() if any(m in line for m in OFFLINE_MARKERS)]
        if proc.returncode != 0 and offline:
            pytest.skip(f"pip could not reach a package registry to install {requirement!r}: {offline[0]}")
        assert proc.returncode == 0, f"pip install --target {requirement!r} failed:\n{log}"
        yield target


def run_probe(checkpoint: Path, site: Path | None) -> dict[str, object]:
    """Run tests/import_root_probe.py in a fresh interpreter, this checkout first on
    ``PYTHONPATH``; return its facts. Fails the test with its output if it exits non-zero."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    args = [sys.executable, "-m", "tests.import_root_probe", str(checkpoint)] + ([str(site)] if site else [])
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"probe failed:\n{proc.stdout}\n{proc.stderr}"
    line = [row for row in proc.stdout.splitlines() if row.startswith("PROBE ")][-1]
    facts: dict[str, object] = json.loads(line.removeprefix("PROBE "))
    return facts


def test_hf_kernels_transformers_and_mm_serve_work_in_one_process(
    tiny_llava: Path, hf_kernels_site: Path | None,
) -> None:
    facts = run_probe(tiny_llava, hf_kernels_site)
    assert facts["transformers"] == transformers.__version__
    # `kernels` is HF's regular package, where its distribution installed it; not this checkout's
    # kernels/ folder (C++ sources only, no __init__.py)
    assert facts["kernels_file"] is not None
    kernels_file = Path(str(facts["kernels_file"])).resolve()
    assert kernels_file == Path(str(facts["kernels_dist_file"])).resolve()
    sites = {Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib")}
    if hf_kernels_site is not None:
        sites.add(hf_kernels_site.resolve())
    assert kernels_file.parent.parent in sites
    assert kernels_file.parent != (ROOT / "kernels").resolve()
    assert facts["kernels_available"] is True
    assert facts["hub_binds_hf_kernels"] is True
    assert Path(str(facts["mm_serve_kernels_file"])).resolve() == ROOT / "mm_serve" / "kernels" / "__init__.py"
    # the same model through mm_serve and through transformers, in that process: the same tokens
    assert facts["ours"] == facts["reference"]
    assert isinstance(facts["ours"], list) and len(facts["ours"]) == NEW_TOKENS


def build_wheel(out: Path) -> Path:
    """Copy the build inputs (symlinks kept) into ``out/src``, build the wheel there with the
    venv's setuptools (no build isolation, no index), return the wheel's path."""
    src = out / "src"
    src.mkdir()
    for name in BUILD_SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
           "--no-index", "--disable-pip-version-check", "-w", str(out / "dist"), "."]
    proc = subprocess.run(cmd, cwd=src, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"pip wheel failed:\n{proc.stdout}\n{proc.stderr}"
    (wheel,) = (out / "dist").glob("mm_serve-*.whl")
    return wheel


def test_the_distribution_installs_only_mm_serve() -> None:
    with tempfile.TemporaryDirectory(prefix="mm-serve-wheel-") as tmp, \
            zipfile.ZipFile(build_wheel(Path(tmp))) as wheel:
        names = wheel.namelist()
        dist_info = "mm_serve-{}.dist-info".format(Path(str(wheel.filename)).name.split("-")[1])
        assert {name.split("/")[0] for name in names} == {"mm_serve", dist_info}
        assert wheel.read(f"{dist_info}/top_level.txt").decode().split() == ["mm_serve"]
        record = [row[0] for row in csv.reader(wheel.read(f"{dist_info}/RECORD").decode().splitlines()) if row]
        assert sorted(record) == sorted(names)
        for folder, pattern, packed in LINKED_FOLDERS:
            sources = sorted((ROOT / folder).glob(pattern))
            assert sources, f"no {pattern} in {folder}"
            inside = sorted(n for n in names if n.startswith(f"{packed}/") and "/" not in n[len(packed) + 1:])
            assert inside == [f"{packed}/{path.name}" for path in sources]
            for path in sources:
                info = wheel.getinfo(f"{packed}/{path.name}")
                assert stat.S_ISREG(info.external_attr >> 16), f"{info.filename} is not a plain file"
                assert wheel.read(info) == path.read_bytes()
