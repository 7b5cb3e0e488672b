"""Host-loop mode: a vector env steps in Python, everything else stays compiled.

For `env="gymnasium:<id>"` (jaxppo.envs.gymnasium_env) and other envs with `host_loop = True`
(a `make_vec(n)` vector env and `env_actions`). An iteration is the compiled one cut at the
env: the rollout's random numbers come from `jaxppo.core.ppo.rollout_noise` (one jitted call),
each of the num_steps env steps is one jitted policy call (`act`) and one `envs.step` into numpy
buffers, and then GAE, the reward hooks and normalisation, every epoch and minibatch, the KL
coefficient and the metrics are `jaxppo.core.ppo.update` — the same function the compiled
iteration calls — jitted once. The loop (jaxppo.run.loop) drives a `HostLoopRunner` as it drives
the compiled `ChunkRunner`: same run folder, metrics, checkpoints, progress, CLI. With
`max_policy_lag >= 1`, `jaxppo.run.actorlearner` plays the same rollouts in actor threads.

Gymnasium 1.x semantics: the vector env autoresets in SAME_STEP mode, so step t of env e is
(s_t, a_t, r_t, terminated, truncated) with the true final observation in info["final_obs"]
when the episode ended (the returned observation already starts the next one); truncated is
counted only where not terminated, and GAE bootstraps a truncation from V(final observation).

Several seeds (num_seeds > 1): one vector env per seed (`SeedRollouts`), stepped in lockstep
with one policy call vmapped over the seeds' params; the learner state, the noise and the
update are vmapped over seeds as the compiled path vmaps its iteration, seed i from the i-th
key of split(PRNGKey(seed), num_seeds) (`seed_keys`). A recurrent policy's carry lives with
the envs (`HostRollout`), zeroed where an episode ended; each rollout records the carry it
started from and the resets, which the update replays.

With an integer num_devices the update is split over this host's devices
(`jaxppo.run.hostlearner.Learner`: the rollout cut along its envs, the compiled path's
collectives); acting reads one device's copy of the params.

On several hosts (`jaxppo.distributed`: one runner in each host's learner process, the
processes one jax.distributed group) host h steps envs h*E/H..(h+1)*E/H - 1 of the global
num_envs E, reset with the seeds one process gives those env ids and acting with the noise of
those ids, with its copy of the params; the update runs over every host's devices, each
feeding its envs' rollout. The first learner state is built on every host from every host's
first observations (gathered), as one process builds it. So H hosts give one process's
numbers (to float rounding). Only host 0 evaluates (its metrics are the run's).

Checkpoints hold the learner state (params, optimiser, statistics, KL coefficient, random
key, counters; [num_seeds, ...] with several seeds; unsharded whatever the device count); a gymnasium env's state cannot be saved,
so a resumed run restarts its envs (fresh episodes, reset from a seed derived from each seed's
key and the iteration, with a fresh carry and fresh frame stacks).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxppo.core import networks, ppo
from jaxppo.core.algorithm import Algorithm, Transition, TrainState, update_metric_keys
from jaxppo.core.hyperparams import HyperParams
from jaxppo.envs.spec import HOST_MASK_SOURCES, env_action
from jaxppo.errors import ConfigError
from jaxppo.core.evaluation import EVAL_KEY_TAG, EVAL_METRIC_KEYS
from jaxppo.program.build import is_batched
from jaxppo.process import release_free_memory
from jaxppo.program.resolved import Resolved
from jaxppo.run.hostlearner import Learner, split_envs


def _env_seeds(key: jax.Array, n: int) -> list[int]:
    """n reset seeds for gymnasium's envs, from a JAX key."""
    return [int(s) for s in np.asarray(jax.random.randint(key, (n,), 0, 2**31 - 1))]


def env_seeds(config, start: int, key: jax.Array | None = None) -> list[int]:
    """The reset seeds of a seed's num_envs envs when training starts at iteration `start`:
    from the seed's key (`seed_keys`; by default a one-seed run's, PRNGKey(config.seed)), and
    for a resumed run (start > 0) the iteration too."""
    key = jax.random.PRNGKey(config.seed) if key is None else key
    _, _, k_env = jax.random.split(key, 3)
    return _env_seeds(k_env if start == 0 else jax.random.fold_in(k_env, start), config.num_envs)


