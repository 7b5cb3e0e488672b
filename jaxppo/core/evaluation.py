"""Policy evaluation: run a batch of eval envs until each has finished one episode.

`run_episodes` is a pure, jit-able function of arrays (it runs inside the training program
for in-training evaluation, and on its own for `jaxppo eval` and `Policy.evaluate`). Every
eval env plays exactly one episode; envs that finish early keep stepping (gymnax auto-resets)
but are masked, and a `lax.while_loop` stops once all are done or after `max_steps` steps.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.errors import ConfigError

# fold_in tag that turns a training key into an evaluation key without consuming it, so the
# training random stream is the same with evaluation on or off.
EVAL_KEY_TAG = 0x0E7A1

EVAL_METRIC_KEYS = ("eval_return_mean", "eval_return_std", "eval_length_mean")


class EpisodeStats(NamedTuple):
    """Per-episode results, one entry per eval env: returns [N] float32 (a multi-agent env's
    team return), lengths [N] int32; a multi-agent env's per-agent returns [N, agents]
    float32, whether each episode was won ([N] bool, an env that reports wins) and its
    episode values ([N, K] float32, an env with `episode_values`); None otherwise."""

    returns: jax.Array
    lengths: jax.Array
    agent_returns: jax.Array | None = None
    won: jax.Array | None = None
    values: jax.Array | None = None

    def metrics(self, agents: tuple[str, ...] = (), values: tuple[str, ...] = ()) -> dict:
        """eval_return_mean/std and eval_length_mean (scalars); with a multi-agent env's
        `agents` (names) each agent's eval_return_mean/<agent>, eval_win_rate where the env
        reports wins, and eval_<name>_mean of each of its episode `values` (names)."""
        out = {
            "eval_return_mean": jnp.mean(self.returns),
            "eval_return_std": jnp.std(self.returns),
            "eval_length_mean": jnp.mean(self.lengths.astype(jnp.float32)),
        }
        if self.agent_returns is not None:
            means = jnp.mean(self.agent_returns, axis=0)
            out.update({f"eval_return_mean/{a}": means[i] for i, a in enumerate(agents)})
        if self.won is not None:
            out["eval_win_rate"] = jnp.mean(self.won.astype(jnp.float32))
        if self.values is not None:
            means = jnp.mean(self.values, axis=0)
            out.update({f"eval_{v}_mean": means[i] for i, v in enumerate(values)})
        return out


def eval_metric_keys(agents: tuple[str, ...] = (), wins: bool = False,
                     values: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The keys `EpisodeStats.metrics` gives for an env with these agents (names; () for a
    single-agent env) that reports wins or not, and has these episode values (names)."""
    return (EVAL_METRIC_KEYS + tuple(f"eval_return_mean/{a}" for a in agents)
            + (("eval_win_rate",) if wins else ()) + tuple(f"eval_{v}_mean" for v in values))


