"""A run of a config this process trained before reuses that run's program (jaxppo.program
.recent): the same numbers as a program built afresh, and never for a config whose code can
change without the config changing."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from gymnax.environments.classic_control import cartpole

import jaxppo
from jaxppo.core.hyperparams import HyperParams
from jaxppo.envs.transforms import CountBonus, FrameStack, TRANSFORMS
from jaxppo.program import recent
from jaxppo.program.layout import Layout

CFG = jaxppo.PPOConfig(num_envs=4, num_steps=16, total_timesteps=4 * 16 * 3, num_minibatches=2,
                       network=jaxppo.NetworkConfig((8,)), normalize_observations=True,
                       compilation_cache_dir=None)


def _key(config, layout=None, chunk_len=1):
    resolved = jaxppo.resolve(config, layout)
    return recent._key(resolved, HyperParams.from_config(config), chunk_len)


def _same(a, b):
    for k in ("episode_return_mean", "policy_loss", "value_loss", "grad_norm"):
        np.testing.assert_array_equal(a.metrics[k], b.metrics[k], err_msg=k)
    for x, y in zip(jax.tree.leaves(a.state), jax.tree.leaves(b.state)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_second_run_reuses_the_program_and_trains_the_same(tmp_path, monkeypatch):
    recent.forget()
    fresh = jaxppo.train(CFG, progress=False)
    built = []
    monkeypatch.setattr(recent, "build_program",
                        lambda *a: built.append(a) or pytest.fail("built again"))
    again = jaxppo.train(CFG, run_dir=tmp_path / "run", progress=False, plot=False)
    _same(fresh, again)
    assert not built and len(recent._recent) == 1
    monkeypatch.undo()
    recent.forget()  # and a program built afresh gives the same numbers as the reused one
    _same(fresh, jaxppo.train(CFG, progress=False))


def test_what_changes_the_program_changes_its_key():
    base = _key(CFG)
    assert base is not None and _key(CFG) == base
    others = [_key(CFG.replace(seed=1)), _key(CFG.replace(lr=1e-3)),
              _key(CFG.replace(num_seeds=2)), _key(CFG, chunk_len=2),
              _key(CFG.replace(env="Acrobot-v1"))]
    assert len({base, *others}) == 6
    two = _key(CFG.replace(num_seeds=2), Layout(1, 2, 0))
    assert two is None  # a program of several processes is never kept


def test_a_config_naming_user_code_is_built_afresh_each_time(monkeypatch):
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, obs, carry=None, reset=None):
            raise NotImplementedError

    env = cartpole.CartPole()
    assert _key(CFG.replace(transforms=[{"count_bonus": {"scale": 0.1}}])) is not None
    for config in (CFG.replace(env=env), CFG.replace(env_params=env.default_params),
                   CFG.replace(transforms=[lambda state, traj: (state, traj.reward)]),
                   CFG.replace(transforms=[CountBonus(scale=0.1)])):
        resolved = jaxppo.resolve(config) if config.env is not env else None
        assert not recent._only_own_code(config), config
        if resolved is not None:
            assert recent._key(resolved, HyperParams.from_config(config), 1) is None
    assert not recent._only_own_code(CFG.replace(network=jaxppo.NetworkConfig(module=Net())))
    monkeypatch.setitem(TRANSFORMS, "count_bonus", FrameStack)  # a user's own under our name
    assert not recent._only_own_code(CFG.replace(transforms=[{"count_bonus": {"scale": 0.1}}]))


def test_only_the_most_recent_programs_are_kept(monkeypatch):
    recent.forget()
    monkeypatch.setattr(recent, "build_program", lambda *a: object())
    resolved = [jaxppo.resolve(CFG.replace(seed=s)) for s in range(recent.KEPT + 1)]
    hp = HyperParams.from_config(CFG)
    first = recent.program(resolved[0], hp, 1)
    for r in resolved[1:]:
        recent.program(r, hp, 1)
    assert len(recent._recent) == recent.KEPT
    assert recent.program(resolved[0], hp, 1) is not first  # the oldest was dropped
    assert recent.program(resolved[-1], hp, 1) is recent.program(resolved[-1], hp, 1)
    recent.forget()