def seed_keys(config) -> jax.Array:
    """Each seed's key [num_seeds, 2], as the compiled path derives them (jaxppo.program.build):
    PRNGKey(seed) for one seed, else the i-th of split(PRNGKey(seed), num_seeds)."""
    root = jax.random.PRNGKey(config.seed)
    return root[None] if config.num_seeds == 1 else jax.random.split(root, config.num_seeds)


def iteration_of(state: TrainState) -> int:
    """The iterations a learner state has done (every seed's state has done as many)."""
    it = state.iteration
    if isinstance(it, jax.Array) and not it.is_fully_addressable:  # split over hosts
        it = it.addressable_shards[0].data
    return int(np.ravel(np.asarray(it))[0])


def over_seeds(fn, seeded: bool, in_axes):
    """`fn` vmapped over a leading seed axis of its arguments (`in_axes`) when `seeded`."""
    return jax.vmap(fn, in_axes=in_axes) if seeded else fn


def hp_axis(hp: HyperParams, config) -> int | None:
    """The seed axis of `hp`: 0 for one set of hyperparameters per seed (a sweep's), None for
    one set shared by every seed. ConfigError for a stacked set that does not fit."""
    if config.num_seeds == 1:
        if np.ndim(hp.clip_param) != 0:
            raise ConfigError("hparams: a one-seed run of an env that steps in Python takes one "
                              "set of hyperparameters (HyperParams.from_config), not a stacked "
                              "sweep; set num_seeds to the sweep's size")
        return None
    return 0 if is_batched(hp, config.num_seeds) else None


def init_fn(algo: Algorithm, hp: HyperParams):
    """(keys, obs) -> a fresh learner state (`initial_state`) of every seed: [S, ...] leaves
    from keys [S, 2] and observations [S, E, ...] when several, else one seed's."""
    seeded = algo.config.num_seeds > 1
    init = over_seeds(lambda k, o, h: initial_state(algo, k, h, o)[0], seeded,
                      (0, 0, hp_axis(hp, algo.config)))
    return lambda keys, obs: init(keys if seeded else keys[0], obs, hp)


def obs_dtype(env) -> np.dtype:
    """The dtype rollout buffers keep an env's observations in: the env's own when integer or
    bool (uint8 images stay uint8 until the network's input), float32 otherwise."""
    dtype = np.dtype(getattr(env.observation_space(None), "dtype", None) or np.float32)
    return dtype if np.issubdtype(dtype, np.integer) or dtype == np.bool_ else np.dtype(np.float32)


def _policy_step(algo: Algorithm, params, obs_stats, raw_obs, carry, reset, mask, noise):
    """The acting policy's step: (action, env-ready action, log-prob, distribution, carry
    after it); `carry` (() feed-forward) is zeroed first where `reset` [E] says so; `mask`
    [E, A] (None: unmasked) the env's legal actions."""
    dist, _, carry = algo.network.apply(params, algo.obs_in(obs_stats, raw_obs), carry, reset)
    action, logp = algo.sample_actions(networks.mask_logits(dist, mask), noise)
    return action, env_action(algo.spec, action), logp, dist, carry


@functools.partial(jax.jit, static_argnums=(0, 1))
def _behaviour(algo: Algorithm, seeded: bool, params, obs_stats, raw_obs, carry, reset, mask,
               noise):
    """`_policy_step`, vmapped over a leading seed axis of every argument when `seeded`."""
    step = functools.partial(_policy_step, algo)
    return (jax.vmap(step) if seeded else step)(params, obs_stats, raw_obs, carry, reset, mask,
                                                noise)


def legal_actions(envs, info: dict, masked: bool, n: int, num_actions: int) -> np.ndarray | None:
    """The legal actions [n, A] (bool) of the observations a reset or step of the vector env
    `envs` gave: its info["action_mask"], else each env's `action_masks()` (SB3-contrib's
    MaskablePPO convention; with SAME_STEP autoreset, an ended env's are its next episode's
    first); None when the policy is unmasked. ConfigError for a step without them."""
    if not masked:
        return None
    mask = info.get("action_mask") if isinstance(info, dict) else None
    if mask is None and callable(getattr(envs, "call", None)):
        try:
            mask = np.stack(envs.call("action_masks"))
        except AttributeError:
            mask = None
    if mask is None or np.shape(mask) != (n, num_actions):
        raise ConfigError(
            f"the env's legal actions ({HOST_MASK_SOURCES}) are "
            f"{'missing' if mask is None else np.shape(mask)} after a reset or step; an env "
            f"trained with its mask gives them for every observation, [{n}, {num_actions}] for "
            f"{n} envs (true or nonzero = legal)")
    return np.asarray(mask).astype(bool)


