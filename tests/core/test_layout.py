"""Devices by default: the CPU device count set on import (one per core), the layout
num_devices="auto" picks, and seeds split over devices giving the numbers of one device.

The auto choice is a pure function (no devices, no compile). What needs a fresh JAX runs in
subprocesses: the import-time device count under each setting, and (this file run as a script,
with 2 forced CPU devices) training with seeds split over 2 devices against 1 device, with
resumes from one layout to the other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from jaxppo.config import PPOConfig
from jaxppo.program.layout import MIN_ENVS_PER_DEVICE, Layout, auto_layout, describe_layout


# ---------------------------------------------------------------------- the auto choice
@pytest.mark.parametrize("seeds, envs, devices, pbt, expected", [
    (16, 4, 2, False, Layout(2, by_seed=True)),   # seeds over devices, no collective
    (16, 4, 16, False, Layout(16, by_seed=True)),
    (6, 4, 4, False, Layout(3, by_seed=True)),    # the most devices that divide num_seeds
    (3, 4, 2, False, Layout(1)),                  # 3 seeds do not split over 2: one device
    (2, 4, 1, False, Layout(1)),                  # one device
    (1, 4, 2, False, Layout(1)),                  # few envs: splitting them does not pay
    (1, 2 * MIN_ENVS_PER_DEVICE, 2, False, Layout(2)),      # enough envs on each: split
    (1, 2 * MIN_ENVS_PER_DEVICE - 2, 2, False, Layout(1)),  # just too few
    (1, 3 * MIN_ENVS_PER_DEVICE, 4, False, Layout(3)),      # a divisor of num_envs
    (2, 64 * MIN_ENVS_PER_DEVICE, 16, False, Layout(16)),   # envs split uses more devices
    (2, 4 * MIN_ENVS_PER_DEVICE, 2, False, Layout(2, by_seed=True)),  # a tie: seeds
    (8, 4, 2, True, Layout(2)),                   # PBT: members over devices
    (6, 4, 4, True, Layout(3)),
    (3, 4, 2, True, Layout(1)),
])
def test_auto_layout(seeds, envs, devices, pbt, expected):
    assert auto_layout(seeds, envs, devices, pbt) == expected


def test_auto_layout_keeps_a_recurrent_policys_minibatches_whole():
    """Each device's envs must be a multiple of num_minibatches for a recurrent policy."""
    envs = 2 * MIN_ENVS_PER_DEVICE + 8  # on 2 devices: 4 more than the threshold each
    assert auto_layout(1, envs, 2, env_multiple=4) == Layout(2)
    assert auto_layout(1, envs, 2, env_multiple=8) == Layout(1)


def test_describe_layout():
    cfg = PPOConfig(num_seeds=16, num_envs=4)
    assert (describe_layout(cfg, Layout(2, by_seed=True), "cpu")
            == "16 seeds over 2 CPU devices (8 each, no collectives)")
    assert describe_layout(cfg, Layout(), "cpu") == "16 seeds, vmapped, one CPU device"
    assert (describe_layout(PPOConfig(num_envs=64), Layout(2), "gpu")
            == "64 envs over 2 GPU devices (32 each, gradients all-reduced)")


def test_num_devices_accepts_auto_null_and_integers():
    assert PPOConfig().num_devices == "auto"
    for value in ("auto", None, 2):
        PPOConfig(num_devices=value).validate()
    for value in ("all", 0, True):
        with pytest.raises(Exception, match="num_devices"):
            PPOConfig(num_devices=value).validate()


# ---------------------------------------------------------------------- import-time devices
FLAG = "--xla_force_host_platform_device_count=2"


