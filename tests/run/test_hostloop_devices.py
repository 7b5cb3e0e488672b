"""The learner of an env that steps in Python split over devices (num_devices: N): the same
run as on one device, to float tolerance, in the host loop and the actor-learner, and resumed
from one device count on the other.

Run as a script (in a subprocess, with 2 forced CPU devices) it trains gymnasium's CartPole on
1 and 2 devices and prints what the tests compare. Tolerance: the split update averages each
device's minibatch gradient (and statistics) over the devices where one device averages the
whole minibatch at once, so float32 sums add up in another order (~1e-7 relative per step);
over a few iterations of Adam that stays well under 1e-5 on params and within 1e-4 relative
(1e-6 absolute, for the near-zero policy loss) on the metrics, as for the compiled path
(tests/core/test_pmap.py). The envs see the same actions
(the sampling noise comes from global env ids), so the episode metrics are equal exactly.
"""

from __future__ import annotations

import json
import tempfile

import numpy as np
import pytest

import jaxppo
from jaxppo.errors import ConfigError
from jaxppo.program.layout import Layout


ENV_SIDE = ("episode_return_mean", "episode_length_mean", "episodes", "env_steps", "lr",
            "eval_return_mean")
LEARNER_SIDE = ("policy_loss", "value_loss", "entropy", "kl", "approx_kl", "explained_variance",
                "grad_norm", "kl_coeff")


def _config(**kw):
    return jaxppo.PPOConfig(**{
        "env": "gymnasium:CartPole-v1", "num_envs": 8, "num_steps": 16, "num_epochs": 2,
        "num_minibatches": 2, "total_timesteps": 8 * 16 * 4, "normalize_observations": True,
        "normalize_rewards": True, "eval_every": 2, "eval_episodes": 2,
        "compilation_cache_dir": None, "network": jaxppo.NetworkConfig(hidden_sizes=(16,)), **kw})


CASES = {  # name -> the config's changes
    "lag0": {},
    "lag1": {"max_policy_lag": 1, "actor_threads": 2},
    "seeds": {"num_seeds": 2},
    "gru": {"network": jaxppo.NetworkConfig(hidden_sizes=(16,), recurrent_size=8)},
}


# At XLA's optimisation level 0 (the file's, tests/conftest.py) the GRU's one- and two-device
# programs can differ in the last bit, and a greedy evaluation episode then takes another
# action: that case compiles with full optimisation, the others (4x quicker to compile) not.
FULLY_OPTIMISED = ("gru",)


def _compare(a, b) -> dict:
    import jax

    out = {"env_side": {k: bool(np.array_equal(a.metrics[k], b.metrics[k], equal_nan=True))
                        for k in ENV_SIDE},
           "learner_side": {k: [np.asarray(a.metrics[k]).tolist(),
                                np.asarray(b.metrics[k]).tolist()] for k in LEARNER_SIDE}}
    out["param_diff"] = max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
                            for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)))
    return out


def _set_unoptimised(off: bool) -> None:
    import jax

    if jax.config.read("jax_disable_most_optimizations") != off:
        jax.clear_caches()  # programs compiled the other way are not reused
        jax.config.update("jax_disable_most_optimizations", off)