class HostRollout:
    """A vector env of `len(seeds)` envs stepped in Python and the trackers of its episodes in
    progress (with a recurrent policy, its carry too); `collect` plays num_steps steps of every
    env with the policy and returns the Transition [T, E] (numpy).

    Observations stay in the env's dtype when it is an integer one (`obs_dtype`). A vector env
    may report episodes other than the ones learning sees: where its step's info holds
    "episode_reward" (float [E]) and "episode_end" (bool [E]), the episode metrics add up
    episode_reward and end an episode at episode_end (e.g. the game score over all lives
    while learning sees clipped rewards and a life lost as an end), else they add up the
    rewards and end at terminated | truncated."""

    def __init__(self, algorithm: Algorithm, seeds: list[int]):
        self.algorithm = algorithm
        self.config = algorithm.config
        self.spec = algorithm.spec
        self.env = self.spec.env
        self.num_envs = n = len(seeds)
        self.obs_dtype = obs_dtype(self.env)
        self.envs = self.env.make_vec(n)
        self.masked = self.spec.masked
        try:
            obs, info = self.envs.reset(seed=seeds)
            self.obs = self._obs(obs)
            # The legal actions of `obs` (None: an unmasked policy).
            self.mask = legal_actions(self.envs, info, self.masked, n, self.spec.action_dim)
        except BaseException:
            self.envs.close()
            raise
        self.discounted_return = np.zeros(n, np.float32)
        self.episode_return = np.zeros(n, np.float32)
        self.episode_length = np.zeros(n, np.int32)
        # The policy's carry, zeroed before the step that sees an episode's first observation
        # (as jaxppo.core.ppo.rollout does); () and None for a feed-forward policy.
        self.carry = jax.device_get(algorithm.initial_carry((n,)))
        self.reset = np.ones(n, bool) if algorithm.recurrent else None
        self.act = functools.partial(_behaviour, algorithm, False)

    def _obs(self, obs) -> np.ndarray:
        return np.asarray(obs, self.obs_dtype).reshape((self.num_envs,) + self.spec.obs_shape)

    def policy_inputs(self) -> tuple:
        """What the policy step takes of these envs: (observations, carry, reset, legal
        actions)."""
        return self.obs, self.carry, self.reset, self.mask

    def warm_up(self, params, obs_stats, noise: np.ndarray):
        """Compile the policy step for these envs (noise [E, A]); its outputs' shapes."""
        args = (params, obs_stats, *self.policy_inputs(), noise)
        outs = jax.eval_shape(self.act, *args)
        self.act(*args)
        return outs

    def collect(self, params, obs_stats, noise: np.ndarray, gamma: float) -> Transition:
        """num_steps steps of every env; noise [T, E, A] samples the actions (as in the
        compiled rollout). Returns the Transition with numpy leaves [T, E, ...]."""
        self.begin()
        for t in range(self.config.num_steps):
            self.advance(t, jax.device_get(self.act(params, obs_stats, *self.policy_inputs(),
                                                    noise[t])), gamma)
        return self.finish()

    def begin(self) -> None:
        """Start a rollout: empty buffers [T, E, ...] and the carry it starts from."""
        T, E = self.config.num_steps, self.num_envs
        obs_buf = np.empty((T, E) + self.spec.obs_shape, self.obs_dtype)
        self._buf = dict(
            obs=obs_buf, final_obs=np.empty_like(obs_buf),
            **{k: np.empty((T, E), np.float32) for k in ("reward", "discounted_return",
                                                         "episode_return")},
            **{k: np.empty((T, E), bool) for k in ("terminated", "truncated", "episode_end")},
            episode_length=np.empty((T, E), np.int32),
            **({"action_mask": np.empty((T, E, self.spec.action_dim), bool)} if self.masked
               else {}))
        self._steps: list[tuple] = []
        self._resets: list[np.ndarray] = []
        self._carry0 = self.carry

    def advance(self, t: int, outs: tuple, gamma: float) -> None:
        """Step t of the rollout: record the policy's outputs `outs` (numpy, from
        `policy_inputs`) and step every env with its actions."""
        action, env_action, logp, dist, carry = outs
        b = self._buf
        b["obs"][t] = self.obs
        if self.masked:
            b["action_mask"][t] = self.mask
        if self.reset is not None:
            self._resets.append(self.reset)
        (b["final_obs"][t], b["reward"][t], b["terminated"][t], b["truncated"][t],
         b["episode_end"][t], b["discounted_return"][t], b["episode_return"][t],
         b["episode_length"][t]) = self._step(env_action, gamma)
        self._steps.append((action, logp, dist))
        if self.reset is not None:
            self.carry, self.reset = carry, b["terminated"][t] | b["truncated"][t]

    def finish(self) -> Transition:
        """The rollout recorded since `begin`, as a Transition [T, E, ...] (numpy)."""
        stack = lambda *xs: np.stack(xs)  # noqa: E731
        action, logp, dist = jax.tree.map(stack, *self._steps)
        recurrent = self.reset is not None
        return Transition(action=action, log_prob=logp, dist=dist,
                          reset=np.stack(self._resets) if recurrent else None,
                          carry0=self._carry0, **self._buf)

    def _step(self, env_action, gamma: float) -> tuple:
        """One step of every env: (final obs, reward, terminated, truncated, episode ended,
        and the discounted return, episode return and length including this step); the
        trackers restart where an episode ended and `obs` moves on."""
        next_obs, reward, terminated, truncated, info = self.envs.step(
            self.env.env_actions(env_action))
        next_obs = self._obs(next_obs)
        self.mask = legal_actions(self.envs, info, self.masked, self.num_envs,
                                  self.spec.action_dim)
        terminated = np.asarray(terminated, bool)
        truncated = np.asarray(truncated, bool) & ~terminated
        done = terminated | truncated
        final = next_obs.copy()
        if done.any():  # SAME_STEP: next_obs already starts the next episode
            for i in np.flatnonzero(done):
                final[i] = np.asarray(info["final_obs"][i], self.obs_dtype).reshape(self.spec.obs_shape)
        reward = np.asarray(reward, np.float32)
        reported = _episode_info(info, "episode_reward", done, reward)
        ended = _episode_info(info, "episode_end", done, done)
        self.episode_return += reported
        self.episode_length += 1
        self.discounted_return = self.discounted_return * np.float32(gamma) + reward
        out = (final, reward, terminated, truncated, ended, self.discounted_return.copy(),
               self.episode_return.copy(), self.episode_length.copy())
        self.discounted_return[done] = 0.0
        self.episode_return[ended] = 0.0
        self.episode_length[ended] = 0
        self.obs = next_obs
        return out

    def close(self) -> None:
        self.envs.close()


