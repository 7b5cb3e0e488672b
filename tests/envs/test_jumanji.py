"""Jumanji envs by name ("jumanji:<Id>", jaxppo.envs.jumanji_suite): what only Jumanji has on a
6x6 Snake (observation fields flattened, its own time limit as a termination), a
MultiDiscrete action spec as one Discrete action, its own errors, and a short training run
with its run folder. The contract every suite keeps (checked against Jumanji's own reset and
step) is in tests/envs/test_suites.py. The tests that need jumanji skip without it (CI
installs it with the dev extra)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo.envs.make import make_env
from jaxppo.errors import ConfigError
from readme_commands import readme_train_config

ENV = "jumanji:Snake-v1"
ROWS = COLS = 6
TINY = jaxppo.PPOConfig(env=ENV, env_kwargs={"num_rows": ROWS, "num_cols": COLS},
                        num_envs=2, num_steps=8, num_minibatches=2, num_epochs=1,
                        total_timesteps=16, network=jaxppo.NetworkConfig((8,)),
                        compilation_cache_dir=None)
UP, RIGHT, DOWN, LEFT = 0, 1, 2, 3


def _square(head, n: int):
    """Actions that walk a 2x2 square inside the grid from `head` (never an edge)."""
    row, col = int(head[0]), int(head[1])
    h, v = (RIGHT, LEFT) if col < COLS - 1 else (LEFT, RIGHT)
    d, u = (DOWN, UP) if row < ROWS - 1 else (UP, DOWN)
    return jnp.asarray([h, d, v, u] * (n // 4 + 1), jnp.int32)[:n]


def test_observations_are_snakes_fields_flattened():
    pytest.importorskip("jumanji")
    spec = make_env(TINY)
    assert spec.env.obs_parts == (("grid", (ROWS, COLS, 5)), ("step_count", ()),
                                  ("action_mask", (4,)))


def test_jumanji_time_limit_is_its_termination():
    """Snake ends its own time limit with discount 0: a termination, as Jumanji says."""
    pytest.importorskip("jumanji")
    short = make_env(TINY.replace(env_kwargs={**TINY.env_kwargs, "time_limit": 3}))
    assert short.env_params.max_steps_in_episode == 3  # jaxppo's limit follows time_limit
    env, params = short.env, short.env_params
    _, state = env.reset(jax.random.PRNGKey(3), params)
    head = state.jumanji_state.head_position
    ends = []
    for a in _square((head.row, head.col), 3):
        _, state, _, term, trunc, _ = env.step(jax.random.PRNGKey(4), state, a, params)
        ends.append((bool(term), bool(trunc)))
    assert ends == [(False, False), (False, False), (True, False)]


def test_a_multidiscrete_action_is_one_discrete_action():
    pytest.importorskip("jumanji")
    spec = make_env(TINY.replace(env="jumanji:Minesweeper-v0", env_kwargs={}))
    assert spec.discrete and spec.action_dim == 100  # [row, col] on a 10x10 board
    env, params = spec.env, spec.env_params
    _, state = env.reset(jax.random.PRNGKey(0), params)
    _, _, reward, *_ = env.step(jax.random.PRNGKey(1), state, jnp.int32(37), params)
    _, ts = env.jumanji_env.step(state.jumanji_state, jnp.asarray([3, 7], jnp.int32))
    assert float(reward) == float(ts.reward)


def test_errors_name_the_fix():
    pytest.importorskip("jumanji")
    with pytest.raises(ConfigError, match=r"jumanji.make\('Snake-v1', num_rowz=6\) raised"):
        make_env(TINY.replace(env_kwargs={"num_rowz": 6}))
    with pytest.raises(ConfigError, match=r"MultiDiscreteArray .* combinations.*up to 4096"):
        make_env(TINY.replace(env="jumanji:JobShop-v0", env_kwargs={}))
    with pytest.raises(ConfigError, match=r"action spec is BoundedArray\(shape=\(2,\)"):
        make_env(TINY.replace(env="jumanji:MultiCVRP-v0", env_kwargs={}))
    with pytest.raises(ConfigError, match=r"reward is an array of shape \(2,\) \(one per agent"):
        make_env(TINY.replace(env="jumanji:LevelBasedForaging-v0", env_kwargs={}))


@pytest.mark.slow
def test_ppo_learns_to_stay_on_the_grid_and_eat(tmp_path):
    pytest.importorskip("jumanji")
    # README's command without Snake's action mask: the mask keeps even a random snake on the
    # grid (every episode already lasts the 64-step limit), so learning to stay on it is
    # measured unmasked.
    cfg = readme_train_config(ENV).replace(compilation_cache_dir=None, mask_actions=False)
    result = jaxppo.train(cfg, run_dir=tmp_path / "run", progress=False, plot=False)
    returns = np.asarray(result.metrics["episode_return_mean"]).reshape(-1)
    lengths = np.asarray(result.metrics["episode_length_mean"]).reshape(-1)
    # A random snake leaves the 5x5 grid after ~6 steps, eating ~0.15 fruit; after 20
    # iterations (~8 s) it stays ~30 steps and eats ~0.9.
    assert np.nanmean(lengths[-5:]) > 2 * np.nanmean(lengths[:3]), lengths
    assert np.nanmean(returns[-5:]) > 2 * np.nanmean(returns[:3]), returns
    assert f"env: {ENV}" in (tmp_path / "run" / "config.yaml").read_text()
    policy = jaxppo.load_policy(tmp_path / "run")  # the env rebuilt from config.yaml by name
    assert policy.evaluate(episodes=2)["episodes"] == 2
