"""The package's declared dependencies and how `make` installs them.

pyproject.toml declares compatible ranges (a library must install next to other packages);
constraints.txt pins the exact set the tests ran with, and `make` installs with it. `make
train` installs the package without extras, `make test` with the dev extras; each install is
redone only when pyproject.toml or constraints.txt changes. (.ci/wheel_check.sh builds the
wheel and trains from it in a fresh venv: `make wheel-check`.)
"""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
NAME = canonicalize_name(PROJECT["name"])


def _requirements() -> dict[str, list[Requirement]]:
    """"base" and each extra -> its requirements, without the extras' references to jaxppo."""
    groups = {"base": PROJECT["dependencies"], **PROJECT["optional-dependencies"]}
    return {group: [r for r in map(Requirement, reqs) if canonicalize_name(r.name) != NAME]
            for group, reqs in groups.items()}


def _self_extras(extra: str) -> set[str]:
    """The extras of jaxppo that `extra` pulls in (`jaxppo[a,b]` entries)."""
    reqs = map(Requirement, PROJECT["optional-dependencies"][extra])
    return {e for r in reqs if canonicalize_name(r.name) == NAME for e in r.extras}


def _constraints() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==", f"constraints.txt: {line!r} is not an exact pin"
        pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


# ---------------------------------------------------------------------- pyproject.toml
@pytest.mark.parametrize("group", list(_requirements()))
def test_every_dependency_is_a_range_with_both_bounds(group):
    for req in _requirements()[group]:
        ops = {s.operator for s in req.specifier}
        assert ">=" in ops and "<" in ops, (
            f"{group}: {req} needs a lower bound (the tested version) and an upper one (the "
            "next release that may break), e.g. jax>=0.10.2,<0.12")


def test_six_is_a_base_dependency():
    # gymnax imports six without declaring it
    assert "six" in {canonicalize_name(r.name) for r in _requirements()["base"]}


def test_cuda_extra_is_jax_cuda12_in_jax_range():
    (cuda,) = _requirements()["cuda"]
    (jax,) = [r for r in _requirements()["base"] if r.name == "jax"]
    assert cuda.name == "jax" and cuda.extras == {"cuda12"}
    assert cuda.specifier == jax.specifier


def test_dev_extra_holds_every_other_extra_but_cuda():
    extras = set(PROJECT["optional-dependencies"])
    assert _self_extras("dev") == extras - {"dev", "cuda"}
    dev = {canonicalize_name(r.name) for r in _requirements()["dev"]}
    assert {"pytest", "pytest-xdist", "build"} <= dev


def test_every_pin_of_constraints_is_in_pyprojects_ranges():
    pins = _constraints()
    assert NAME not in pins, "constraints.txt must not pin jaxppo itself"
    for group, reqs in _requirements().items():
        for req in reqs:
            name = canonicalize_name(req.name)
            assert name in pins, f"{group}: {req.name} is not pinned in constraints.txt"
            assert req.specifier.contains(pins[name], prereleases=True), (
                f"constraints.txt pins {req.name}=={pins[name]}, outside {group}'s {req}")


