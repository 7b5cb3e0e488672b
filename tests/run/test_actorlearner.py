"""The actor-learner (max_policy_lag >= 1) for envs that step in Python: its schedule against a
sequential replay of it, the recorded behaviour policy, the lags, actor threads, the config's
checks, async gymnasium vector envs, faults (an actor's exception, a stalled env, a stop
signal), resume and learning; and max_policy_lag 0 as the synchronous host loop, bit for bit."""

from __future__ import annotations

import os
import signal
import threading
import time

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo.core import networks, ppo
from jaxppo.core.algorithm import Algorithm
from jaxppo.core.hyperparams import HyperParams
from jaxppo.errors import ConfigError, RolloutTimeoutError, TrainingInterrupted
from jaxppo.run import actorlearner
from jaxppo.run.actorlearner import ACTOR_KEY_TAG, ActorLearnerRunner
from jaxppo.run.checkpoints import find_latest
from jaxppo.run.hostloop import HostLoopRunner, HostRollout, env_seeds, initial_state
from jaxppo.run.logs import read_metrics
from jaxppo.run.train import Start, _local_runner


STALL = threading.Lock()
STALLED = threading.Event()  # set by the step that stalls
UNSTALL = threading.Event()  # the stalled step returns once this is set


class Drift(gymnasium.Env):
    """x moves by (action - 1) / 2 plus noise drawn from the env's seed; reward -|x|;
    terminated when |x| > 2, truncated by the registered limit. Counts every step of every
    instance (STEPS); raises at a step of every instance, or stalls one, where a test asks."""

    observation_space = gymnasium.spaces.Box(-10.0, 10.0, (2,), np.float32)
    action_space = gymnasium.spaces.Discrete(3)
    STEPS = [0]
    FAIL_AT: int | None = None  # raise at this step of an instance
    STALL_AT: int | None = None  # the first instance there waits for UNSTALL
    STALL_LIMIT = 300.0  # ... or this long: a safety valve, the test sets UNSTALL

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.x, self.t = float(self.np_random.uniform(-1, 1)), 0
        self.n = getattr(self, "n", 0)
        return self._obs(), {}

    def step(self, action):
        self.n += 1
        Drift.STEPS[0] += 1
        if Drift.FAIL_AT is not None and self.n == Drift.FAIL_AT:
            raise ValueError("the simulator lost its state")
        if Drift.STALL_AT is not None and self.n == Drift.STALL_AT and STALL.acquire(False):
            STALLED.set()  # the first instance there stalls, once, until released
            UNSTALL.wait(Drift.STALL_LIMIT)
        self.x += (int(action) - 1) * 0.5 + float(self.np_random.normal(0, 0.3))
        self.t += 1
        return self._obs(), -abs(self.x), abs(self.x) > 2, False, {}

    def _obs(self):
        return np.array([self.x, self.t / 10], np.float32)


if "JaxppoDrift-v0" not in gymnasium.envs.registry:
    gymnasium.register(id="JaxppoDrift-v0", entry_point=Drift, max_episode_steps=12)


@pytest.fixture(autouse=True)
def _plain_drift():
    Drift.FAIL_AT = Drift.STALL_AT = None
    STALLED.clear()
    UNSTALL.clear()
    yield
    Drift.FAIL_AT = Drift.STALL_AT = None
    UNSTALL.set()
    if STALL.locked():
        STALL.release()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("jaxppo-actor")]


DRIFT = jaxppo.PPOConfig(
    env="gymnasium:JaxppoDrift-v0", num_envs=4, num_steps=8, num_epochs=2, num_minibatches=2,
    total_timesteps=4 * 8 * 5, compilation_cache_dir=None, normalize_observations=True,
    max_policy_lag=1, actor_threads=2, network=jaxppo.NetworkConfig(hidden_sizes=(16,)))


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(_leaves(a), _leaves(b)))


def _latest_checkpoint(run_dir) -> int:
    store, step = find_latest(run_dir)
    store.close()
    return step


def _runner(cfg, restored=None):
    run = jaxppo.resolve(cfg)
    return _local_runner(Start(run, HyperParams.from_config(run.config), restored))


