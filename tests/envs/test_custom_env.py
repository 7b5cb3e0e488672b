"""A user's own env: the checks made before compiling (each broken env gets a ConfigError
that names the problem), env="module:Class", and run folders that record the env's import
path so that load_policy, eval and --resume need no env= keyword."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import yaml
from flax import struct
from gymnax.environments import environment, spaces

import jaxppo
from checkpoint_records import edit_records  # tests/ is on sys.path
from jaxppo import cli
from jaxppo.envs.record import env_record
from jaxppo.envs.make import make_env

import custom_env_module  # tests/ is on sys.path (pytest's rootdir-relative import)

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
CORRIDOR = "custom_env_module:Corridor"
TINY = jaxppo.PPOConfig(
    env=CORRIDOR, num_envs=4, num_steps=8, num_minibatches=2, num_epochs=1,
    total_timesteps=4 * 8 * 2, network=jaxppo.NetworkConfig((8,)), compilation_cache_dir=None)


# ---------------------------------------------------------------------- a hand-written env
@struct.dataclass
class WalkParams:
    max_steps_in_episode: int = 10


@struct.dataclass
class WalkState:
    time: jax.Array
    position: jax.Array


class Walk:
    """The gymnax API written by hand (no gymnax base class): a walk on a line that ends at
    |position| = 3 (terminated) or after max_steps_in_episode steps (truncated); auto-resets."""

    default_params = WalkParams()

    def reset(self, key, params):
        state = WalkState(time=jnp.int32(0), position=jnp.float32(0.0))
        return self.obs(state), state

    def obs(self, state):
        return jnp.stack([state.position, jnp.float32(1.0)])

    def transition(self, key, state, action, params):
        position = state.position + jnp.where(action == 1, 1.0, -1.0)
        state = WalkState(time=state.time + 1, position=position)
        terminated = jnp.abs(position) >= 3
        truncated = state.time >= params.max_steps_in_episode
        return self.obs(state), state, jnp.float32(1.0), terminated, truncated

    def step(self, key, state, action, params):
        obs, state, reward, terminated, truncated = self.transition(key, state, action, params)
        done = terminated | truncated
        obs_reset, state_reset = self.reset(key, params)
        state = jax.tree.map(lambda r, s: jnp.where(done, r, s), state_reset, state)
        return (jnp.where(done, obs_reset, obs), state, reward, terminated, truncated,
                {"final_observation": obs})

    def action_space(self, params=None):
        return spaces.Discrete(2)

    def observation_space(self, params):
        return spaces.Box(-10.0, 10.0, (2,), jnp.float32)


class FiveValues(Walk):  # old gymnax: (obs, state, reward, done, info)
    def step(self, key, state, action, params):
        obs, state, reward, term, trunc, info = super().step(key, state, action, params)
        return obs, state, reward, term | trunc, info


class NoFinalObservation(Walk):
    def step(self, key, state, action, params):
        return super().step(key, state, action, params)[:5] + ({},)


class WrongObsShape(Walk):
    def observation_space(self, params):
        return spaces.Box(-10.0, 10.0, (3,), jnp.float32)


class WrongObsDtype(Walk):
    def observation_space(self, params):
        return spaces.Box(-10, 10, (2,), jnp.int32)


class NoAutoReset(Walk):  # steps on from the terminal state: state.time never goes back to 0
    def step(self, key, state, action, params):
        obs, state, reward, term, trunc = self.transition(key, state, action, params)
        return obs, state, reward, term, trunc, {"final_observation": obs}


@struct.dataclass
class DriftState:
    position: jax.Array


class DriftNoAutoReset:
    """No time field: drifts right and terminates from position 5 on, never resetting, so
    every step after the first episode ends one again."""

    default_params = WalkParams()

    def reset(self, key, params):
        return jnp.zeros(1), DriftState(jnp.float32(0.0))

    def step(self, key, state, action, params):
        state = DriftState(state.position + 1.0)
        obs = state.position[None]
        return obs, state, jnp.float32(0.0), state.position >= 5, jnp.bool_(False), {
            "final_observation": obs}

    def action_space(self, params=None):
        return spaces.Discrete(2)

    def observation_space(self, params):
        return spaces.Box(-jnp.inf, jnp.inf, (1,), jnp.float32)


class ResetRaises(Walk):
    def reset(self, key, params):
        raise ValueError("the maze file is missing")


class PythonIf(Walk):  # a Python `if` on a traced value fails under jit
    def transition(self, key, state, action, params):
        if action == 1:
            pass
        return super().transition(key, state, action, params)


class NoDefaultParams:
    reset, step = Walk.reset, Walk.step
    action_space, observation_space = Walk.action_space, Walk.observation_space


@struct.dataclass
class BanditState(environment.EnvState):
    pass


class ConstantBandit(environment.Environment):
    """Every episode is one step and every observation the same: nothing to tell a reset
    apart by, and the auto-reset check must still pass it."""

    @property
    def default_params(self):
        return environment.EnvParams(max_steps_in_episode=100)

    def step_env(self, key, state, action, params):
        return jnp.zeros(3), state.replace(time=state.time + 1), action * 1.0, jnp.bool_(True), {}

    def reset_env(self, key, params):
        return jnp.zeros(3), BanditState(time=0)

    def action_space(self, params=None):
        return spaces.Discrete(3)

    def observation_space(self, params):
        return spaces.Box(0.0, 1.0, (3,), jnp.float32)


class InheritsDefaultParams(custom_env_module.Corridor):
    default_params = environment.Environment.default_params

    def step_env(self, key, state, action, params):
        return super().step_env(key, state, action, custom_env_module.CorridorParams())


def check(env, **kw):
    return make_env(TINY.replace(env=env, **kw))


@pytest.mark.parametrize("env, words", [
    (FiveValues(), ["returns 5 values", "terminated", "truncated", "split done",
                    "final_observation"]),
    (NoFinalObservation(), ["no 'final_observation'", "info"]),
    (WrongObsShape(), ["float32[2]", "observation_space", "float32[3]"]),
    (WrongObsDtype(), ["float32[2]", "int32[2]", "observation_space"]),
    (NoAutoReset(), ["does not start a new episode", "state.time", "auto-reset"]),
    (DriftNoAutoReset(), ["does not start a new episode", "episodes of length 1"]),
    (ResetRaises(), ["reset(key, params) raised ValueError: the maze file is missing",
                     "test_custom_env.py:"]),
    (PythonIf(), ["env.step(key, state, action, params) raised", "jnp.where"]),
    (NoDefaultParams(), ["has no default_params"]),
    (InheritsDefaultParams(), ["no default_params of its own", "max_steps_in_episode=1"]),
], ids=lambda v: type(v).__name__ if not isinstance(v, list) else "")
def test_a_broken_env_gets_a_config_error_naming_the_problem(env, words):
    with pytest.raises(jaxppo.ConfigError) as info:
        check(env)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_well_behaved_envs_pass_the_check():
    for env in (Walk(), ConstantBandit(), custom_env_module.Corridor()):
        spec = check(env)
        assert spec.obs_shape == (spec.env.observation_space(spec.env_params).shape)


def test_env_params_of_the_wrong_type():
    with pytest.raises(jaxppo.ConfigError, match=r"env_params=.* is a dict.*use env_kwargs="):
        check(Walk(), env_params={"max_steps_in_episode": 5})
    with pytest.raises(jaxppo.ConfigError, match=r"CartPole-v1 takes EnvParams params"):
        check("CartPole-v1", env_params=WalkParams())
    assert check(Walk(), env_params=WalkParams(5)).env_params.max_steps_in_episode == 5


def test_train_and_make_train_want_a_config():
    with pytest.raises(jaxppo.ConfigError, match=r"PPOConfig\(env='CartPole-v1'\).*"
                                                 r"PPOConfig.tuned\('CartPole-v1'\)"):
        jaxppo.train("CartPole-v1")
    with pytest.raises(jaxppo.ConfigError, match=r"got dict .*PPOConfig.from_dict"):
        jaxppo.make_train({"env": "CartPole-v1"})


def test_module_colon_class_builds_the_env():
    spec = make_env(TINY.replace(env=CORRIDOR, env_kwargs={"length": 6}))
    assert isinstance(spec.env, custom_env_module.Corridor) and spec.env_params.length == 6
    spec = make_env(TINY.replace(env="custom_env_module:ScaledCorridor",
                                 env_kwargs={"scale": 2.0, "max_steps_in_episode": 7}))
    assert spec.env.scale == 2.0 and spec.env_params.max_steps_in_episode == 7  # arg and param
    assert TINY.env_name == "Corridor"  # run folder names and labels stay short


def test_a_config_calls_nothing_but_an_env_class(tmp_path):
    """'module:X' must be a class with the gymnax API (or an env object): a function, a
    factory included, or another class is refused before anything is called with the
    config's env_kwargs."""
    pwned = tmp_path / "pwned"
    for env, kwargs, pattern in [
        ("os:system", {"command": f"touch {pwned}"}, r"'os:system' is a function, not an env class"),
        ("custom_env_module:make_corridor", {},
         r"is a function, not an env class.*wrap it in a class.*PPOConfig\(env=make_corridor\(\)\)"),
        ("subprocess:Popen", {"args": ["touch", str(pwned)]},
         r"'subprocess:Popen' is a class without the gymnax env API \(no reset, step"),
        ("os:sep", {}, r"'os:sep' is a str, not an env class"),
    ]:
        with pytest.raises(jaxppo.ConfigError, match=pattern):
            make_env(TINY.replace(env=env, env_kwargs=kwargs))
    assert not pwned.exists()


