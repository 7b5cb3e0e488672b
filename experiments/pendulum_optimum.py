"""How well can any policy do on gymnax's Pendulum-v1? An independent reference for the table.

    .venv/bin/python experiments/pendulum_optimum.py            # 401x401 grid, about a minute
    .venv/bin/python experiments/pendulum_optimum.py --grid 601 # finer, about two minutes

Finite-horizon (200-step, undiscounted) value iteration on a (theta, theta_dot) grid with
bilinear interpolation and a discrete torque set, then the greedy time-dependent policy
(one-step lookahead on the interpolated value) is played on gymnax's own Pendulum dynamics
from gymnax's reset distribution. Its mean return is achievable, so it bounds the optimum
from below; the grid value averaged over reset states is the approximate optimum.
It also shows how far a 164-episode mean (gymnax-blines' evaluation) scatters with a fixed,
near-optimal policy. Writes experiments/results/pendulum-optimum.json.

    .venv/bin/python experiments/pendulum_optimum.py --policy runs/<run>   # compare a run

With --policy, a trained jaxppo policy (deterministic, each seed of the run) plays the same
reset states as the greedy policy, and the return gap is broken down by the starting angle:
this shows where a policy loses against the optimum. It also counts the episodes that "fall
back": the pendulum comes within 0.7 rad of upright and later hangs more than 2 rad from it
again, a swing-up given up near the top that costs a lap (and the share of the worst tenth
of episodes where the policy fell back and the greedy policy did not); and how many steps
later than the greedy policy it first comes within 0.3 rad of upright.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import jax
import jax.numpy as jnp

from jaxppo.envs.gymnax_import import import_gymnax

ROOT = Path(__file__).resolve().parent.parent
HORIZON = 200


def angle_normalize(x):
    return ((x + jnp.pi) % (2 * jnp.pi)) - jnp.pi


def transition(p, theta, theta_dot, u):
    """Reward and next state, written out from the Pendulum-v1 equations."""
    u = jnp.clip(u, -p.max_torque, p.max_torque)
    reward = -(angle_normalize(theta) ** 2 + 0.1 * theta_dot**2 + 0.001 * u**2)
    accel = 3 * p.g / (2 * p.l) * jnp.sin(theta) + 3.0 / (p.m * p.l**2) * u
    new_dot = jnp.clip(theta_dot + accel * p.dt, -p.max_speed, p.max_speed)
    return reward, theta + new_dot * p.dt, new_dot


def make_interp(n_theta: int, n_dot: int, max_speed: float):
    """Bilinear interpolation on a grid periodic in theta and clamped in theta_dot."""
    d_theta = 2 * np.pi / n_theta
    d_dot = 2 * max_speed / (n_dot - 1)

    def interp(v, theta, theta_dot):
        x = (angle_normalize(theta) + jnp.pi) / d_theta
        x0 = jnp.floor(x)
        fx = x - x0
        i0 = x0.astype(jnp.int32) % n_theta
        i1 = (i0 + 1) % n_theta
        y = (jnp.clip(theta_dot, -max_speed, max_speed) + max_speed) / d_dot
        j0 = jnp.clip(jnp.floor(y).astype(jnp.int32), 0, n_dot - 2)
        fy = jnp.clip(y - j0, 0.0, 1.0)
        j1 = j0 + 1
        return ((1 - fx) * (1 - fy) * v[i0, j0] + fx * (1 - fy) * v[i1, j0]
                + (1 - fx) * fy * v[i0, j1] + fx * fy * v[i1, j1])

    return interp


def solve(p, n: int, n_torques: int):
    """Value iteration: (values [HORIZON + 1, n, n] with values[k] = value with k steps to go,
    interp, torques)."""
    thetas = jnp.asarray(-np.pi + 2 * np.pi * np.arange(n) / n, jnp.float32)
    dots = jnp.linspace(-p.max_speed, p.max_speed, n, dtype=jnp.float32)
    torques = jnp.linspace(-p.max_torque, p.max_torque, n_torques)
    th, dot = jnp.meshgrid(thetas, dots, indexing="ij")
    reward, next_th, next_dot = transition(p, th[..., None], dot[..., None], torques)
    interp = make_interp(n, n, float(p.max_speed))

    @jax.jit
    def value_iteration():
        def backup(v, _):
            v = jnp.max(reward + interp(v, next_th, next_dot), axis=-1)
            return v, v

        v0 = jnp.zeros((n, n), jnp.float32)
        _, vs = jax.lax.scan(backup, v0, None, length=HORIZON)
        return jnp.concatenate([v0[None], vs])

    return value_iteration().block_until_ready(), interp, torques


# An episode "falls back" when the pendulum comes within NEAR_TOP rad of upright and later
# hangs more than LOW rad from it again: a swing-up given up near the top, costing a lap.
# It is "up" at the first step that ends within UP rad of upright.
NEAR_TOP, LOW, UP = 0.7, 2.0, 0.3


def fell_back(near_before, theta):
    """(came near the top so far, fell back now) after a step that reached `theta`."""
    angle = jnp.abs(angle_normalize(theta))
    return near_before | (angle < NEAR_TOP), near_before & (angle > LOW)


def make_player(env, p, act):
    """jit(vmap) of one episode per key with act(obs, state, t) -> torque [1]; returns
    (returns, starting theta, whether it fell back after coming near the top, the first step
    that ends within UP rad of upright: HORIZON if none)."""

    def episode(key):
        k_reset, k_step = jax.random.split(key)
        obs, state = env.reset(k_reset, p)
        theta0 = state.theta

        def step(carry, t):
            obs, state, ret, near, fell, up = carry
            obs, state, r, _, _ = env.step_env(k_step, state, act(obs, state, t), p)
            near, fell_now = fell_back(near, state.theta)
            up = jnp.where((up == HORIZON) & (jnp.abs(angle_normalize(state.theta)) < UP), t, up)
            return (obs, state, ret + r, near, fell | fell_now, up), None

        start = (obs, state, jnp.float32(0.0), jnp.bool_(False), jnp.bool_(False),
                 jnp.int32(HORIZON))
        (_, _, ret, _, fell, up), _ = jax.lax.scan(step, start, jnp.arange(HORIZON))
        return ret, theta0, fell, up

    return jax.jit(jax.vmap(episode))


ANGLE_BINS = [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, float(np.pi)]


def compare_policy(run_dir: str, env, p, play_greedy, keys) -> dict:
    """Each seed's deterministic policy against the greedy optimum on the same resets."""
    from jaxppo import load_policy

    greedy, theta0, greedy_fell, greedy_up = (np.asarray(x, np.float64)
                                              for x in play_greedy(keys))
    angle = np.abs(np.asarray(theta0))
    num_seeds = load_policy(run_dir).config.num_seeds
    seeds = []
    for i in range(num_seeds):
        policy = load_policy(run_dir, seed_index=i)
        # The run's env: a discretize_actions run maps its action index to a torque there.
        play = make_player(policy.spec.env, p, lambda obs, state, t: policy(obs[None])[0])
        ours, _, fell, up = (np.asarray(x, np.float64) for x in play(keys))
        gap = greedy - ours
        worst_tenth = np.argsort(-gap)[: max(1, len(gap) // 10)]  # the largest gaps
        seeds.append({
            "return_mean": float(ours.mean()),
            "gap_mean": float(gap.mean()),
            "gap_by_start_angle": [
                {"abs_theta0": [lo, round(hi, 3)], "episodes": int(m.sum()),
                 "greedy": float(greedy[m].mean()), "policy": float(ours[m].mean()),
                 "gap": float(gap[m].mean())}
                for lo, hi in zip(ANGLE_BINS[:-1], ANGLE_BINS[1:])
                for m in [(angle >= lo) & (angle < hi)] if m.any()
            ],
            "share_of_gap_in_worst_10pct_episodes": float(
                gap[worst_tenth].sum() / max(gap.sum(), 1e-9)),
            # came within NEAR_TOP of upright, then hung LOW from it again (a lap lost)
            "episodes_fell_back": int(fell.sum()),
            "greedy_episodes_fell_back": int(greedy_fell.sum()),
            "worst_10pct_fell_back_where_greedy_did_not": float(
                np.mean((fell[worst_tenth] > 0) & (greedy_fell[worst_tenth] == 0))),
            # steps until the pendulum first ends a step within UP rad of upright
            "steps_to_up_mean": float(up.mean()),
            "greedy_steps_to_up_mean": float(greedy_up.mean()),
            "worst_10pct_steps_later_up_than_greedy": {
                q: float(np.percentile(up[worst_tenth] - greedy_up[worst_tenth], pct))
                for q, pct in (("p25", 25), ("median", 50), ("p75", 75))},
        })
    return {"run_dir": str(run_dir), "episodes": len(greedy),
            "greedy_return_mean": float(greedy.mean()), "seeds": seeds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", type=int, default=401, help="nodes per state axis")
    parser.add_argument("--torques", type=int, default=41, help="torques in [-2, 2]")
    parser.add_argument("--episodes", type=int, default=2000)
    parser.add_argument("--policy", metavar="RUN_DIR",
                        help="also compare this Pendulum-v1 run's policies against the optimum")
    args = parser.parse_args()

    gymnax = import_gymnax()
    env, p = gymnax.make("Pendulum-v1")
    assert int(p.max_steps_in_episode) == HORIZON
    t0 = time.perf_counter()
    n = args.grid
    values, interp, torques = solve(p, n, args.torques)
    vi_seconds = time.perf_counter() - t0

    def greedy(obs, state, t):
        r, nth, ndot = transition(p, state.theta, state.theta_dot, torques)
        return jnp.array([torques[jnp.argmax(r + interp(values[HORIZON - t - 1], nth, ndot))]])

    play = make_player(env, p, greedy)
    returns = np.asarray(play(jax.random.split(jax.random.key(12345), args.episodes))[0],
                         np.float64)
    resets = jax.vmap(lambda k: env.reset(k, p)[1])(jax.random.split(jax.random.key(7), 200_000))
    grid_value = np.asarray(interp(values[HORIZON], resets.theta, resets.theta_dot), np.float64)
    means_164 = [float(np.mean(np.asarray(play(jax.random.split(jax.random.key(s), 164))[0])))
                 for s in range(10)]

    out = {
        "env": "Pendulum-v1",
        "method": "finite-horizon value iteration, greedy policy played on gymnax dynamics",
        "grid": [n, n],
        "torques": args.torques,
        "greedy_policy_return_mean": float(returns.mean()),
        "greedy_policy_return_se": float(returns.std(ddof=1) / np.sqrt(len(returns))),
        "greedy_policy_return_std": float(returns.std(ddof=1)),
        "greedy_policy_episodes": len(returns),
        "grid_value_mean_over_resets": float(grid_value.mean()),
        "grid_value_resets": len(grid_value),
        "means_of_164_episodes_seeds_0_to_9": [round(m, 2) for m in means_164],
        "value_iteration_seconds": round(vi_seconds, 1),
    }
    path = ROOT / "experiments" / "results" / "pendulum-optimum.json"
    if args.policy:
        keys = jax.random.split(jax.random.key(1), args.episodes)
        out["policy_comparison"] = compare_policy(args.policy, env, p, play, keys)
        path = path.with_name("pendulum-policy-gap.json")
    out["seconds"] = round(time.perf_counter() - t0, 1)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