# ---------------------------------------------------------------------- the Makefile
def _make_dry_run(target: str, venv: Path, changed: str | None = None, *variables: str) -> list[str]:
    """The commands `make TARGET` would run for a venv at `venv` (nothing is run), as if
    file `changed` had just been edited (make's --what-if), with make's `variables` set."""
    what_if = ["-W", changed] if changed else []
    proc = subprocess.run(["make", "-n", "-C", str(ROOT), *what_if, target, f"VENV={venv}", *variables],
                          check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def _installs(lines: list[str]) -> list[str]:
    """The commands that install the package (`-e .`, `-e ".[dev]"`), uv's or pip's."""
    return [ln for ln in lines if "pip install" in ln and " -e " in ln]


needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


@needs_make
def test_train_installs_the_package_without_extras_and_test_adds_dev(tmp_path):
    train = _installs(_make_dry_run("train", tmp_path / "venv"))
    assert len(train) == 1, train
    test_run = _make_dry_run("test", tmp_path / "venv")
    test = _installs(test_run)
    assert len(test) == 1, test
    # Each install names what it installs and the tested set, in uv's command and in pip's.
    for (line,), what in ((train, "-e ."), (test, '-e ".[dev]"')):
        uv, pip = line.split("||")
        assert "uv pip install" in uv and uv.count(f"-c constraints.txt {what};") == 1, line
        assert "pip installs instead" in pip and pip.count(f"-c constraints.txt {what};") == 1
    # a dev install serves `make train` too: it marks the base install done as well
    touched = [ln for ln in test_run if ln.startswith("touch ")]
    assert touched and ".installed-base" in touched[-1], test_run


@needs_make
def test_train_on_a_suite_installs_its_extra_once(tmp_path):
    """`make train ENV=envpool:Breakout-v5` adds the envpool extra to the package; an env of
    one's own (module:Class) or of gymnax needs none; a venv with the dev extras has them all."""
    venv = tmp_path / "venv"
    installs = _installs(_make_dry_run("train", venv, None, "ENV=envpool:Breakout-v5"))
    assert [ln.split("||")[0].split("constraints.txt ")[-1].strip() for ln in installs] == [
        "-e .; }", '-e ".[envpool]"; }'], installs
    assert len(_installs(_make_dry_run("train", venv, None, "ENV=my_envs:Corridor"))) == 1
    assert len(_installs(_make_dry_run("train", venv, None, "ENV=jaxmarl:smax:3m"))) == 2
    venv.mkdir()
    (venv / ".installed-base").touch()
    (venv / ".installed-envpool").touch()
    assert not _installs(_make_dry_run("train", venv, None, "ENV=envpool:Pong-v5"))
    (line,) = _installs(_make_dry_run("train", venv, None, "ENV=brax:ant"))
    assert '-e ".[brax]"' in line
    touched = [ln for ln in _make_dry_run("test", venv) if ln.startswith("touch ")]
    assert all(f"{venv}/.installed-{suite}" in touched[-1] for suite in (
        "brax", "jumanji", "craftax", "xminigrid", "jaxmarl", "gymnasium", "envpool")), touched


def _fake_venv(venv: Path, uv_fails: bool) -> Path:
    """A venv whose python and uv only log their arguments (to venv/log): pip's install of
    uv writes the uv, which fails when `uv_fails`."""
    bin_ = venv / "bin"
    bin_.mkdir(parents=True)
    log = venv / "log"
    uv = f'#!/bin/sh\necho "uv $*" >> {log}\n' + ("exit 1\n" if uv_fails else "")
    python = (f'#!/bin/sh\necho "python $*" >> {log}\n'
              f'case "$*" in *"install --quiet -c constraints.txt uv") '
              f"printf '%s' '{uv}' > {bin_}/uv; chmod +x {bin_}/uv;; esac\n")
    (bin_ / "python").write_text(python)
    (bin_ / "python").chmod(0o755)
    return log


@needs_make
@pytest.mark.parametrize("uv_fails", [False, True], ids=["uv", "uv-fails"])
def test_uv_installs_and_pip_does_where_uv_cannot(tmp_path, uv_fails):
    venv = tmp_path / "venv"
    log = _fake_venv(venv, uv_fails)
    proc = subprocess.run(["make", "-s", "-C", str(ROOT), f"VENV={venv}", f"{venv}/.installed-base"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == "python -m pip install --quiet -c constraints.txt uv", calls
    assert calls[1] == (f"uv pip install --quiet --python {venv}/bin/python --compile-bytecode "
                        "-c constraints.txt -e ."), calls
    pip_install = "python -m pip install --quiet -c constraints.txt -e ."
    assert (pip_install in calls) == uv_fails, calls
    assert ("uv could not install; pip installs instead" in proc.stderr) == uv_fails
    assert calls[-1] == "python -m compileall -q jaxppo" and (venv / ".installed-base").exists()


@needs_make
def test_installer_pip_installs_with_pip_alone(tmp_path):
    (line,) = _installs(_make_dry_run("train", tmp_path / "venv", None, "INSTALLER=pip"))
    assert "uv" not in line and line.endswith("pip install --quiet -c constraints.txt -e ."), line


@needs_make
def test_installs_are_redone_only_when_pyproject_or_constraints_change(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    base, dev = venv / ".installed-base", venv / ".installed-dev"
    base.touch()  # the venv of a `make train`
    assert not _installs(_make_dry_run("train", venv))
    assert _installs(_make_dry_run("test", venv)), "make test after make train adds the dev extras"
    dev.touch()
    assert not _installs(_make_dry_run("test", venv))
    assert not _installs(_make_dry_run("train", venv))
    for changed in ("pyproject.toml", "constraints.txt"):
        for target in ("train", "test"):
            assert _installs(_make_dry_run(target, venv, changed)), (target, changed)