# ---------------------------------------------------------------------- the schedule
def replay_lag_one(cfg, iterations: int, threads: int):
    """The lag-1 schedule played in order in one thread: rollout k of every env with the
    params after k - 1 updates (rollouts 0 and 1 with the initial ones), noise from the actors'
    key stream and each env's global index, then update k + 1 on rollout k. Returns the
    learner state and the metrics of each update."""
    run = jaxppo.resolve(cfg)
    algo, hp, c = Algorithm.create(run), HyperParams.from_config(run.config), run.config
    seeds, per = env_seeds(c, 0), c.num_envs // threads
    envs = [HostRollout(algo, seeds[a * per:(a + 1) * per]) for a in range(threads)]
    state = initial_state(algo, jax.random.PRNGKey(c.seed), hp,
                          np.concatenate([e.obs for e in envs]))[0]
    key = jax.random.fold_in(jax.random.PRNGKey(c.seed), ACTOR_KEY_TAG)
    noise = jax.jit(lambda k, ids: ppo.rollout_noise(algo, k, ids)[0])
    update = jax.jit(lambda s, traj: ppo.update(algo, s, traj, s.env_ids, hp, s.env_steps,
                                                s.obs_stats))

    def play(k, st):
        parts = [e.collect(st.params, st.obs_stats,
                           np.asarray(noise(jax.random.fold_in(key, k),
                                            jnp.arange(a * per, (a + 1) * per))), c.gamma)
                 for a, e in enumerate(envs)]
        # the logits' (unused) log_std, one per env as the runner keeps it
        parts = [p._replace(dist=p.dist._replace(log_std=np.broadcast_to(
            p.dist.log_std[:, None], p.dist.loc.shape))) for p in parts]
        return jax.tree.map(lambda *xs: np.concatenate(xs, axis=1), *parts)

    try:
        pending, metrics = play(0, state), []
        for k in range(1, iterations + 1):
            upcoming = play(k, state) if k < iterations else None
            state, m = update(state, pending)
            pending = upcoming
            metrics.append(jax.device_get(m))
    finally:
        for e in envs:
            e.close()
    return state, metrics


def test_lag_one_is_its_schedule_replayed_in_one_thread():
    """Two actor threads at lag 1 give exactly the numbers of the schedule played in order:
    every rollout k >= 1 acted with the params after k - 1 updates, whatever the timing."""
    result = jaxppo.train(DRIFT, progress=False)
    state, metrics = replay_lag_one(DRIFT, DRIFT.num_iterations, threads=2)
    assert _same(result.state.params, state.params)
    assert _same(result.state.obs_stats, state.obs_stats)
    np.testing.assert_array_equal(result.metrics["kl"], [[m["kl"] for m in metrics]])
    np.testing.assert_array_equal(result.metrics["policy_lag"], [[0, 1, 1, 1, 1]])
    assert result.layout.endswith("actor-learner: 2 actor threads x 2 envs (actor_threads=2), "
                                  "max_policy_lag 1")
    assert (result.metrics["actor_wait_seconds"] >= 0).all()
    assert (result.metrics["learner_wait_seconds"] >= 0).all()


def test_rollouts_record_the_behaviour_policy_and_lags_stay_within_the_bound():
    """Each rollout's log-probs are those of the params version it records (with that
    version's observation statistics), not the learner's; at lag 2 every update's lag is
    within [0, 2]; each actor steps its own num_envs / actor_threads envs, in env order."""
    runner = _runner(DRIFT.replace(max_policy_lag=2, total_timesteps=4 * 8 * 6))
    try:
        algo = runner.algorithm
        versions = {0: jax.device_get((runner.state.params, runner.state.obs_stats))}
        log_prob = jax.jit(lambda p, s, obs, a: networks.log_prob(
            algo.discrete, algo.network.apply(p, algo.obs_in(s, obs))[0], a))
        lags = []
        for it in range(6):
            m = runner.train_chunk(it, it + 1)
            versions[it + 1] = jax.device_get((runner.state.params, runner.state.obs_stats))
            lags.append(float(m["policy_lag"][0]))
            for actor, r in zip(runner.actors, runner.last_rollouts):
                params, stats = versions[r.version]
                assert r.index == it and it - 2 <= r.version <= it
                assert _same(r.obs_stats, stats)
                assert r.traj.obs.shape[1] == 2 and list(actor.env_ids) == [
                    2 * actor.index, 2 * actor.index + 1]
                np.testing.assert_allclose(
                    r.traj.log_prob, log_prob(params, stats, r.traj.obs, r.traj.action),
                    rtol=1e-5, atol=1e-6)
                if r.version < it:  # the learner's params had moved on: other log-probs
                    learner = log_prob(*versions[it], r.traj.obs, r.traj.action)
                    assert not np.allclose(r.traj.log_prob, learner, atol=1e-6)
        assert lags[0] == 0 and all(0 <= lag <= 2 for lag in lags) and max(lags) >= 1
    finally:
        runner.close()


