"""The package as a user installs it: the wheel holds every module of the source tree, the
``py.typed`` marker (so type checkers read our annotations) and the license, and an installed
copy imports and collects from outside the source tree."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

from procs import child_env

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_wheel_holds_the_package_its_type_marker_and_license_and_imports(tmp_path):
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("aiocollect-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {f"aiocollect/{p.name}" for p in (ROOT / "aiocollect").glob("*.py")}
    assert sources <= names, f"modules missing from the wheel: {sorted(sources - names)}"
    assert "aiocollect/py.typed" in names
    assert any(n.endswith(".dist-info/LICENSE") or "/licenses/LICENSE" in n for n in names), sorted(names)
    site = tmp_path / "site"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        capture_output=True, text=True, timeout=240,
    )
    assert installed.returncode == 0, installed.stderr
    script = (
        "import aiocollect, anyio\n"
        "from aiocollect import Collector\n"
        "print(aiocollect.__file__)\n"
        "async def main():\n"
        "    async with Collector('CartPole-v1', frames_per_batch=16, total_frames=32, num_workers=1) as c:\n"
        "        print(sum([b.numel() async for b in c]))\n"
        "anyio.run(main)\n"
    )
    env = child_env(site)  # the wheel first: imported instead of a source tree on PYTHONPATH
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env=env)
    assert out.returncode == 0, out.stderr
    first, frames = out.stdout.split()[:2]
    assert first.startswith(str(site)), f"imported {first}, not the installed wheel"
    assert frames == "32"