@pytest.mark.parametrize("environ, jax_count, platforms, expected", [
    ({}, -1, None, ("set", "cores")),                               # one device per core
    ({"JAXPPO_CPU_DEVICES": "3"}, -1, None, ("set", 3)),
    ({"JAXPPO_CPU_DEVICES": "auto"}, -1, None, ("set", "cores")),
    ({"JAXPPO_CPU_DEVICES": "1"}, -1, None, ("off", 1)),             # turned off
    ({"XLA_FLAGS": FLAG}, -1, None, ("user", "cores")),              # the user's choice
    ({"XLA_FLAGS": f"--xla_cpu_use_thunk_runtime=true {FLAG}"}, -1, None, ("user", "cores")),
    ({}, 4, None, ("user", "cores")),                                # jax_num_cpu_devices set
    ({"JAX_PLATFORMS": "cuda"}, -1, None, ("platform", "cores")),     # not a CPU run
    ({}, -1, "gpu,cpu", ("platform", "cores")),
    ({"JAX_PLATFORMS": "cpu"}, -1, None, ("set", "cores")),
])
def test_device_count_plan(monkeypatch, environ, jax_count, platforms, expected):
    from jaxppo import cpu_devices

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 5, 7})
    action, n = cpu_devices.plan(environ, jax_count, platforms)
    assert (action, n) == (expected[0], 5 if expected[1] == "cores" else expected[1])


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_a_bad_device_count_warns_and_uses_one_device(value):
    from jaxppo import cpu_devices

    with pytest.warns(UserWarning, match=f"JAXPPO_CPU_DEVICES='{value}' is not a positive"):
        assert cpu_devices.wanted({"JAXPPO_CPU_DEVICES": value}) == 1


PROBE = ("import jax, sys; {before}import jaxppo; from jaxppo import cpu_devices; "
         "print('PROBE', jax.local_device_count(), cpu_devices.status['action']); {after}")