class SeedRollouts:
    """The vector envs of several seeds (a `HostRollout` each, the same envs), played in
    lockstep: one policy step for every seed (vmapped over their params), then each seed's
    envs step. `collect` returns the Transition [S, T, E, ...]; obs and the trackers have a
    leading seed axis."""

    def __init__(self, algorithm: Algorithm, seeds: list[list[int]]):
        self.parts: list[HostRollout] = []
        try:
            for s in seeds:
                self.parts.append(HostRollout(algorithm, s))
        except BaseException:
            self.close()
            raise
        self.config = algorithm.config
        self.act = functools.partial(_behaviour, algorithm, True)

    def _stacked(self, name: str):
        return jax.tree.map(lambda *xs: np.stack(xs), *(getattr(p, name) for p in self.parts))

    obs = property(lambda self: self._stacked("obs"))
    carry = property(lambda self: self._stacked("carry"))
    discounted_return = property(lambda self: self._stacked("discounted_return"))
    episode_return = property(lambda self: self._stacked("episode_return"))
    episode_length = property(lambda self: self._stacked("episode_length"))

    def policy_inputs(self) -> tuple:
        reset = None if self.parts[0].reset is None else self._stacked("reset")
        mask = None if self.parts[0].mask is None else self._stacked("mask")
        return self.obs, self.carry, reset, mask

    def warm_up(self, params, obs_stats, noise: np.ndarray):
        """Compile the policy step for these envs (noise [S, E, A]); its outputs' shapes."""
        args = (params, obs_stats, *self.policy_inputs(), noise)
        outs = jax.eval_shape(self.act, *args)
        self.act(*args)
        return outs

    def collect(self, params, obs_stats, noise: np.ndarray, gamma) -> Transition:
        """num_steps steps of every seed's envs with its params (leaves [S, ...]); noise
        [S, T, E, A], gamma one per seed [S]. Returns the Transition [S, T, E, ...]."""
        gamma = np.broadcast_to(np.asarray(gamma, np.float32), (len(self.parts),))
        for p in self.parts:
            p.begin()
        for t in range(self.config.num_steps):
            outs = jax.device_get(self.act(params, obs_stats, *self.policy_inputs(),
                                           noise[:, t]))
            for i, p in enumerate(self.parts):
                p.advance(t, jax.tree.map(lambda x: x[i], outs), float(gamma[i]))
        return jax.tree.map(lambda *xs: np.stack(xs), *(p.finish() for p in self.parts))

    def close(self) -> None:
        for p in self.parts:
            p.close()