def test_one_actors_rollout_goes_to_the_update_uncopied_and_is_let_go_after():
    """With one actor thread the update learns from the actor's own buffers (no joined copy);
    the rollouts an update learned from are held (`last_rollouts`) until the next update
    begins, not through it."""
    runner = _runner(DRIFT.replace(actor_threads=1, total_timesteps=4 * 8 * 3))
    try:
        _, traj = runner.iterate()
        (first,) = runner.last_rollouts
        assert traj.obs is first.traj.obs and traj.action is first.traj.action
        taken = []
        original = runner._take
        runner._take = lambda actor, k: taken.append(list(runner.last_rollouts)) or original(
            actor, k)
        runner.iterate()
        assert taken == [[]]  # let go before the next rollout was waited for
        assert runner.last_rollouts[0].index == 1
    finally:
        runner.close()


def test_actor_threads_from_the_cores_divide_num_envs():
    cfg = DRIFT.replace(actor_threads=None, num_envs=6)
    assert actorlearner.actor_threads(cfg, cores=2)[0] == 1
    assert actorlearner.actor_threads(cfg, cores=5)[0] == 3  # 4 cores left; 3 divides 6
    assert actorlearner.actor_threads(cfg, cores=16)[0] == 6
    threads, why = actorlearner.actor_threads(cfg, cores=5)
    assert why == "actor_threads null: 5 cores, one left to the learner, 3 dividing num_envs=6"
    # On hosts each host's threads split its own envs (num_envs / hosts).
    cfg = cfg.replace(num_envs=12)
    assert actorlearner.actor_threads(cfg, cores=5, hosts=2) == (
        3, "actor_threads null: 5 cores, one left to the learner, 3 dividing this host's 6 envs "
           "(num_envs=12 / 2 hosts)")
    assert actorlearner.actor_threads(cfg, cores=16, hosts=4)[0] == 3


# ---------------------------------------------------------------------- lag 0
def test_lag_zero_is_the_synchronous_host_loop_bit_for_bit():
    """max_policy_lag 0 trains with the host loop: each iteration's noise from the learner's
    key, the rollout with the current params, then the update, exactly as written out here."""
    cfg = DRIFT.replace(max_policy_lag=0, actor_threads=None)
    runner = _runner(cfg)
    assert type(runner) is HostLoopRunner
    runner.close()
    result = jaxppo.train(cfg, progress=False)
    assert "policy_lag" not in result.metrics and "actor-learner" not in result.layout
    run = jaxppo.resolve(cfg)
    algo, hp = Algorithm.create(run), HyperParams.from_config(run.config)
    envs = HostRollout(algo, env_seeds(run.config, 0))
    state = initial_state(algo, jax.random.PRNGKey(cfg.seed), hp, envs.obs)[0]
    update = jax.jit(lambda s, traj, stats: ppo.update(algo, s, traj, s.env_ids, hp,
                                                       s.env_steps, stats))
    kl = []
    for _ in range(cfg.num_iterations):
        rng, k_roll = jax.random.split(state.rng)
        noise = np.asarray(ppo.rollout_noise(algo, k_roll, state.env_ids)[0])
        traj = envs.collect(state.params, state.obs_stats, noise, cfg.gamma)
        state, m = update(state.replace(rng=rng), traj, state.obs_stats)
        kl.append(float(m["kl"]))
    envs.close()
    assert _same(result.state.params, state.params)
    np.testing.assert_array_equal(result.metrics["kl"], np.asarray([kl], np.float32))


