"""The contract every suite adapter ("brax:", "jumanji:", "craftax:", "xminigrid:") keeps,
checked against the suite's own reset and step, one small spec per suite: its spec and run
name; a reset and steps equal to the suite's own (observations, rewards, no end); jaxppo's time
limit as a truncation, with the final observation and the reset drawn with the step's key; a
real end as a termination; the env contract check; the errors that name the fix; and the
install named when the suite is missing. A suite stepped in Python by the host loop
("envpool:") keeps the spec, run name, error and install checks here; its transitions are
checked against the suite's own vector env in its own file. What only one suite has stays in
its own file (tests/envs/test_<suite>.py). A suite that is not installed is skipped (CI
installs them all with the dev extra).

Per suite one jitted adapter rollout and one of the suite's own serve every comparison (a
rollout starts from a given state, so a test may edit it, and params are arguments, so a
time limit does not recompile)."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo.envs.check import check_env
from jaxppo.envs.make import make_env
from jaxppo.errors import ConfigError

pytestmark = [  # brax's and jaxopt's own deprecation notices, not this package's
    pytest.mark.filterwarnings("ignore:Accessing `ncon` directly:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:JAXopt is no longer maintained:DeprecationWarning"),
    # The adapter's rollout and the suite's own are two programs whose floats must agree to
    # the last bit: compiled as users' runs are, they do; with LLVM at -O0 an instruction
    # sequence can differ between them (one ulp in a Craftax observation, seen).
    pytest.mark.full_optimization,
]


def _tiny(env: str, **kw) -> jaxppo.PPOConfig:
    return jaxppo.PPOConfig(env=env, num_envs=2, num_steps=8, num_minibatches=2, num_epochs=1,
                            total_timesteps=16, network=jaxppo.NetworkConfig((8,)),
                            compilation_cache_dir=None, **kw)


@dataclass(frozen=True)
class Scenario:
    """From the reset with `seed`'s key: actions (from the reset state and T) and,
    optionally, an edit of that state."""
    seed: int
    actions: Callable[[Any, int], jax.Array]
    edit: Callable[[Any], Any] | None = None


@dataclass(frozen=True, kw_only=True)
class NamedSuite:
    """What the spec, run name, error and install checks need to know of one suite (all of a
    suite the host loop steps in Python)."""
    package: str
    config: jaxppo.PPOConfig
    env_name: str
    obs_shape: tuple
    discrete: bool
    action_dim: int
    max_steps: int  # the suite's own episode limit, as max_steps_in_episode
    typo: str
    listing: str  # what the did-you-mean message lists
    bare: str  # the name without its suite prefix
    hidden: tuple  # modules that, missing, make the suite missing
    own_limit: tuple | None = None  # (env_kwargs, message) of the suite's own limit, refused


@dataclass(frozen=True, kw_only=True)
class Suite(NamedSuite):
    """And what the transition checks need to know of a suite adapter.

    native(spec) -> jitted f(key, state, keys, actions, params, limit) -> (obs0, (obs, reward,
    done, discount)) [T]: the suite's own env without auto-reset, reset with `key` (or, where
    the adapter's state is the suite's, stepping from `state`); `params` the adapter's, `limit`
    the time limit applied to the suite's own env where it has one.
    """
    time: Callable[[Any], jax.Array]  # the adapter state's step counter
    native: Callable
    T: int
    steps: Scenario  # steps that end no episode (compared for `compared` steps)
    compared: int | None
    limit: int
    limit_steps: Scenario
    limit_native: tuple  # (done, discount) of the suite's own env at its limit
    every_limit: bool  # nothing but the limit ends an episode in limit_steps
    end: Scenario  # a real end
    reset_key: Callable[[jax.Array], jax.Array] = lambda k: k  # the step key -> its reset's
    tol: float = 0.0
    check_steps: int | None = None  # the contract check's random steps; 0: trace only
    on_end: Callable | None = None  # suite-specific checks of the end
    on_limit: Callable | None = None  # and of the time limit


# ------------------------------------------------------------------------------- suites
def _brax_native(spec):
    env = spec.env.brax_env

    @jax.jit
    def rollout(key, state, keys, actions, params, limit):
        state = env.reset(key)

        def body(state, a):
            state = env.step(state, a)
            return state, (state.obs, jnp.asarray(state.reward, jnp.float32), state.done > 0,
                           1.0 - state.done)

        return state.obs, jax.lax.scan(body, state, actions)[1]

    return rollout


def _brax_on_limit(out, L):
    obs, reward, term, trunc, final_obs, time = out
    assert not np.allclose(final_obs[L - 1], obs[L - 1])  # the reset's, not the last one


def _brax_on_end(out, first, state):
    obs, reward, term, trunc, final_obs, time = out
    assert abs(float(final_obs[first, 1])) > 0.2  # the pole's angle past Brax's limit


BRAX = Suite(
    package="brax", config=_tiny("brax:inverted_pendulum"), env_name="brax-inverted_pendulum",
    obs_shape=(4,), discrete=False, action_dim=1, max_steps=1000,  # Brax's episode_length
    time=lambda s: s.time, native=_brax_native, T=48,
    # the unbalanced pole falls after about 15 steps: compare the steps before
    steps=Scenario(0, lambda s, T: 0.1 * jnp.where(jnp.arange(T) % 2, 1.0, -1.0)[:, None]),
    compared=10,
    limit=5, limit_steps=Scenario(1, lambda s, T: jnp.zeros((T, 1))), limit_native=(False, 1.0),
    every_limit=True, on_limit=_brax_on_limit,
    # push the cart one way until the pole falls
    end=Scenario(2, lambda s, T: jnp.ones((T, 1))), on_end=_brax_on_end,
    typo="brax:inverted_pendulm", listing=r"Registered: .*brax:halfcheetah",
    bare="inverted_pendulum", hidden=("brax", "brax.envs"), tol=1e-6,
    own_limit=({"episode_length": 100}, r"max_steps_in_episode, Brax's episode_length"))

SNAKE_ROWS = SNAKE_COLS = 6
UP, RIGHT, DOWN, LEFT = 0, 1, 2, 3


def _jumanji_native(spec):
    env = spec.env.jumanji_env

    def flat(o):  # Snake's field order: grid, step_count, action_mask
        return jnp.concatenate([o.grid.reshape(-1), o.step_count[None].astype(jnp.float32),
                                o.action_mask.astype(jnp.float32)])

    @jax.jit
    def rollout(key, state, keys, actions, params, limit):
        state, ts = env.reset(key)

        def body(state, a):
            state, ts = env.step(state, a)
            return state, (flat(ts.observation), ts.reward, ts.step_type == 2, ts.discount)

        return flat(ts.observation), jax.lax.scan(body, state, actions)[1]

    return rollout


def _square(state, T):
    """Actions that walk a 2x2 square inside the grid from the head (never an edge)."""
    head = state.jumanji_state.head_position
    row, col = int(head.row), int(head.col)
    h, v = (RIGHT, LEFT) if col < SNAKE_COLS - 1 else (LEFT, RIGHT)
    d, u = (DOWN, UP) if row < SNAKE_ROWS - 1 else (UP, DOWN)
    return jnp.asarray([h, d, v, u] * (T // 4 + 1), jnp.int32)[:T]


def _jumanji_on_end(out, first, state):
    # up from row r: r steps to row 0, the next one leaves the grid
    assert first == int(state.jumanji_state.head_position.row)


JUMANJI = Suite(
    package="jumanji",
    config=_tiny("jumanji:Snake-v1", env_kwargs={"num_rows": SNAKE_ROWS, "num_cols": SNAKE_COLS}),
    env_name="Snake-v1", obs_shape=(SNAKE_ROWS * SNAKE_COLS * 5 + 1 + 4,), discrete=True,
    action_dim=4, max_steps=4000,  # Snake's own time_limit
    time=lambda s: s.time, native=_jumanji_native, T=24,
    steps=Scenario(0, _square), compared=None,
    # The reset after the limit starts elsewhere, so the square may hit a wall later: the
    # first episode and its end are compared.
    limit=5, limit_steps=Scenario(0, _square), limit_native=(False, 1.0), every_limit=False,
    end=Scenario(1, lambda s, T: jnp.full((T,), UP, jnp.int32)),  # up until off the grid
    on_end=_jumanji_on_end,
    typo="jumanji:Snak-v1", listing=r"Available: .*jumanji:Game2048-v1", bare="Snake-v1",
    hidden=("jumanji",), check_steps=128)

CRAFTAX_NOOP = 0


def _craftax_native(spec):
    env = spec.env.craftax_env

    @jax.jit
    def rollout(key, state, keys, actions, params, limit):
        """Steps from the adapter's state (Craftax's own) with the step key the adapter
        derives, split(keys[t])[0], as gymnax does."""
        craftax_params = params.craftax.replace(max_timesteps=limit)
        obs0, _ = env.reset(key, craftax_params)

        def body(state, x):
            k, a = x
            obs, state, reward, done, info = env.step(jax.random.split(k)[0], state, a,
                                                      craftax_params)
            return state, (obs, reward, done, info["discount"])

        return obs0, jax.lax.scan(body, state, (keys, actions))[1]

    return rollout


def _craftax_lava(state):
    from craftax.craftax_classic.constants import BlockType

    x, y = (int(v) for v in state.player_position)
    return state.replace(map=state.map.at[x, y].set(BlockType.LAVA.value))


def _craftax_on_end(out, first, state):
    obs, reward, term, trunc, final_obs, time = out
    assert first == 0 and not np.asarray(term[1:]).any()  # a new world, no lava


CRAFTAX = Suite(
    package="craftax", config=_tiny("craftax:Craftax-Classic-Symbolic-v1"),
    env_name="Craftax-Classic-Symbolic-v1", obs_shape=(1345,), discrete=True, action_dim=17,
    max_steps=10000,  # Craftax-Classic's max_timesteps
    time=lambda s: s.timestep, native=_craftax_native, T=12,
    steps=Scenario(0, lambda s, T: jax.random.randint(jax.random.PRNGKey(1), (T,), 0, 17)),
    compared=None,
    # Craftax says only `done` (discount 0) at its limit: the adapter makes it a truncation.
    limit=5, limit_steps=Scenario(2, lambda s, T: jnp.full((T,), CRAFTAX_NOOP, jnp.int32)),
    limit_native=(True, 0.0), every_limit=True,
    end=Scenario(3, lambda s, T: jnp.full((T,), CRAFTAX_NOOP, jnp.int32), edit=_craftax_lava),
    on_end=_craftax_on_end,
    typo="craftax:Craftax-Clasic-Symbolic-v1", listing=r"Available: .*craftax:Craftax-Symbolic-v1",
    bare="Craftax-Classic-Symbolic-v1", hidden=("craftax", "craftax.craftax_env"),
    reset_key=lambda k: jax.random.split(k)[1],
    check_steps=0,  # Craftax compiles slowly on a CPU: check_env's run would take ~13 s more
    own_limit=({"max_timesteps": 100}, r"time limit is env_kwargs max_steps_in_episode"))

FORWARD, TURN_RIGHT, TURN_LEFT = 0, 1, 2
# From (1, 1) facing right: two steps right, turn to face down, two steps down: the goal (3, 3).
TO_GOAL = [FORWARD, FORWARD, TURN_RIGHT, FORWARD, FORWARD]


def _xminigrid_native(spec):
    env = spec.env.xminigrid_env

    @jax.jit
    def rollout(key, state, keys, actions, params, limit):
        xparams = params.xminigrid.replace(max_steps=limit)
        ts = env.reset(xparams, key)

        def body(ts, a):
            ts = env.step(xparams, ts, a)
            return ts, (ts.observation, ts.reward, ts.step_type == 2, ts.discount)

        return ts.observation, jax.lax.scan(body, ts, actions)[1]

    return rollout


def _xminigrid_on_end(out, first, state):
    obs, reward, term, trunc, final_obs, time = out
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(term)), [first])
    assert first == 4 and float(reward[4]) == pytest.approx(1 - 0.9 * 5 / 100)


XMINIGRID = Suite(
    package="xminigrid", config=_tiny("xminigrid:MiniGrid-Empty-5x5"),
    env_name="MiniGrid-Empty-5x5", obs_shape=(7, 7, 2), discrete=True, action_dim=6,
    max_steps=100,  # xminigrid's max_steps: 4 * 5 * 5
    time=lambda s: s.state.step_num, native=_xminigrid_native, T=16,
    steps=Scenario(0, lambda s, T: jnp.asarray(
        [TURN_RIGHT, TURN_LEFT, FORWARD, TURN_LEFT, TURN_RIGHT, FORWARD, TURN_LEFT, TURN_LEFT]
        * 2, jnp.int32)),  # never reach the goal
    compared=None,
    # turning on the spot; xminigrid ends its limit as LAST with discount 1
    limit=4, limit_steps=Scenario(2, lambda s, T: jnp.full((T,), TURN_RIGHT, jnp.int32)),
    limit_native=(True, 1.0), every_limit=True,
    end=Scenario(1, lambda s, T: jnp.asarray(TO_GOAL + [TURN_RIGHT] * (T - 5), jnp.int32)),
    on_end=_xminigrid_on_end,
    typo="xminigrid:MiniGrid-Emtpy-5x5", listing=r"Available: .*xminigrid:MiniGrid-FourRooms",
    bare="MiniGrid-Empty-5x5", hidden=("xminigrid",), check_steps=256,
    own_limit=({"max_steps": 10}, r"time limit is env_kwargs max_steps_in_episode"))

SUITES = {"brax": BRAX, "jumanji": JUMANJI, "craftax": CRAFTAX, "xminigrid": XMINIGRID}


ENVPOOL = NamedSuite(
    package="envpool", config=_tiny("envpool:Breakout-v5"), env_name="Breakout-v5",
    obs_shape=(84, 84, 4), discrete=True, action_dim=4, max_steps=27000,  # envpool's limit
    typo="envpool:Breakuot-v5", listing=r"list_all_envs\(\) lists its \d+ tasks",
    bare="Breakout-v5", hidden=("envpool",),
    own_limit=({"max_steps_in_episode": 100}, r"instead of max_steps_in_episode, set env_kwargs "
                                              r"max_episode_steps \(envpool's own time limit\)"))

HOST_SUITES = {"envpool": ENVPOOL}


# ------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module", params=list(SUITES))
def suite(request):
    """(suite, spec, reset, adapter rollout, the suite's own rollout), jitted, per suite."""
    s = SUITES[request.param]
    spec = _built(s)
    env = spec.env

    @jax.jit
    def adapter_rollout(params, state, keys, actions):
        """Step from `state` with keys[t] and actions[t] ([T], [T, ...])."""
        def body(state, x):
            k, a = x
            obs, state, reward, term, trunc, info = env.step(k, state, a, params)
            return state, (obs, reward, term, trunc, info["final_observation"], s.time(state))

        return jax.lax.scan(body, state, (keys, actions))[1]

    reset = jax.jit(lambda k, p: env.reset(k, p))
    return s, spec, reset, adapter_rollout, s.native(spec)


def _keys(s: Suite, seed: int):
    key, *keys = jax.random.split(jax.random.PRNGKey(seed), s.T + 1)
    return key, jnp.stack(keys)


def _run(suite, scenario: Scenario, params=None, limit=None):
    """Both rollouts of `scenario`: (obs0, the adapter's (obs, reward, term, trunc, final_obs,
    time), the suite's (obs0, (obs, reward, done, discount)), keys, the state stepped from)."""
    s, spec, reset, adapter_rollout, native = suite
    params = spec.env_params if params is None else params
    key, keys = _keys(s, scenario.seed)
    obs0, state = reset(key, params)
    actions = scenario.actions(state, s.T)
    if scenario.edit is not None:
        state = scenario.edit(state)
    out = adapter_rollout(params, state, keys, actions)
    own = native(key, state, keys, actions, params, limit or s.max_steps)
    return obs0, out, own, keys, state


def _same(a, b, s: Suite):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=s.tol, atol=s.tol)