def _probe(env: dict, before: str = "", after: str = "") -> subprocess.Popen:
    base = {k: v for k, v in os.environ.items()
            if k not in ("JAXPPO_CPU_DEVICES", "XLA_FLAGS", "JAX_PLATFORMS")}
    return subprocess.Popen([sys.executable, "-c", PROBE.format(before=before, after=after)],
                            env={**base, "JAX_PLATFORMS": "cpu", **env}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_import_gives_jax_one_cpu_device_per_core():
    """In fresh processes: one device per core (the default), N with JAXPPO_CPU_DEVICES=N,
    the user's XLA_FLAGS kept, and a backend started before the import left as it is, with
    a note at the run that would have used more devices."""
    early = ("from jaxppo.program.resolved import resolve; "
             "resolve(jaxppo.PPOConfig(num_seeds=4, num_envs=4), 'local')")
    cases = {  # name -> (process, expected devices, expected action)
        "default": (_probe({}), len(os.sched_getaffinity(0)), "set"),
        "env var": (_probe({"JAXPPO_CPU_DEVICES": "3"}), 3, "set"),
        "XLA_FLAGS": (_probe({"JAXPPO_CPU_DEVICES": "3", "XLA_FLAGS": FLAG}), 2, "user"),
        "started": (_probe({"JAXPPO_CPU_DEVICES": "3"}, "jax.devices(); ", early), 1, "started"),
    }
    for name, (proc, devices, action) in cases.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, (name, err[-2000:])
        line = [ln for ln in out.splitlines() if ln.startswith("PROBE ")][-1]
        assert line.split()[1:] == [str(devices), action], (name, line)
        if name == "started":  # a run that would use 2 devices (4 seeds) says how to get them
            note = [ln for ln in err.splitlines() if "before jaxppo was imported" in ln]
            assert len(note) == 1 and "has 1 device(s); this run would use 2" in note[0], err
            assert "jax_num_cpu_devices" in note[0]


NOTE = "; CPU devices: jaxppo's one per core (JAXPPO_CPU_DEVICES=1 turns it off)"


@pytest.mark.parametrize("action, devices, env_var, used, backend, expected", [
    ("set", 2, None, 2, "cpu", NOTE),                   # jaxppo's devices, one per core
    ("set", 3, "3", 3, "cpu", "; CPU devices: JAXPPO_CPU_DEVICES=3"),
    ("set", 2, None, 1, "cpu", ""),                     # the run trains on one of them
    ("set", 2, None, 2, "gpu", ""),                     # not a CPU run
    ("off", 1, "1", 1, "cpu", ""),
    ("user", 2, None, 2, "cpu", ""),                    # XLA_FLAGS: the user's own devices
    ("started", 2, None, 1, "cpu", ""),
])
def test_layout_note_says_when_a_run_trains_on_jaxppos_cpu_devices(
        monkeypatch, action, devices, env_var, used, backend, expected):
    import jax

    from jaxppo import cpu_devices

    monkeypatch.setattr(cpu_devices, "status", {"action": action, "devices": devices})
    if env_var is None:
        monkeypatch.delenv("JAXPPO_CPU_DEVICES", raising=False)
    else:
        monkeypatch.setenv("JAXPPO_CPU_DEVICES", env_var)
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    assert cpu_devices.layout_note(used) == expected


@pytest.mark.parametrize("action, devices, env_var, words", [
    ("set", 2, None, ["2 CPU devices, one per core: set by jaxppo on import",
                      "JAXPPO_CPU_DEVICES=1 before the import"]),
    ("set", 3, "3", ["3 CPU devices, JAXPPO_CPU_DEVICES=3: set by jaxppo"]),
    ("set", 1, None, ["one CPU device", "may use one"]),
    ("off", 1, "1", ["one CPU device, JAX's default", "JAXPPO_CPU_DEVICES=1 turned"]),
    ("user", 2, None, ["XLA_FLAGS or jax_num_cpu_devices", "jaxppo left them"]),
    ("platform", 2, None, ["not the CPU"]),
    ("started", 2, None, ["started before jaxppo was imported", "would have set 2"]),
    ("", 1, None, ["has not run"]),
])
def test_describe_says_what_jaxppo_did_to_the_cpu_devices(monkeypatch, action, devices,
                                                          env_var, words):
    from jaxppo import cpu_devices

    monkeypatch.setattr(cpu_devices, "status", {"action": action, "devices": devices})
    if env_var is None:
        monkeypatch.delenv("JAXPPO_CPU_DEVICES", raising=False)
    else:
        monkeypatch.setenv("JAXPPO_CPU_DEVICES", env_var)
    text = cpu_devices.describe()
    assert all(w in text for w in words), text


def test_a_run_on_jaxppos_cpu_devices_says_so_in_its_layout_line():
    """In a fresh process with the default (one device per core): describe() says so, and a
    run of 4 seeds, split over 2 (or 4) of the devices, ends its layout line with where they
    come from and how to turn them off; the layout it records (TrainResult.layout) stays what
    ran where. The run is _tiny()'s: on a machine of 2 cores its program is the one split_runs
    compiles on 2 forced devices, compiled once for both."""
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("needs a machine of 2 or more cores")
    run = ("print('DESCRIBE', cpu_devices.describe()); r = jaxppo.train(jaxppo.PPOConfig."
           f"from_dict({_tiny().to_dict()!r}), progress=True, plot=False); "
           "print('RECORDED', r.layout)")
    proc = _probe({}, "", run)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    lines = dict(ln.split(" ", 1) for ln in out.splitlines() if ln.startswith(("DESCRIBE ",
                                                                              "RECORDED ")))
    assert lines["DESCRIBE"].startswith(f"{cores} CPU devices, one per core: set by jaxppo")
    devices = 4 if cores >= 4 else 2  # the most devices that divide the 4 seeds
    where = f"4 seeds over {devices} CPU devices ({4 // devices} each, no collectives)"
    assert lines["RECORDED"] == where
    assert [ln for ln in err.splitlines() if ln.startswith("layout:")] == [
        f"layout: {where}{NOTE}"], err[-2000:]


def test_refit_follows_the_cores_left_after_pinning():
    """A process pinned to fewer cores after `import jaxppo` (as a host learner is) gets one
    device per core left, if its backend has not started; once it has, nothing changes (its
    cores given back, it keeps the one device it started with)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs a machine of 2 or more cores")
    code = ("import os, jax, jaxppo; from jaxppo import cpu_devices; "
            f"before = cpu_devices.status['devices']; os.sched_setaffinity(0, {{{cores[0]}}}); "
            "cpu_devices.refit(); n = jax.local_device_count(); "
            f"os.sched_setaffinity(0, {set(cores)}); "
            "cpu_devices.refit(); print('PROBE', before, n, jax.local_device_count(), "
            "cpu_devices.status['devices'])")
    base = {k: v for k, v in os.environ.items()
            if k not in ("JAXPPO_CPU_DEVICES", "XLA_FLAGS", "JAX_PLATFORMS")}
    out = subprocess.run([sys.executable, "-c", code], env={**base, "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("PROBE ")][-1]
    assert line.split()[1:] == [str(len(cores)), "1", "1", "1"], line


# ---------------------------------------------------------------------- seeds split over devices
def _tiny():
    import jaxppo

    return jaxppo.PPOConfig(
        num_envs=4, num_steps=16, total_timesteps=4 * 16 * 6, num_seeds=4, num_minibatches=2,
        num_epochs=1, network=jaxppo.NetworkConfig((16,)), normalize_observations=True,
        eval_every=3, eval_episodes=2, log_every=3, compilation_cache_dir=None)


KEYS = ("episode_return_mean", "policy_loss", "value_loss", "kl", "entropy", "grad_norm",
        "eval_return_mean")


def _main() -> None:
    """With 2 forced CPU devices: a sweep of 4 settings split over 2 devices vs 1 device; plain
    seeds stopped after 3 iterations on one layout and resumed on the other, vs 1 device."""
    import jax

    import jaxppo
    from jaxppo.run.checkpoints import load_params_dict

    cfg, tmp, out = _tiny(), tempfile.mkdtemp(), {"devices": jax.local_device_count()}
    one = cfg.replace(num_devices=1)

    def diff(a, b):
        return {k: float(np.nanmax(np.abs(a.metrics[k] - b.metrics[k]))) for k in KEYS}

    sweep = jaxppo.HyperParams.stack([jaxppo.HyperParams.from_config(cfg.replace(lr=lr))
                                      for lr in (1e-3, 3e-4, 1e-4, 3e-3)])
    split = jaxppo.train(cfg, hparams=sweep, run_dir=f"{tmp}/split", progress=False, plot=False)
    single = jaxppo.train(one, hparams=sweep, progress=False, plot=False)
    params = load_params_dict(f"{tmp}/split/params.msgpack")
    out["sweep"] = {
        "layout": split.layout, "single_layout": single.layout, "diff": diff(split, single),
        "summary_layout": json.loads(Path(f"{tmp}/split/summary.json").read_text())["layout"],
        "params_file_obs_mean": list(np.shape(params["obs_stats"]["mean"])),
        "param_diff": max(float(np.abs(a - b).max()) for a, b in
                          zip(jax.tree.leaves(split.params), jax.tree.leaves(single.params))),
        "eval_seed3": [split.evaluate(episodes=2, policy_seed=3)["return_mean"],
                       single.evaluate(episodes=2, policy_seed=3)["return_mean"],
                       jaxppo.load_policy(f"{tmp}/split", seed_index=3).evaluate(
                           episodes=2)["return_mean"]]}
    # Plain seeds (shared hyperparameters), across layouts at a checkpoint.
    reference = jaxppo.train(one, progress=False, plot=False)
    for name, first, then in (("split_to_one", cfg, one), ("one_to_split", one, cfg)):
        jaxppo.train(first, run_dir=f"{tmp}/{name}", progress=False, plot=False,
                     stop_after_iterations=3)
        resumed = jaxppo.train(then, resume=f"{tmp}/{name}", progress=False, plot=False)
        out[name] = {"layout": resumed.layout, "resumed_from": resumed.resumed_from,
                     "diff": diff(resumed, reference)}
    print("RESULT " + json.dumps(out))


@pytest.fixture(scope="module")
def split_runs() -> dict:
    from forced_devices import run_with_devices  # tests/ is on sys.path (not in script mode)

    return run_with_devices(__file__, devices=2)  # this file as a script, on 2 CPU devices


def _assert_close(diff: dict):
    for key, d in diff.items():
        assert d < 1e-4, (key, d)


def test_sweep_split_over_devices_equals_one_device(split_runs):
    r = split_runs["sweep"]
    assert split_runs["devices"] == 2
    assert r["layout"] == "4 members over 2 CPU devices (2 each, no collectives)"
    assert r["summary_layout"] == r["layout"]
    assert r["single_layout"] == "4 members, vmapped, one CPU device"
    _assert_close(r["diff"])
    assert r["param_diff"] < 1e-5
    assert r["params_file_obs_mean"] == [4, 4]  # every seed's statistics, not one device's
    assert r["eval_seed3"][0] == r["eval_seed3"][1] == r["eval_seed3"][2]


@pytest.mark.parametrize("name, layout", [
    ("split_to_one", "4 seeds, vmapped, one CPU device"),
    ("one_to_split", "4 seeds over 2 CPU devices (2 each, no collectives)")])
def test_resume_across_layouts_continues_the_same_run(split_runs, name, layout):
    r = split_runs[name]
    assert r["layout"] == layout and r["resumed_from"] == 3
    _assert_close(r["diff"])


if __name__ == "__main__":
    _main()