def open_rollout(algorithm: Algorithm, seeds: list[list[int]]) -> HostRollout | SeedRollouts:
    """The envs of every seed (`seeds`: each seed's reset seeds): a `HostRollout` for one seed
    (no seed axis), else `SeedRollouts`."""
    return HostRollout(algorithm, seeds[0]) if len(seeds) == 1 else SeedRollouts(algorithm, seeds)


def _episode_info(info: dict, key: str, done: np.ndarray, default: np.ndarray) -> np.ndarray:
    """A vector env's per-env info value `key` ([E], `default`'s dtype), `default` where it
    gives none. Gymnasium puts the info of a step that ended an episode (SAME_STEP) in
    info["final_info"] and the reset's at the top, so those envs' value comes from there."""
    top = info.get(key)
    final = info.get("final_info")
    at_end = final.get(key) if isinstance(final, dict) else None
    if top is None and at_end is None:
        return default
    out = np.array(default if top is None else top, default.dtype)
    if at_end is not None and done.any():
        out[done] = np.asarray(at_end, default.dtype)[done]
    return out


def zero_transition(outs, num_steps: int, obs: np.ndarray, seeded: bool = False,
                    mask: np.ndarray | None = None) -> Transition:
    """A rollout [S?, T, E] of zeros shaped as `collect` returns it, from the policy step's
    output shapes `outs` ([S?, E, ...]), one observation batch `obs` [S?, E, ...] and, for a
    masked policy, one batch of legal actions `mask` [S?, E, A]."""
    lead = 1 if seeded else 0  # the time axis goes after the seed axis

    def zeros(s):  # [S?, E, ...] -> [S?, T, E, ...]
        return np.zeros(tuple(s.shape[:lead]) + (num_steps,) + tuple(s.shape[lead:]), s.dtype)

    obs = zeros(obs)
    rows = obs.shape[:lead + 2]
    f32, b = np.zeros(rows, np.float32), np.zeros(rows, bool)
    carry0 = jax.tree.map(lambda c: np.zeros(c.shape, c.dtype), outs[4])
    return Transition(obs=obs, final_obs=obs, action=zeros(outs[0]), log_prob=zeros(outs[2]),
                      dist=jax.tree.map(zeros, outs[3]), reward=f32, discounted_return=f32,
                      terminated=b, truncated=b, episode_return=f32,
                      episode_length=np.zeros(rows, np.int32), episode_end=b,
                      reset=b if jax.tree.leaves(carry0) else None, carry0=carry0,
                      action_mask=None if mask is None else zeros(mask))


def initial_state(algo: Algorithm, key: jax.Array, hp: HyperParams, obs) -> tuple[TrainState, jax.Array]:
    """(fresh TrainState around envs reset to `obs`, the key their reset seeds come from):
    the same key splits as `ppo.init`; the env state lives outside (())."""
    key, k_params, k_env = jax.random.split(key, 3)
    env_ids = jnp.arange(algo.local_envs, dtype=jnp.int32)
    return ppo.init_state(algo, key, k_params, hp, jnp.asarray(obs), (), env_ids), k_env


def abstract_state(run: Resolved, hp: HyperParams):
    """The shapes and dtypes of a host-loop TrainState in the unsharded layout (what a
    checkpoint is restored into, whatever device count saved it)."""
    algo, cfg = Algorithm.create(run.with_layout(None)), run.config
    seeds = (cfg.num_seeds,) if cfg.num_seeds > 1 else ()
    obs = jax.ShapeDtypeStruct(seeds + (cfg.num_envs,) + run.spec.obs_shape,
                               obs_dtype(run.spec.env))
    return jax.eval_shape(init_fn(algo, hp), seed_keys(cfg), obs)