@pytest.fixture(scope="module", params=list(HOST_SUITES))
def host_suite(request):
    """(suite, spec) per host-loop suite."""
    s = HOST_SUITES[request.param]
    return s, _built(s)


def _built(s):
    """The spec of the suite's config; the test is skipped where the suite is not installed."""
    if importlib.util.find_spec(s.package) is None:
        pytest.skip(f"{s.package} is not installed: pip install 'jaxppo[{s.package}]' "
                    "(the dev extra installs it)")
    return make_env(s.config)


# ------------------------------------------------------------------------------- the contract
def test_spec_and_run_name(suite):
    _check_spec_and_run_name(*suite[:2])


def test_host_suite_spec_and_run_name(host_suite):
    s, spec = host_suite
    _check_spec_and_run_name(s, spec)
    assert spec.host_loop


def _check_spec_and_run_name(s, spec):
    assert spec.obs_shape == s.obs_shape
    assert spec.discrete == s.discrete and spec.action_dim == s.action_dim
    assert spec.env_params.max_steps_in_episode == s.max_steps
    assert s.config.env_name == s.env_name  # run folders: no ':' in the name
    assert s.config.to_dict()["env"] == s.config.env  # config.yaml rebuilds it by name


def test_reset_and_steps_equal_the_suites_own(suite):
    s = suite[0]
    obs0, out, (own_obs0, own), *_ = _run(suite, s.steps)
    obs, reward, term, trunc, final_obs, time = out
    own_obs, own_reward, own_done, _ = own
    n = s.compared or s.T
    assert not np.asarray(own_done[:n]).any()  # these steps end no episode
    np.testing.assert_array_equal(obs0, own_obs0)
    _same(obs[:n], own_obs[:n], s)
    _same(final_obs[:n], own_obs[:n], s)
    _same(reward[:n], own_reward[:n], s)
    assert not np.asarray(term[:n]).any() and not np.asarray(trunc[:n]).any()
    np.testing.assert_array_equal(time[:n], np.arange(1, n + 1))


