"""Overcooked's sparse return and dishes as metrics, against JaxMARL's own Overcooked stepped
in a plain Python loop with the same keys and actions: the adapter's episode values of a
scripted episode that delivers dishes, evaluation (which plays the game unshaped) with the
scripted actions, and the training metrics of a rollout whose envs start with a soup in hand
at the serving counter. Skips without jaxmarl."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo.core import ppo
from jaxppo.core.algorithm import Algorithm
from jaxppo.core.evaluation import run_episodes, summarize
from jaxppo.core.hyperparams import HyperParams
from jaxppo.envs.make import make_env

pytest.importorskip("jaxmarl")

ENV = "jaxmarl:overcooked:cramped_room"
UP, DOWN, RIGHT, LEFT, STAY, INTERACT = range(6)
# agent_0 on cramped_room, from its start (1, 1) facing left: three onions from the pile on
# its left into the pot above (2, 1), a plate from the pile below (1, 2), the cooked soup
# (20 steps) out of the pot, the soup onto the serving counter below (3, 2), back to (1, 1).
ONION = [LEFT, INTERACT, RIGHT, UP, INTERACT, LEFT]
DISH = ONION * 3 + [DOWN, DOWN, INTERACT, UP, RIGHT, UP] + [STAY] * 20 + [INTERACT]
DISH += [DOWN, RIGHT, DOWN, INTERACT]
SERVE = len(DISH) - 1  # the step that delivers
CYCLE = DISH + [LEFT, UP, LEFT]
EPISODE = 2 * len(CYCLE) + 6  # jaxppo's time limit: two dishes, then 6 steps


def scripted_actions(steps: int) -> np.ndarray:
    """[steps, 2] int32: agent_0 plays CYCLE over and over, agent_1 stays."""
    a0 = (CYCLE * (steps // len(CYCLE) + 1))[:steps]
    return np.stack([a0, [STAY] * steps], axis=1).astype(np.int32)


@pytest.fixture(scope="module")
def jaxmarl_step():
    """JaxMARL's own Overcooked (cramped_room), its step_env and reset, compiled once."""
    from jaxppo.envs.jaxmarl_suite import import_jaxmarl

    layout = import_jaxmarl("jaxmarl.environments.overcooked").overcooked_layouts[
        "cramped_room"]
    marl = import_jaxmarl().make("overcooked", layout=layout)
    return marl, jax.jit(marl.step_env), jax.jit(marl.reset)


def jaxmarl_episode(jaxmarl_step, marl_state, keys, actions):
    """JaxMARL's own step_env in a plain loop from `marl_state` with the step keys [T] and
    actions [T, 2]: the sum over agents of its (sparse) rewards at each step [T], the
    dishes delivered at each step [T], counted as the steps whose reward is positive (each
    such reward is one dish's 20), and the shaped rewards of each step [T] (summed over
    agents)."""
    marl, step, _ = jaxmarl_step
    team, dishes, shaped = [], [], []
    for key, action in zip(keys, actions):
        acts = {a: jnp.int32(action[i]) for i, a in enumerate(marl.agents)}
        _, marl_state, reward, _, info = step(key, marl_state, acts)
        r = np.array([reward[a] for a in marl.agents], np.float64)
        assert np.all((r == 0) | (r == 20))  # one delivery at most per step here
        team.append(r.sum())
        dishes.append(float(r[0] > 0))
        shaped.append(sum(float(info["shaped_reward"][a]) for a in marl.agents))
    return np.asarray(team), np.asarray(dishes), np.asarray(shaped)


@pytest.fixture(scope="module")
def spec():
    return make_env(jaxppo.PPOConfig(env=ENV, env_kwargs={"shaped_reward_steps": 300,
                                                          "max_steps_in_episode": EPISODE}))


def scripted_step(actions):
    """run_episodes' policy that plays `actions` [T, 2] in every env, its carry the step."""
    table = jnp.asarray(actions)

    def step(obs, key, t):
        return jnp.broadcast_to(table[t[0]], obs.shape[:2]), t + 1

    return step


def test_evaluation_plays_the_unshaped_game(spec, jaxmarl_step):
    """Evaluation of the scripted episode (two dishes): the return is JaxMARL's sparse team
    return (the eval params switch the shaping off), and so are eval_sparse_return_mean and
    the dishes, though the episode earns shaped rewards (onions in the pot, plates, soups)."""
    actions = scripted_actions(EPISODE)
    key = jax.random.PRNGKey(3)
    play = jax.jit(lambda p: run_episodes(scripted_step(actions), spec.env, p, key, 1, EPISODE,
                                          jnp.zeros((1,), jnp.int32), num_agents=2))
    stats = play(spec.eval_params)
    metrics = stats.metrics(spec.agents, spec.episode_values)
    k_reset, k = jax.random.split(key)
    step_keys = []
    for _ in range(EPISODE):  # run_episodes' keys, then the adapter's split
        k, _, k_step = jax.random.split(k, 3)
        step_keys.append(jax.random.split(jax.random.split(k_step, 1)[0])[0])
    marl_state = jaxmarl_step[2](jax.random.split(k_reset, 1)[0])[1]
    team, dishes, shaped = (x.sum() for x in jaxmarl_episode(jaxmarl_step, marl_state,
                                                             step_keys, actions))
    assert dishes == 2 and team == 80 and shaped > 0
    assert float(metrics["eval_return_mean"]) == float(metrics["eval_sparse_return_mean"]) == team
    assert float(metrics["eval_dishes_mean"]) == dishes
    assert summarize(stats, spec.agents, spec.episode_values)["episode_value_mean"] == {
        "sparse_return": team, "dishes": dishes}


