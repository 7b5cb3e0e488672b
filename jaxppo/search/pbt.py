"""Population-based training inside the compiled chunk.

Every `pbt.interval` iterations the worst `fraction` of members copy the learner state of one
of the best and explore the searched hyperparameters, on the whole population at once, with
no Python in between. The step, its fitness and its metrics are described in docs/design.md
("Population-based training inside the program").
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.core.algorithm import Algorithm, PopulationRecord, TrainState
from jaxppo.config import HYPERPARAM_LEAVES, SCHEDULES
from jaxppo.core.hyperparams import HyperParams
from jaxppo.search.space import pbt_settings, search_space

PBT_TAG = 0x9B7  # folds the exploit/explore key out of member 0's training key

# TrainState fields a replaced member copies from its parent (the learner, not the envs).
LEARNER_FIELDS = ("params", "opt_state", "kl_coeff", "obs_stats", "return_stats", "hparams")

_POINTS = {name: leaf for leaf, name in HYPERPARAM_LEAVES.items() if name in SCHEDULES}


def metric_keys(config) -> tuple[str, ...]:
    """The per-member metrics a PBT run adds to each iteration's row."""
    if config.pbt is None:
        return ()
    return ("pbt_parent", "pbt_fitness") + tuple(f"hp_{f}" for f in search_space(config))