def test_time_limit_is_a_truncation_with_the_final_observation(suite):
    s, spec, reset, *_ = suite
    L = s.limit
    limit = make_env(s.config.replace(
        env_kwargs={**s.config.env_kwargs, "max_steps_in_episode": L})).env_params
    assert limit.max_steps_in_episode == L
    _, out, (_, own), keys, _ = _run(suite, s.limit_steps, params=limit, limit=L)
    obs, reward, term, trunc, final_obs, time = out
    own_obs, own_reward, own_done, own_discount = own
    assert not np.asarray(own_done[:L - 1]).any()
    assert (bool(own_done[L - 1]), float(own_discount[L - 1])) == s.limit_native
    assert np.flatnonzero(np.asarray(trunc))[0] == L - 1 and not np.asarray(term[:L]).any()
    if s.every_limit:
        np.testing.assert_array_equal(np.flatnonzero(np.asarray(trunc)), np.arange(L - 1, s.T, L))
        assert not np.asarray(term).any()
    _same(final_obs[:L], own_obs[:L], s)
    _same(reward[:L], own_reward[:L], s)
    # The step at the limit returns the reset's observation, drawn with that step's key.
    np.testing.assert_array_equal(obs[L - 1], reset(s.reset_key(keys[L - 1]), limit)[0])
    np.testing.assert_array_equal(time[:L + 1], [*range(1, L), 0, 1])
    if s.on_limit is not None:
        s.on_limit(out, L)