@pytest.mark.parametrize("env, kwargs, pattern", [
    ("no_such_module_xyz:Env", {}, r"no module 'no_such_module_xyz'.*PYTHONPATH"),
    ("custom_env_module:Coridor", {}, r"has no attribute 'Coridor'; did you mean 'Corridor'"),
    (CORRIDOR, {"lenght": 5}, r"\['lenght'\] are not params of Corridor nor arguments"),
    ("custom_env_module:ScaledCorridor", {"scale": -1},
     r"ScaledCorridor\(scale=-1\) raised ValueError: scale=-1 must be positive"),
])
def test_module_colon_class_errors(env, kwargs, pattern):
    with pytest.raises(jaxppo.ConfigError, match=pattern):
        make_env(TINY.replace(env=env, env_kwargs=kwargs))


def test_what_config_yaml_can_record():
    assert env_record(custom_env_module.Corridor()) == CORRIDOR
    assert env_record(custom_env_module.ScaledCorridor()) == "custom_env_module:ScaledCorridor"
    assert env_record(custom_env_module.ScaledCorridor(2.0)) is None  # Class() would differ

    class Local(Walk):
        pass

    assert env_record(Local()) is None
    assert TINY.replace(env=Local()).to_dict()["env"] == "Local"
    assert TINY.replace(env=custom_env_module.Corridor()).to_dict()["env"] == CORRIDOR