def test_training_metrics_count_the_dishes_of_the_ended_episodes(jaxmarl_step):
    """A rollout of 8 envs that start with agent_0 holding a soup at the serving counter,
    episodes cut after 4 steps, 8 steps: sparse_return_mean and dishes_mean are the means
    over the ended episodes (two per env, the second from a fresh reset) of JaxMARL's sparse
    rewards and dishes with the rollout's keys and actions, the shaped reward left out."""
    T, LIMIT = 8, 4
    cfg = jaxppo.PPOConfig(env=ENV, num_envs=8, num_steps=T, num_minibatches=2, num_epochs=1,
                           total_timesteps=64, network=jaxppo.NetworkConfig((8,)),
                           env_kwargs={"shaped_reward_steps": 100, "max_steps_in_episode": LIMIT},
                           compilation_cache_dir=None)
    algo = Algorithm.create(jaxppo.resolve(cfg))
    env, (marl, marl_step, marl_reset) = algo.spec.env, jaxmarl_step
    hp = HyperParams.from_config(cfg)
    state = jax.jit(lambda k: ppo.init(algo, k, hp))(jax.random.PRNGKey(1))
    # The script up to the delivery: the soup in hand, facing the serving counter.
    obs, marl_state = marl_reset(jax.random.PRNGKey(2))
    for t, action in enumerate(scripted_actions(SERVE)):
        acts = {a: jnp.int32(action[i]) for i, a in enumerate(marl.agents)}
        obs, marl_state = marl_step(jax.random.PRNGKey(t), marl_state, acts)[:2]
    start = jax.tree.map(lambda x: x[0], state.env_state).replace(marl_state=marl_state)
    tile = lambda x: jnp.broadcast_to(x, (cfg.num_envs,) + jnp.shape(x))  # noqa: E731
    state = state.replace(env_state=jax.tree.map(tile, start),
                          last_obs=algo.spec.to_actors(tile(env.stack(obs))))

    @jax.jit
    def rollout(s):
        traj = ppo.rollout(algo, s, hp)[1]
        return ppo.agent_metrics(algo, ppo.gather_rollout_stats(algo, traj)), traj.action

    metrics, action = rollout(state)
    _, env_keys = ppo.rollout_noise(algo, jax.random.split(state.rng)[1], state.env_ids)
    actions = np.asarray(action).reshape(T, cfg.num_envs, 2)  # actors env-major
    team, dishes = [], []
    for e in range(cfg.num_envs):
        keys = [jax.random.split(env_keys[t, e]) for t in range(T)]  # (step, reset) keys
        first = jaxmarl_episode(jaxmarl_step, marl_state, [k[0] for k in keys[:LIMIT]],
                                actions[:LIMIT, e])
        fresh = marl_reset(keys[LIMIT - 1][1])[1]
        second = jaxmarl_episode(jaxmarl_step, fresh, [k[0] for k in keys[LIMIT:]],
                                 actions[LIMIT:, e])
        for r, d, _ in (first, second):
            team.append(r.sum())
            dishes.append(d.sum())
    assert 0 < np.sum(dishes) < cfg.num_envs  # some envs delivered, some did not
    np.testing.assert_allclose(float(metrics["sparse_return_mean"]), np.mean(team), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["dishes_mean"]), np.mean(dishes), rtol=1e-6)
    assert algo.agent_metric_keys[-2:] == ("sparse_return_mean", "dishes_mean")
    assert algo.eval_metric_keys[-2:] == ("eval_sparse_return_mean", "eval_dishes_mean")


def test_progress_line_shows_the_dishes(capsys):
    from jaxppo.run.progress import Reporter

    reporter = Reporter(jaxppo.PPOConfig(env=ENV), 4, progress=None, team=True, value="dishes")
    rows = [{"episode_return_mean": 40.0, "dishes_mean": 1.0, "iteration": 1},
            {"episode_return_mean": 120.0, "dishes_mean": 2.0, "iteration": 2}]
    reporter.update(2, rows, 100.0)
    assert "team return 80.0  dishes 1.5" in capsys.readouterr().err