class Explorer:
    """The exploit/explore step of one PBT config (see the module docstring)."""

    def __init__(self, algorithm: Algorithm):
        config = algorithm.config
        self.config = config
        self.settings = pbt_settings(config.pbt)
        self.dists = search_space(config)
        self.members = config.num_seeds
        self.replaced = max(1, int(math.floor(self.settings["fraction"] * self.members)))
        # A schedule's form with first value 1 (a constant: [[0, 1]]; linear: [[0, 1], [T, 0]]).
        unit = HyperParams.from_config(config.replace(search=None, pbt=None, num_seeds=1,
                                                      **{name: 1.0 for name in _POINTS}))
        self.unit_points = {name: np.asarray(getattr(unit, leaf)) for name, leaf in _POINTS.items()}

    # ------------------------------------------------------------------ hyperparameters
    def get(self, hp: HyperParams, name: str) -> jax.Array:
        """The searched value of `name` in (batched) hp: [members]."""
        if name in _POINTS:
            return getattr(hp, _POINTS[name])[..., 0, 1]
        return getattr(hp, name)

    def set(self, hp: HyperParams, name: str, value: jax.Array) -> HyperParams:
        if name in _POINTS:
            unit = jnp.asarray(self.unit_points[name])
            pts = jnp.broadcast_to(unit, value.shape + unit.shape)
            pts = pts.at[..., 1].multiply(value[..., None])
            return hp.replace(**{_POINTS[name]: pts})
        return hp.replace(**{name: value.astype(jnp.float32)})

    def _explore_one(self, key: jax.Array, name: str, v: jax.Array) -> jax.Array:
        """A new value of field `name` from value v (one member)."""
        d = self.dists[name]
        k_resample, k_draw, k_perturb = jax.random.split(key, 3)
        resample = jax.random.uniform(k_resample) < self.settings["resample_probability"]
        if d.kind == "choice":
            choices = jnp.asarray(d.args, jnp.float32)
            drawn = choices[jax.random.randint(k_draw, (), 0, len(d.args))]
            idx = jnp.argmin(jnp.abs(choices - v))
            step = jnp.where(jax.random.bernoulli(k_perturb), 1, -1)
            moved = choices[jnp.clip(idx + step, 0, len(d.args) - 1)]
            return jnp.where(resample, drawn, moved)
        u = jax.random.uniform(k_draw)
        if d.kind == "loguniform":
            lo, hi = math.log(d.low), math.log(d.high)
            drawn = jnp.exp(lo + (hi - lo) * u)
        else:
            drawn = d.low + (d.high - d.low) * u
        factors = jnp.asarray(self.settings["perturb"], jnp.float32)
        factor = factors[jax.random.randint(k_perturb, (), 0, len(factors))]
        moved = jnp.clip(v * factor, d.low, d.high)
        return jnp.where(resample, drawn, moved).astype(jnp.float32)

    def explore(self, key: jax.Array, hp: HyperParams, first: jax.Array | int = 0) -> HyperParams:
        """The searched fields of members first.. (as many as hp holds) perturbed or redrawn,
        each with its own key of the population's (the caller keeps them only for replaced
        members)."""
        local = np.shape(hp.clip_param)[0]
        keys = jax.lax.dynamic_slice_in_dim(jax.random.split(key, self.members), first, local)
        for j, name in enumerate(self.dists):
            v = self.get(hp, name)
            new = jax.vmap(lambda k, x: self._explore_one(jax.random.fold_in(k, j), name, x))(keys, v)
            hp = self.set(hp, name, new)
        return hp

    # ------------------------------------------------------------------ the step
    def record(self, pop: PopulationRecord, m: dict, live: jax.Array) -> PopulationRecord:
        """Add one iteration's metrics (batched [members]) to each member's fitness record."""
        n = m["episodes"].astype(jnp.float32)
        ret = jnp.where(n > 0, m["episode_return_mean"], 0.0)
        pop = pop._replace(return_sum=pop.return_sum + jnp.where(live, ret * n, 0.0),
                           episodes=pop.episodes + jnp.where(live, n, 0.0))
        if "eval_return_mean" in m:
            ev = m["eval_return_mean"]
            pop = pop._replace(last_eval=jnp.where(jnp.isfinite(ev), ev, pop.last_eval))
        return pop

    def fitness(self, pop: PopulationRecord) -> jax.Array:
        if self.settings["fitness"] == "eval":
            f = jnp.where(jnp.isfinite(pop.last_eval), pop.last_eval, pop.fitness)
        else:
            f = jnp.where(pop.episodes > 0, pop.return_sum / jnp.maximum(pop.episodes, 1.0),
                          pop.fitness)
        return jnp.where(jnp.isnan(f), -jnp.inf, f)

    def exploit_explore(self, state: TrainState, iteration: jax.Array,
                        axis_name: str | None = None):
        """(new state, parent, fitness) of one step. `state` holds this shard's members
        (all of them without `axis_name`; else the pmap axis over which the population is
        split, in member order). Shards exchange each member's fitness and key, then only the
        learner states of the best members (the possible parents), summed from the shard that
        holds each. parent and fitness are of this shard's members."""
        n, q = self.members, self.replaced
        local = state.population.fitness.shape[0]
        if axis_name is None:
            gather, first = (lambda x: x), 0
        else:
            gather = lambda x: jax.lax.all_gather(x, axis_name, tiled=True)  # noqa: E731
            first = jax.lax.axis_index(axis_name) * local
        fitness = gather(self.fitness(state.population))
        order = jnp.argsort(fitness, stable=True)  # worst first
        rank = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
        replaced = rank < q
        key = jax.random.fold_in(jax.random.fold_in(gather(state.rng)[0], PBT_TAG), iteration)
        k_parent, k_explore = jax.random.split(key)
        best = order[n - q:]
        choice = jax.random.randint(k_parent, (n,), 0, q)
        parent = jnp.where(replaced, best[choice], jnp.arange(n, dtype=jnp.int32))

        def top(x):  # the q possible parents' values [q, ...]
            if axis_name is None:
                return x[best]
            at = best - first
            mine = (at >= 0) & (at < local)
            picked = x[jnp.clip(at, 0, local - 1)]
            picked = jnp.where(mine.reshape((q,) + (1,) * (x.ndim - 1)), picked, jnp.zeros_like(picked))
            return jax.lax.psum(picked, axis_name)

        mine = lambda x: jax.lax.dynamic_slice_in_dim(x, first, local)  # noqa: E731
        my_replaced, my_choice = mine(replaced), mine(choice)

        def pick(tops, x):
            mask = my_replaced.reshape((local,) + (1,) * (x.ndim - 1))
            return jnp.where(mask, tops[my_choice], x)

        copied = {f: jax.tree.map(lambda x: pick(top(x), x), getattr(state, f))
                  for f in LEARNER_FIELDS}
        hp = copied["hparams"]
        explored = self.explore(k_explore, hp, first)
        copied["hparams"] = jax.tree.map(
            lambda new, old: jnp.where(my_replaced.reshape((local,) + (1,) * (new.ndim - 1)), new, old),
            explored, hp)
        zero = jnp.zeros((local,), jnp.float32)
        population = PopulationRecord(zero, zero, mine(fitness), state.population.last_eval)
        return state.replace(**copied, population=population), mine(parent), mine(fitness)

    def step(self, state: TrainState, m: dict, index: jax.Array, stop: jax.Array,
             axis_name: str | None = None):
        """After iteration `index` (0-based) of every member (state and metrics batched over
        this shard's members; `axis_name` the pmap axis the population is split over):
        record, and when due exploit/explore. Returns (state, PBT metrics)."""
        live = index < stop
        state = state.replace(population=self.record(state.population, m, live))
        done = index + 1
        interval = self.settings["interval"]
        due = live & (done % interval == 0) & (done < self.config.num_iterations)
        nan = jnp.full(state.population.fitness.shape, jnp.nan, jnp.float32)

        def run(st):
            st, parent, fitness = self.exploit_explore(st, done, axis_name)
            # -inf (no episode ended yet) is written as NaN, as metrics.jsonl reads it back
            return st, parent.astype(jnp.float32), jnp.where(jnp.isfinite(fitness), fitness, jnp.nan)

        def skip(st):
            return st, nan, nan

        state, parent, fitness = jax.lax.cond(due, run, skip, state)
        out = {"pbt_parent": parent, "pbt_fitness": fitness}
        for name in self.dists:
            out[f"hp_{name}"] = self.get(state.hparams, name).astype(jnp.float32)
        return state, out