def _main() -> None:
    import jax

    tmp, out = tempfile.mkdtemp(), {"devices": jax.local_device_count()}
    unoptimised = jax.config.read("jax_disable_most_optimizations")
    for name, kw in CASES.items():
        _set_unoptimised(unoptimised and name not in FULLY_OPTIMISED)
        one = jaxppo.train(_config(num_devices=1, **kw), progress=False, plot=False)
        two = jaxppo.train(_config(num_devices=2, **kw), run_dir=f"{tmp}/{name}", progress=False,
                           plot=False)
        state = two.state  # device layout: one copy of the params per device
        out[name] = {**_compare(two, one), "layout": two.layout, "single_layout": one.layout,
                     "replicated": all(bool(np.array_equal(x[0], x[1])) for x in
                                       jax.tree.leaves(jax.device_get(state.params))),
                     "summary_layout": json.load(open(f"{tmp}/{name}/summary.json"))["layout"]}
    _set_unoptimised(unoptimised)
    # Stopped after 2 iterations on one device count and resumed on the other (the envs
    # restart on resume), against the same stop and resume on one device.
    one, two = _config(num_devices=1), _config(num_devices=2)
    results = {}
    for name, first, then in (("one_to_one", one, one), ("two_to_one", two, one),
                              ("one_to_two", one, two)):
        jaxppo.train(first, run_dir=f"{tmp}/{name}", progress=False, plot=False,
                     stop_after_iterations=2)
        results[name] = jaxppo.train(then, resume=f"{tmp}/{name}", progress=False, plot=False)
    for name in ("two_to_one", "one_to_two"):
        out[name] = {**_compare(results[name], results["one_to_one"]),
                     "resumed_from": results[name].resumed_from, "layout": results[name].layout}
    print("RESULT " + json.dumps(out))


@pytest.fixture(scope="module")
def split_runs() -> dict:
    from forced_devices import run_with_devices  # tests/ is on sys.path (not in script mode)

    return run_with_devices(__file__, devices=2)  # this file as a script, on 2 CPU devices


def _assert_same_run(r: dict) -> None:
    assert all(r["env_side"].values()), r["env_side"]
    for key, (got, expected) in r["learner_side"].items():
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6, err_msg=key)
    assert r["param_diff"] < 1e-5, r["param_diff"]


LAYOUTS = {
    "lag0": "8 envs over 2 CPU devices (4 each, gradients all-reduced); the envs step in Python "
            "and the policy acts on one device; the update is split over 2",
    "lag1": "8 envs over 2 CPU devices (4 each, gradients all-reduced); actor-learner: 2 actor "
            "threads x 4 envs (actor_threads=2), max_policy_lag 1, acting on one device, the "
            "update split over 2",
    "seeds": "8 envs over 2 CPU devices (4 each, gradients all-reduced, 2 seeds vmapped on "
             "each); the envs step in Python and the policy acts on one device; the update is "
             "split over 2",
}


@pytest.mark.parametrize("name", list(CASES))
def test_two_devices_train_as_one(split_runs, name):
    r = split_runs[name]
    assert split_runs["devices"] == 2
    _assert_same_run(r)
    assert r["replicated"]
    assert r["summary_layout"] == r["layout"]
    assert "one CPU device" in r["single_layout"] and "over 2" not in r["single_layout"]
    if name in LAYOUTS:
        assert r["layout"] == LAYOUTS[name]


@pytest.mark.parametrize("name", ["two_to_one", "one_to_two"])
def test_resume_on_another_device_count_continues_the_run(split_runs, name):
    r = split_runs[name]
    assert r["resumed_from"] == 2
    assert ("over 2 CPU devices" in r["layout"]) == (name == "one_to_two")
    _assert_same_run(r)


def test_device_counts_that_do_not_fit_name_the_fix():
    with pytest.raises(ConfigError, match=r"num_envs=8 cannot be split evenly over "
                                          r"num_devices=3.*num_devices from \[1, 2, 4, 8\]"):
        jaxppo.resolve(_config(num_devices=3), "local")
    gru = _config(num_devices=2,
                  network=jaxppo.NetworkConfig(hidden_sizes=(16,), recurrent_size=8))
    with pytest.raises(ConfigError, match=r"num_minibatches=8 does not divide the envs on each "
                                          r"device \(num_envs=8 / 2 devices = 4\)"):
        jaxppo.resolve(gru.replace(num_minibatches=8), Layout(2))
    with pytest.raises(ConfigError, match=r"sync='batch' with num_devices=2: .*use "
                                          r"sync='gradients'"):
        jaxppo.resolve(_config(num_devices=2, sync="batch"), "local")


def test_auto_keeps_the_learner_on_one_device():
    assert jaxppo.resolve(_config(num_devices="auto"), "local").layout.shards == 1


if __name__ == "__main__":
    _main()
