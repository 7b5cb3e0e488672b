"""Where imports look (jaxppo.envs.imports): the console script `jaxppo` and `python -m jaxppo`
import the same code; a file in the current folder never stands in for an installed env
suite; a user's own env module is found in the current folder by both."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHADOWED = ("gymnasium", "jumanji", "xminigrid", "gymnax", "envpool")


@pytest.fixture
def folder(tmp_path):
    """A folder with a user's env module beside files named as env suites, each of which
    leaves a marker when imported."""
    shutil.copy(REPO / "tests" / "custom_env_module.py", tmp_path / "my_envs.py")
    for name in SHADOWED:
        (tmp_path / f"{name}.py").write_text(
            f"open({str(tmp_path / ('IMPORTED-' + name))!r}, 'w').close()\n")
    return tmp_path


def _run(args, cwd, timeout=240):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_installed_suites_are_imported_whatever_lies_in_the_current_folder(folder):
    # `python -c` puts the current folder first on sys.path, as `python -m` does.
    code = ("import sys\n"
            "from jaxppo.envs.imports import import_package, import_user_module\n"
            f"for name in {SHADOWED!r}:\n"
            "    try:\n"
            "        m = import_package(name)\n"
            "    except ImportError:\n"
            "        continue  # not installed here: nothing to shadow\n"
            "    assert not m.__file__.startswith(sys.argv[1]), m.__file__\n"
            "m = import_user_module('my_envs')\n"
            "assert m.__file__.startswith(sys.argv[1]), m.__file__\n"
            "print('ok')\n")
    out = _run([sys.executable, "-c", code, str(folder)], folder)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
    assert not list(folder.glob("IMPORTED-*"))


@pytest.mark.parametrize("how", ["python -m jaxppo", "jaxppo"])
def test_own_env_module_trains_from_its_folder_either_way(folder, how):
    script = Path(sys.executable).parent / "jaxppo"
    if how == "jaxppo" and not script.exists():
        pytest.skip("the console script is not installed in this environment")
    cmd = [sys.executable, "-m", "jaxppo"] if how.startswith("python") else [str(script)]
    out = _run(cmd + ["train", "--env", "my_envs:Corridor", "--runs-dir", str(folder / "runs"),
                      "--run-name", "run", "--no-plot", "--no-progress", "--set", "num_envs=4",
                      "num_steps=8", "total_timesteps=64", "network.hidden_sizes=[8]"], folder)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (folder / "runs" / "run" / "metrics.jsonl").exists()
    # The user's module imported gymnax; the installed gymnax and what it imports, not the
    # files named like them beside it.
    assert not list(folder.glob("IMPORTED-*"))