def test_a_real_end_is_a_termination(suite):
    s, spec, reset, *_ = suite
    _, out, (_, own), keys, state = _run(suite, s.end)
    obs, reward, term, trunc, final_obs, time = out
    own_obs, own_reward, own_done, own_discount = own
    first = int(np.argmax(np.asarray(own_done)))
    assert bool(own_done[first]) and float(own_discount[first]) == 0.0 and first < s.T - 1
    assert np.flatnonzero(np.asarray(term))[0] == first and not np.asarray(trunc).any()
    _same(final_obs[:first + 1], own_obs[:first + 1], s)
    _same(reward[:first + 1], own_reward[:first + 1], s)
    np.testing.assert_array_equal(obs[first], reset(s.reset_key(keys[first]),
                                                    spec.env_params)[0])
    assert int(time[first]) == 0
    assert int(time[first + 1]) == (0 if term[first + 1] else 1)  # a new episode's first step
    if s.on_end is not None:
        s.on_end(out, first, state)


def test_the_adapter_keeps_the_env_contract(suite):
    s, spec, *_ = suite
    env, params = spec.env, spec.env_params
    key = jax.random.PRNGKey(0)
    obs, state = jax.eval_shape(lambda k: env.reset(k, params), key)
    out = jax.eval_shape(lambda k, st: env.step(k, st, env.action_space(params).sample(k),
                                                params), key, state)
    assert jax.tree.structure(out[1]) == jax.tree.structure(state)
    assert all(a.shape == b.shape and a.dtype == b.dtype
               for a, b in zip(jax.tree.leaves(out[1]), jax.tree.leaves(state)))
    assert out[0].shape == out[5]["final_observation"].shape == obs.shape == s.obs_shape
    assert [x.dtype for x in out[2:5]] == [jnp.float32, jnp.bool_, jnp.bool_]
    if s.check_steps != 0:  # the whole check, which make_env skips for a trusted adapter
        kw = {} if s.check_steps is None else {"steps": s.check_steps}
        check_env(env, params, s.config.env, **kw)


def test_errors_name_the_fix(suite):
    _check_errors(suite[0])


def test_host_suite_errors_name_the_fix(host_suite):
    _check_errors(host_suite[0])


def _check_errors(s):
    env = s.config.env
    with pytest.raises(ConfigError, match=rf"did you mean '{env}'.*{s.listing}"):
        make_env(s.config.replace(env=s.typo))
    with pytest.raises(ConfigError, match=rf"did you mean '{env}'"):
        make_env(s.config.replace(env=s.bare, env_kwargs={}))
    if s.own_limit is not None:
        kwargs, message = s.own_limit
        with pytest.raises(ConfigError, match=message):
            make_env(s.config.replace(env_kwargs=kwargs))


@pytest.mark.parametrize("name", list(SUITES) + list(HOST_SUITES))
def test_without_the_suite_its_envs_name_the_install(monkeypatch, name):
    s = {**SUITES, **HOST_SUITES}[name]
    for module in s.hidden:
        monkeypatch.setitem(sys.modules, module, None)  # import -> ImportError
    with pytest.raises(ConfigError, match=rf"pip install 'jaxppo\[{s.package}\]'"):
        make_env(s.config)