def run_episodes(
    step: Callable[[jax.Array, jax.Array, Any], tuple[jax.Array, Any]],
    env: Any,
    env_params: Any,
    key: jax.Array,
    num_episodes: int,
    max_steps: int,
    carry: Any = (),
    action_mask: Callable | None = None,
    num_agents: int = 0,
) -> EpisodeStats:
    """Play one episode in each of `num_episodes` envs; pure and jit-able.

    step(obs [N, *obs_shape], key, carry) -> (env actions [N, ...], carry): the policy, with
    the carry it keeps from step to step (a recurrent network's state, [N, ...], starting at
    `carry`; () for a feed-forward one). With `action_mask` (one env's `action_mask(state,
    params)`), step takes a fourth argument, the legal actions [N, A] of each env. An episode
    ends at the env's terminated or truncated flag, or after `max_steps` steps (whatever it
    has collected by then counts). A multi-agent env (`num_agents` > 0: obs [N, agents, ...],
    rewards [N, agents]) returns the team return, the sum of its agents' returns, as training
    reports it, beside each agent's return, the wins of an env that reports them
    (`env.reports_wins`, info["won"]), and the episode values of an env that has them
    (`env.episode_values`, info["episode_values"]).
    """
    k_reset, k_loop = jax.random.split(key)
    obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
        jax.random.split(k_reset, num_episodes), env_params)
    zeros_f = jnp.zeros((num_episodes,), jnp.float32)
    zeros_i = jnp.zeros((num_episodes,), jnp.int32)
    done0 = jnp.zeros((num_episodes,), bool)
    wins = num_agents > 0 and bool(getattr(env, "reports_wins", False))
    n_values = len(getattr(env, "episode_values", ())) if num_agents else 0
    # A multi-agent env's per-agent returns [N, agents], wins [N] and episode values [N, K];
    # nothing otherwise.
    extra0 = ((jnp.zeros((num_episodes, num_agents), jnp.float32),) if num_agents else ()) + (
        (done0,) if wins else ()) + (
        (jnp.zeros((num_episodes, n_values), jnp.float32),) if n_values else ())

    def cond(loop):
        t, _, _, _, _, _, _, done, _ = loop
        return jnp.logical_and(t < max_steps, ~jnp.all(done))

    def body(loop):
        t, k, obs, env_state, carry, ret, length, done, extra = loop
        k, k_act, k_step = jax.random.split(k, 3)
        if action_mask is None:
            action, carry = step(obs, k_act, carry)
        else:
            mask = jax.vmap(action_mask, in_axes=(0, None))(env_state, env_params)
            action, carry = step(obs, k_act, carry, mask)
        obs, env_state, reward, term, trunc, info = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
            jax.random.split(k_step, num_episodes), env_state, action, env_params)
        reward = reward.astype(jnp.float32)
        live = ~done
        if num_agents:  # a multi-agent env's [N, agents]: each agent's, and the team's reward
            extra = (extra[0] + jnp.where(live[:, None], reward, 0.0),) + extra[1:]
            reward = jnp.sum(reward, axis=-1)
        if wins:
            extra = extra[:1] + (jnp.logical_or(extra[1], jnp.logical_and(live, info["won"])),
                                 ) + extra[2:]
        if n_values:  # nonzero on the step that ends an episode only
            extra = extra[:-1] + (extra[-1] + jnp.where(live[:, None], info["episode_values"],
                                                        0.0),)
        ret = ret + jnp.where(live, reward, 0.0)
        length = length + live.astype(jnp.int32)
        done = jnp.logical_or(done, jnp.logical_or(term.astype(bool), trunc.astype(bool)))
        return t + 1, k, obs, env_state, carry, ret, length, done, extra

    loop = (jnp.asarray(0, jnp.int32), k_loop, obs, env_state, carry, zeros_f, zeros_i, done0,
            extra0)
    out = jax.lax.while_loop(cond, body, loop)
    extra = out[8]
    return EpisodeStats(out[5], out[6], extra[0] if num_agents else None,
                        extra[1] if wins else None, extra[-1] if n_values else None)


def eval_max_steps(config, env_params) -> int:
    """The bound on an eval episode: config.eval_max_steps, else the env's time limit."""
    if config.eval_max_steps is not None:
        return int(config.eval_max_steps)
    limit = getattr(env_params, "max_steps_in_episode", None)
    if limit is None:
        raise ConfigError(
            f"{config.env_name} has no max_steps_in_episode param, so evaluation needs a bound: "
            "set eval_max_steps (e.g. eval_max_steps=1000); of a saved run, `jaxppo eval "
            "--max-steps N` or `policy.evaluate(max_steps=N)`"
        )
    return int(limit)


def summarize(stats: EpisodeStats, agents: tuple[str, ...] = (),
              values: tuple[str, ...] = ()) -> dict:
    """Host-side summary: mean/std of returns and lengths over the episodes (floats); for a
    multi-agent env (its `agents`' names) the return is the team's, and `agent_return_mean`
    maps each agent to its mean return, with `win_rate` where the env reports wins and
    `episode_value_mean` mapping each of its episode `values` (names) to its mean."""
    r = np.asarray(stats.returns, np.float64)
    n = np.asarray(stats.lengths, np.float64)
    out = {
        "episodes": int(r.size),
        "return_mean": float(r.mean()),
        "return_std": float(r.std()),
        "length_mean": float(n.mean()),
        "length_std": float(n.std()),
    }
    if stats.agent_returns is not None:
        means = np.asarray(stats.agent_returns, np.float64).mean(axis=0)
        out["agent_return_mean"] = {a: float(m) for a, m in zip(agents, means)}
    if stats.won is not None:
        out["win_rate"] = float(np.mean(np.asarray(stats.won, np.float64)))
    if stats.values is not None:
        means = np.asarray(stats.values, np.float64).mean(axis=0)
        out["episode_value_mean"] = {v: float(m) for v, m in zip(values, means)}
    return out