# ---------------------------------------------------------------------- config
def test_config_errors_name_the_fix():
    with pytest.raises(ConfigError, match=r"max_policy_lag=1 is an option of envs that step in "
                                          r"Python, but CartPole-v1 steps inside the compiled "
                                          r"program.*remove it.*env='gymnasium:<id>'"):
        jaxppo.resolve(jaxppo.PPOConfig(env="CartPole-v1", max_policy_lag=1))
    with pytest.raises(ConfigError, match=r"gymnasium_vectorization='async' is an option"):
        jaxppo.resolve(jaxppo.PPOConfig(gymnasium_vectorization="async"))
    with pytest.raises(ConfigError, match=r"actor_threads=2 only applies to the actor-learner "
                                          r"\(max_policy_lag >= 1\).*set max_policy_lag=1"):
        jaxppo.resolve(DRIFT.replace(max_policy_lag=0))
    with pytest.raises(ConfigError, match=r"num_envs=4 is not divisible by actor_threads=3.*"
                                          r"actor_threads in \[1, 2, 4\]"):
        jaxppo.resolve(DRIFT.replace(actor_threads=3))
    with pytest.raises(ConfigError, match=r"max_policy_lag=-1 must be an integer >= 0"):
        DRIFT.replace(max_policy_lag=-1).validate()
    with pytest.raises(ConfigError, match=r"unknown config key 'num_actor_threads'; did you mean "
                                          r"'actor_threads'"):
        jaxppo.PPOConfig.from_dict({"num_actor_threads": 2})


def test_async_vector_envs_give_the_numbers_of_sync_ones():
    """gymnasium_vectorization='async' (a subprocess per env) steps the same envs."""
    cfg = jaxppo.PPOConfig(env="gymnasium:CartPole-v1", num_envs=2, num_steps=8,
                           num_minibatches=2, num_epochs=1, total_timesteps=2 * 8 * 3,
                           compilation_cache_dir=None, max_policy_lag=1, actor_threads=1,
                           network=jaxppo.NetworkConfig(hidden_sizes=(8,)))
    sync = jaxppo.train(cfg, progress=False)
    run = _runner(cfg.replace(gymnasium_vectorization="async"))
    try:
        assert type(run.actors[0].rollout.envs).__name__ == "AsyncVectorEnv"
        run.train_chunk(0, cfg.num_iterations)
        assert _same(run.state.params, sync.state.params)
    finally:
        run.close()


# ---------------------------------------------------------------------- faults
def test_an_actor_error_stops_the_run_with_it(tmp_path):
    """An env that raises in an actor thread: the run stops with that error, a note names the
    actor and where; the checkpoints so far stay and the threads are joined."""
    Drift.FAIL_AT = 30  # the 4th rollout of 8 steps of each env
    cfg = DRIFT.replace(total_timesteps=4 * 8 * 20, checkpoint_every=1, log_every=1)
    with pytest.raises(ValueError, match="the simulator lost its state") as info:
        jaxppo.train(cfg, run_dir=tmp_path / "run", progress=False)
    notes = "\n".join(info.value.__notes__)
    assert "jaxppo: actor thread 0 of 2 (envs 0-1) raised this while playing rollout 3 " \
           "(iteration 4); the run stopped. Where: test_actorlearner.py:" in notes
    assert "hostloop.py" in notes and "in step" in notes
    assert f"keeps the checkpoint of iteration 3: continue with --resume {tmp_path / 'run'}" in notes
    assert _latest_checkpoint(tmp_path / "run") == 3