class HostLoopRunner:
    """The `jaxppo.run.runner.Runner` of an env that steps in Python: `train_chunk(start,
    stop)` plays and learns iterations start+1..stop in this process, `snapshot()` is the
    learner state (numpy). `jaxppo.run.actorlearner.ActorLearnerRunner` builds on it."""

    hosts = 1
    layout_note: str | None = None  # more on where it trains, for the layout line

    def __init__(self, resolved: Resolved, hp: HyperParams, restored: TrainState | None = None,
                 keys: jax.Array | None = None):
        """`keys`: each seed's key [num_seeds, 2] (default `seed_keys(config)`)."""
        t0 = time.perf_counter()
        # Acting sees every env on one device; the learner may split them (`Learner`).
        self.algorithm = algo = Algorithm.create(resolved.with_layout(None))
        self.config = cfg = resolved.config
        self.hp = hp
        self.seeded = seeded = cfg.num_seeds > 1
        h_axis = hp_axis(hp, cfg)
        self.layout = resolved.layout
        self.shards = resolved.layout.shards
        # This process's envs of the global num_envs (all but on several hosts).
        self.hosts = resolved.layout.num_processes
        per = cfg.num_envs // self.hosts
        self.env_lo = resolved.layout.process_index * per
        self.env_hi = self.env_lo + per
        # Split over devices, the params come back one copy per device (as the compiled path's).
        self.params_replicated = self.shards > 1
        if self.shards > 1:
            self.layout_note = ("the envs step in Python and the policy acts on one device; "
                                f"the update is split over {self.shards}")
        self.keys = seed_keys(cfg) if keys is None else keys
        self._gamma = (np.broadcast_to(np.asarray(hp.gamma, np.float32), (cfg.num_seeds,))
                       if seeded else float(hp.gamma))
        self._eval_envs = None
        self.host_failures: list[dict] = []
        start = 0 if restored is None else iteration_of(restored)
        try:
            # A resumed run restarts its envs from seeds of its own: the env state was not saved.
            obs = self._open_envs([env_seeds(cfg, start, k)[self.env_lo:self.env_hi]
                                   for k in self.keys])
            self.learner = Learner(resolved, hp, seeded, h_axis)
            if restored is None:
                obs = self._every_hosts_obs(obs)
                self.state = self.learner.place(jax.jit(init_fn(algo, hp))(self.keys, obs))
            else:
                self.state = self.learner.place(restored)
            self._split = jax.jit(over_seeds(lambda s: (*jax.random.split(s.rng),), seeded, 0))
            self._noise = jax.jit(over_seeds(lambda k, ids: ppo.rollout_noise(algo, k, ids)[0],
                                             seeded, (0, None)))
            # Compile everything once now (the loop reports it as compile time), on a
            # throwaway rollout of zeros: nothing steps the envs.
            self._compile()
        except BaseException:
            self.close()
            raise
        self.compile_seconds = time.perf_counter() - t0

    def _open_envs(self, seeds: list[list[int]]) -> np.ndarray:
        """Make and reset the vector env(s) of every seed (`seeds`: each seed's reset seeds);
        their observations [S?, E, ...]."""
        self.rollout = open_rollout(self.algorithm, seeds)
        return self.rollout.obs

    def _every_hosts_obs(self, obs: np.ndarray) -> np.ndarray:
        """Every env's first observation [S?, E, ...] in global env order, from this host's
        [S?, E/hosts, ...]: gathered from every host when several (a fresh learner state's
        observation statistics are over every env's)."""
        if self.hosts == 1:
            return obs
        every = multihost_utils.process_allgather(np.asarray(obs))  # [hosts, S?, E/hosts, ...]
        return np.concatenate(list(np.asarray(every)), axis=1 if self.seeded else 0)

    def acting_state(self) -> TrainState:
        """The learner state as acting reads it (params, statistics, key, counters): one
        device's copy."""
        return self.learner.replica(self.state)

    def _compile(self):
        state = self.acting_state()
        _, k_roll = self._split(state)
        noise = np.zeros(self._noise(k_roll, self._env_ids).shape, np.float32)
        outs = self.rollout.warm_up(state.params, state.obs_stats, noise[:, 0] if self.seeded
                                    else noise[0])
        traj = zero_transition(outs, self.config.num_steps, self.rollout.obs, self.seeded,
                               self.rollout.policy_inputs()[3])
        self._compile_update(traj)

    def _compile_update(self, traj: Transition) -> None:
        # Each compile leaves its freed memory resident (`release_free_memory`): the policy's
        # goes back before the update compiles, the update's before the first update runs.
        release_free_memory()
        self.learner.compile(self.state, traj)
        release_free_memory()

    @property
    def _env_ids(self) -> np.ndarray:
        """The global ids of this process's envs."""
        return np.arange(self.env_lo, self.env_hi, dtype=np.int32)

    # ------------------------------------------------------------------ the Runner protocol
    def iterate(self) -> tuple[dict, Transition]:
        """One iteration: rollout on the host, then the compiled update. Returns its metrics
        (numpy scalars, [S] with several seeds) and the rollout."""
        acting = self.acting_state()
        rng, k_roll = self._split(acting)
        noise = np.asarray(self._noise(k_roll, self._env_ids))
        traj = self.rollout.collect(acting.params, acting.obs_stats, noise, self._gamma)
        t0 = time.perf_counter()
        self.state, metrics = self.learner.update(self.state, traj, rng)
        metrics = jax.device_get(metrics)
        release_free_memory(time.perf_counter() - t0)  # what a long update freed
        return metrics, traj

    def train_chunk(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """Iterations start+1..stop; their metrics [num_seeds?, stop - start] (eval_* NaN where
        none ran)."""
        return self.columns([self.with_evaluation(it, self.iterate()[0])
                             for it in range(start + 1, stop + 1)])

    def with_evaluation(self, it: int, metrics: dict) -> dict:
        """Iteration `it`'s metrics with eval_* (NaN unless an evaluation is due)."""
        cfg, metrics = self.config, dict(metrics)
        if cfg.eval_every:
            # On several hosts host 0's metrics are the run's: only it evaluates.
            due = ((it % cfg.eval_every == 0 or it == cfg.num_iterations)
                   and self.layout.process_index == 0)
            metrics.update(self._evaluate() if due else
                           {k: np.full(self._seed_shape, np.nan, np.float32)
                            for k in EVAL_METRIC_KEYS})
        return metrics

    def columns(self, rows: list[dict]) -> dict[str, np.ndarray]:
        """Metric rows (one per iteration) as the arrays `train_chunk` returns."""
        keys = update_metric_keys(self.config) + (EVAL_METRIC_KEYS if self.config.eval_every
                                                    else ())
        keys += self.extra_metric_keys
        if not self.seeded:
            return {k: np.asarray([r[k] for r in rows]) for k in keys}
        shape = self._seed_shape + (len(rows),)
        return {k: np.stack([np.broadcast_to(r[k], self._seed_shape) for r in rows], axis=-1)
                if rows else np.zeros(shape, np.float32) for k in keys}

    @property
    def _seed_shape(self) -> tuple[int, ...]:
        return (self.config.num_seeds,) if self.seeded else ()

    extra_metric_keys: tuple[str, ...] = ()  # metrics of this runner's own

    def _evaluate(self) -> dict:
        """eval_* metrics of the current policy: one episode in each of eval_episodes envs,
        seeded from the training key (without consuming it)."""
        cfg = self.config
        if self._eval_envs is None:
            self._eval_envs = self.algorithm.spec.env.make_vec(cfg.eval_episodes)
        st = jax.device_get(self.acting_state())
        rows = []
        for i in range(cfg.num_seeds):  # each seed's policy in turn, on the same envs
            s = jax.tree.map(lambda x: x[i], st) if self.seeded else st
            returns, lengths = play_episodes(
                self.algorithm, s.params, s.obs_stats, jax.random.fold_in(s.rng, EVAL_KEY_TAG),
                self._eval_envs, self.algorithm.eval_bound(), cfg.eval_deterministic)
            rows.append({"eval_return_mean": np.float32(returns.mean()),
                         "eval_return_std": np.float32(returns.std()),
                         "eval_length_mean": np.float32(lengths.mean())})
        return rows[0] if not self.seeded else {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    def _trackers(self) -> dict:
        """This process's envs' observations and episode trackers [S?, E/hosts] (numpy), as
        the TrainState fields snapshots hold them in (a resume does not use them: it restarts
        the envs)."""
        r = self.rollout
        return dict(last_obs=r.obs.copy(), discounted_return=r.discounted_return.copy(),
                    episode_return=r.episode_return.copy(), episode_length=r.episode_length.copy())

    def snapshot(self) -> TrainState:
        """The learner state after the last iteration, as numpy, with the envs' observations
        and episode trackers (one process holding every env)."""
        return self.learner.unsharded(self.state).replace(**self._trackers())

    def local_part(self, replicated: bool = True) -> TrainState:
        """This process's shards of the state after the last iteration, as numpy
        [local_devices, S?, ...] (`jaxppo.program.shards.local_part`), with its envs'
        trackers: what a host hands the driver, which joins every host's."""
        part = self.learner.local_part(self.state, replicated)
        return part.replace(**{k: split_envs(v, self.learner.local, int(self.seeded))
                               for k, v in self._trackers().items()})

    def final_state(self) -> TrainState:
        """The learner state as the update left it (device arrays; split over devices, the
        device layout: [devices, ...])."""
        return self.state

    def close(self) -> None:
        """Close the training and evaluation envs."""
        rollout = getattr(self, "rollout", None)
        if rollout is not None:
            rollout.close()
        if self._eval_envs is not None:
            self._eval_envs.close()


# ---------------------------------------------------------------------- evaluation
def play_episodes(algorithm: Algorithm, params, obs_stats, key: jax.Array, envs, max_steps: int,
                  deterministic: bool, watch=None) -> tuple[np.ndarray, np.ndarray]:
    """(returns [N], lengths [N]) of one episode in each env of the vector env `envs` (N
    copies), reset from seeds of `key`; an env whose episode ended keeps stepping (autoreset)
    but no longer counts. Stops when all ended or after max_steps steps. An episode is what the
    training metrics count (`HostRollout`): with info["episode_reward"] / ["episode_end"]
    (Atari's game score over all lives), those. `watch(reward, going)`, if given, follows env
    0's episode: called after the reset (reward None) and after each of its steps with the
    step's reward, `going` False at the step that ends it (a video: jaxppo.run.video)."""
    n = envs.num_envs
    k_reset, k_act = jax.random.split(key)
    obs, info = envs.reset(seed=_env_seeds(k_reset, n))
    masked, num_actions = algorithm.spec.masked, algorithm.spec.action_dim
    mask = legal_actions(envs, info, masked, n, num_actions)
    if watch is not None:
        watch(None, True)
    shape, dtype = (n,) + algorithm.spec.obs_shape, obs_dtype(algorithm.spec.env)
    step = _policy(algorithm, deterministic)
    carry = algorithm.initial_carry((n,))  # a recurrent policy's: each env plays one episode
    returns, lengths = np.zeros(n, np.float64), np.zeros(n, np.int64)
    active = np.ones(n, bool)
    for t in range(max_steps):
        obs = np.asarray(obs, dtype).reshape(shape)
        action, carry = step(params, obs_stats, obs, carry, jax.random.fold_in(k_act, t), mask)
        action = np.asarray(action)
        obs, reward, terminated, truncated, info = envs.step(algorithm.spec.env.env_actions(action))
        mask = legal_actions(envs, info, masked, n, num_actions)
        done = np.asarray(terminated, bool) | np.asarray(truncated, bool)
        reward = _episode_info(info, "episode_reward", done, np.asarray(reward, np.float64))
        returns += np.where(active, reward, 0.0)
        lengths += active
        watched = active[0]
        active &= ~_episode_info(info, "episode_end", done, done)
        if watch is not None and watched:
            watch(float(reward[0]), bool(active[0]) and t + 1 < max_steps)
        if not active.any():
            break
    return returns, lengths


@functools.partial(jax.jit, static_argnums=(0, 1))
def _act(algorithm: Algorithm, deterministic: bool, params, obs_stats, obs, carry, key,
         mask=None):
    return algorithm.policy_step(params, obs_stats, obs, carry, key, deterministic, mask)


def _policy(algorithm: Algorithm, deterministic: bool):
    """The jitted env-ready policy `(params, obs_stats, obs, carry, key, mask=None) ->
    (actions, carry)`
    of the algorithm
    (compiled once per algorithm and mode: jit keys on the frozen Algorithm)."""
    return functools.partial(_act, algorithm, deterministic)


def evaluate_host(algorithm: Algorithm, params, obs_stats, *, episodes: int, seed: int,
                  deterministic: bool, max_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """`jaxppo.run.policy.evaluate_policy` for a gymnasium env: (returns, lengths) of one
    episode in each of `episodes` fresh envs reset from seeds of PRNGKey(seed)."""
    envs = algorithm.spec.env.make_vec(episodes)
    try:
        return play_episodes(algorithm, params, obs_stats, jax.random.PRNGKey(seed), envs,
                             max_steps, deterministic)
    finally:
        envs.close()