def test_object_env_run_folder_loads_without_env(tmp_path):
    run = tmp_path / "run"
    jaxppo.train(TINY.replace(env=custom_env_module.Corridor()), run_dir=run, progress=False,
                 plot=False)
    assert yaml.safe_load((run / "config.yaml").read_text())["env"] == CORRIDOR
    policy = jaxppo.load_policy(run)
    assert isinstance(policy.spec.env, custom_env_module.Corridor)
    assert policy.evaluate(episodes=2)["episodes"] == 2




def test_cli_trains_module_colon_class(tmp_path, compile_cache_dir):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), env.get("PYTHONPATH", "")])
    cache = f"compilation_cache_dir={compile_cache_dir}" if compile_cache_dir else \
        "compilation_cache_dir=null"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxppo", "train", "--env", CORRIDOR, "--defaults", "--set",
         "num_envs=4", "num_steps=8", "num_minibatches=2", "num_epochs=1", "total_timesteps=64",
         "network.hidden_sizes=[8]", cache, "--runs-dir", str(tmp_path), "--no-progress",
         "--no-plot"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = tmp_path.iterdir()
    assert run.name.startswith("Corridor-")
    assert yaml.safe_load((run / "config.yaml").read_text())["env"] == CORRIDOR
    assert jaxppo.load_policy(run).spec.obs_shape == (2,)


# ---------------------------------------------------------------------- others' run folders
@pytest.fixture(scope="module")
def corridor_run(tmp_path_factory):
    """A finished run of custom_env_module:Corridor (config.yaml names it as module:Class)."""
    run = tmp_path_factory.mktemp("corridor") / "run"
    jaxppo.train(TINY, run_dir=run, progress=False, plot=False)
    return run