def test_a_stalled_env_stops_the_run_after_the_timeout(monkeypatch):
    """A step that does not return: RolloutTimeoutError after rollout_timeout, naming the
    actor and what it does, while the step is still stuck; close() waits for the stuck
    thread a bounded time, then says so. The timeout counts only once the step has stalled
    (one actor thread: the learner then waits for the stalled rollout alone), so rollouts a
    loaded machine plays slowly before it cannot trip it."""
    Drift.STALL_AT = 20
    monkeypatch.setattr(actorlearner, "JOIN_SECONDS", 0.2)
    timeout = ActorLearnerRunner._timeout
    monkeypatch.setattr(ActorLearnerRunner, "_timeout",
                        lambda self: timeout(self) if STALLED.is_set() else float("inf"))
    cfg = DRIFT.replace(total_timesteps=4 * 8 * 20, rollout_timeout=1.0, actor_threads=1)
    with pytest.warns(UserWarning, match=r"actor thread\(s\) \[0\] did not stop within 0.2 s "
                                         r"\(stepping its envs \(rollout 2\)\)"):
        with pytest.raises(RolloutTimeoutError, match=r"actor thread 0 of 1 \(envs 0-3\) "
                                                      r"handed over no rollout for \d+\.\d s "
                                                      r"\(rollout_timeout=1\).*stepping its envs "
                                                      r"\(rollout 2\).*raise rollout_timeout"):
            jaxppo.train(cfg, progress=False)
    assert STALLED.is_set() and not UNSTALL.is_set()  # raised while the step is stuck
    UNSTALL.set()
    for thread in threading.enumerate():  # the stuck one ends once its step returns
        if thread.name.startswith("jaxppo-actor"):
            thread.join(Drift.STALL_LIMIT)


def test_a_stop_signal_ends_a_long_chunk_with_a_checkpoint(tmp_path):
    """SIGINT while the first chunk of 200 iterations runs: the learner stops after the update
    in progress, the actors stop, a checkpoint of the last update is saved and the message
    says how to resume."""
    cfg = DRIFT.replace(total_timesteps=4 * 8 * 400, log_every=200)
    start = Drift.STEPS[0]

    def interrupt():
        while Drift.STEPS[0] - start < 4 * 8 * 5:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)
        sent[0] = Drift.STEPS[0] - start  # at most this many // 32 updates were done at the kill

    sent = [None]
    sender = threading.Thread(target=interrupt, daemon=True)
    sender.start()
    with pytest.raises(TrainingInterrupted, match=r"SIGINT stopped training after iteration "
                                                  r"\d+ of 400.*continue with: jaxppo train "
                                                  r"--resume") as info:
        jaxppo.train(cfg, run_dir=tmp_path / "run", progress=False)
    sender.join(60)
    done = info.value.result.iterations_done
    # The update in progress at the signal, not the rest of the chunk: an update learns from
    # a rollout of every env (4 x 8 steps), so at most sent // 32 were done when it came.
    assert 1 <= done <= sent[0] // 32 + 1 and _latest_checkpoint(tmp_path / "run") == done
    assert [r["iteration"] for r in read_metrics(tmp_path / "run")] == list(range(1, done + 1))


# ---------------------------------------------------------------------- resume and learning
def test_resume_restores_the_learner_state_and_continues(tmp_path):
    run_dir = tmp_path / "run"
    first = jaxppo.train(DRIFT, run_dir=run_dir, progress=False, stop_after_iterations=2)
    assert not first.completed
    runner = _runner(DRIFT, restored=jax.device_get(first.state))
    try:
        assert _same(runner.state, first.state)  # the learner state, exactly
        m = runner.train_chunk(2, 3)  # rollout 2 from the restored params: no lag yet
        assert m["policy_lag"][0] == 0 and m["env_steps"][0] == 3 * 32
    finally:
        runner.close()
    done = jaxppo.train(None, resume=run_dir, progress=False)
    rows = read_metrics(run_dir)
    assert done.completed and [r["iteration"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["policy_lag"] for r in rows] == [0, 1, 0, 1, 1]  # envs restart after a resume
    assert [r["env_steps"] for r in rows] == [32 * i for i in range(1, 6)]


@pytest.mark.slow
def test_learns_gymnasium_cartpole_at_lag_one():
    """The host loop's CartPole test at max_policy_lag 1 (about 15 s on 2 cores)."""
    cfg = jaxppo.PPOConfig(env="gymnasium:CartPole-v1", num_envs=8, num_steps=128, num_epochs=8,
                           num_minibatches=8, total_timesteps=8 * 128 * 58, lr=1e-3,
                           vf_clip_param=None, compilation_cache_dir=None, seed=1,
                           max_policy_lag=1)
    result = jaxppo.train(cfg, progress=False)
    curve = result.metrics["episode_return_mean"][0]
    assert np.nanmean(curve[:3]) < 60
    assert np.nanmean(curve[-5:]) > 400, curve[-10:]
    assert result.evaluate(episodes=4)["return_mean"] > 400
