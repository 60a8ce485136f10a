"""The built wheel, installed into a fresh virtualenv, gives a user's suite the plugin.

The venv reuses this environment's installed dependencies (a .pth line, so it stays fast and
offline) but not its `proxy`: an editable install is not on the path there, so everything
imported from `proxy` comes from the wheel. The build itself needs setuptools from the
package index (pip's build isolation), as any `pip install` of the project does.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

from tests.kit.external import REPO, kit_example, run_pytest


def run(*args: str | Path, cwd: Path) -> str:
    # Not in this checkout (`python -c` puts the working directory on the path) nor with its
    # PYTHONPATH.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_wheel_installs_an_opt_in_plugin_into_a_fresh_venv(tmp_path: Path) -> None:
    source = tmp_path / "src"  # a copy: building writes build/ and *.egg-info next to it
    source.mkdir()
    shutil.copytree(REPO / "proxy", source / "proxy", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "-w",
        tmp_path / "dist",
        source,
        cwd=tmp_path,
    )
    [wheel] = (tmp_path / "dist").glob("compaction_proxy-*.whl")

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    purelib = run(
        python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path
    )
    Path(purelib.strip(), "parent_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    run(python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel, cwd=tmp_path)
    where = run(python, "-c", "import proxy.testing.plugin as p; print(p.__file__)", cwd=tmp_path)
    assert where.startswith(str(venv)), where  # the wheel's copy, not this checkout

    project = tmp_path / "project"
    project.mkdir()
    (project / "test_kit_example.py").write_text(kit_example(), encoding="utf-8")
    opted_in = run_pytest(str(python), project, "-p", "compaction_proxy")
    assert opted_in.returncode == 0, opted_in.stdout + opted_in.stderr
    assert "1 passed" in opted_in.stdout
    left_out = run_pytest(str(python), project)
    assert left_out.returncode != 0
    assert "fixture 'openai_client' not found" in left_out.stdout, left_out.stdout
    assert "pytest -p compaction_proxy" in left_out.stdout  # and how to opt in

    # The example configuration is in the wheel: an install without a checkout can start.
    example = run(venv / "bin" / "compaction-proxy", "config", "example", cwd=tmp_path)
    assert example == (REPO / "config" / "proxy.example.toml").read_text(encoding="utf-8")