def test_a_run_folder_config_runs_no_code(corridor_run, tmp_path, capsys):
    """A shared run folder whose config.yaml names `os:system` with env_kwargs {command: ...}:
    eval, export, load_policy, --resume and --config refuse it and run nothing."""
    pwned = tmp_path / "pwned"
    run = tmp_path / "shared"
    shutil.copytree(corridor_run, run)
    hostile = {**yaml.safe_load((run / "config.yaml").read_text()), "env": "os:system",
               "env_kwargs": {"command": f"touch {pwned}"}}
    (run / "config.yaml").write_text(yaml.safe_dump(hostile))
    # config.yaml alone disagrees with the checkpoint's record of the config: refused as such
    with pytest.raises(jaxppo.ConfigError, match=r"env is 'os:system' in config.yaml but "):
        jaxppo.load_policy(run)
    edit_records(run, lambda r: r["config"].update(  # the record edited as well
        env="os:system", env_kwargs={"command": f"touch {pwned}"}))
    with pytest.raises(jaxppo.ConfigError, match=r"'os:system' is a function, not an env class"):
        jaxppo.load_policy(run)
    for argv in (["eval", str(run)], ["export", str(run), "--format", "jax", "-o",
                                      str(tmp_path / "p.jaxexport")],
                 ["train", "--resume", str(run), "--no-progress", "--no-plot"]):
        assert cli.main(argv) == 2, argv
        assert "'os:system'" in capsys.readouterr().err, argv
    (tmp_path / "hostile.yaml").write_text(yaml.safe_dump(hostile))
    assert cli.main(["train", "--config", str(tmp_path / "hostile.yaml"), "--runs-dir",
                     str(tmp_path / "runs"), "--no-progress", "--no-plot"]) == 2
    assert "'os:system' is a function, not an env class" in capsys.readouterr().err
    assert not pwned.exists()
    assert not (tmp_path / "p.jaxexport").exists() and not list((tmp_path / "runs").glob("*/*"))


def test_a_run_of_an_unimportable_env_says_to_pass_env(corridor_run, tmp_path, capsys):
    """A run whose config (and checkpoint record) can only name its env ("LocalWalk", a class
    defined in a script): eval, load_policy and --resume say to pass the env."""
    run = tmp_path / "run"
    shutil.copytree(corridor_run, run)
    (run / "config.yaml").write_text(yaml.safe_dump({**TINY.to_dict(), "env": "LocalWalk"}))
    edit_records(run, lambda r: r["config"].update(env="LocalWalk"))
    with pytest.raises(jaxppo.ConfigError, match=r"names only as 'LocalWalk'.*load_policy\(.*env="):
        jaxppo.load_policy(run)
    assert cli.main(["eval", str(run)]) == 2
    assert "--env module:Class" in capsys.readouterr().err
    assert cli.main(["train", "--resume", str(run)]) == 2
    assert "resume from Python" in capsys.readouterr().err
    shutil.rmtree(run / "checkpoints")  # nothing to resume: that is said first
    assert cli.main(["train", "--resume", str(run)]) == 2
    assert "has no checkpoints/ folder, so there is nothing to resume" in capsys.readouterr().err


def test_what_a_config_imports():
    """Only a user's module counts as an import: gymnax names and the suites' envs do not."""
    from jaxppo.envs.make import imported_module

    assert imported_module(CORRIDOR) == "custom_env_module"
    assert imported_module("gymnasium:my_envs:Maze-v0") == "my_envs"
    for env in ("CartPole-v1", "brax:ant", "jumanji:Snake-v1", "craftax:Craftax-Classic-Symbolic-v1",
                "xminigrid:MiniGrid-Empty-5x5", "gymnasium:CartPole-v1", custom_env_module.Corridor()):
        assert imported_module(env) is None, env


def test_no_imports_refuses_a_folder_that_names_a_module(corridor_run, tmp_path, capsys):
    """trust_config=False / --no-imports: a config naming module:Class is refused, naming the
    module and how to go on; an env given by the caller is theirs and stays allowed."""
    with pytest.raises(jaxppo.ConfigError, match=r"would import the module 'custom_env_module'.*"
                                                 r"env=YourEnv\(\).*trust_config=True"):
        jaxppo.load_policy(corridor_run, trust_config=False)
    policy = jaxppo.load_policy(corridor_run, env=custom_env_module.Corridor(), trust_config=False)
    assert policy.spec.obs_shape == (2,)
    for argv, fix in ((["eval", str(corridor_run)], "env=YourEnv()"),
                      (["export", str(corridor_run), "--format", "jax", "-o",
                        str(tmp_path / "p.jaxexport")], "env=YourEnv()"),
                      (["train", "--resume", str(corridor_run)], "Resume from Python")):
        assert cli.main([*argv, "--no-imports"]) == 2, argv
        err = capsys.readouterr().err
        assert "would import the module 'custom_env_module'" in err and fix in err, argv
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(TINY.to_dict()))
    assert cli.main(["train", "--config", str(tmp_path / "c.yaml"), "--runs-dir",
                     str(tmp_path / "runs"), "--no-imports"]) == 2
    err = capsys.readouterr().err
    assert "c.yaml names env='custom_env_module:Corridor'" in err and "--env" in err
    assert not (tmp_path / "p.jaxexport").exists()
