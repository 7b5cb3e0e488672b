"""Craftax envs by name ("craftax:<name>", jaxppo.envs.craftax_suite): what only Craftax has (its
observation box, its own time limit kept apart from jaxppo's, env_kwargs as Craftax's
EnvParams and their errors) and a short training run with its run folder. The contract every
suite keeps (checked against Craftax-Classic's own reset and step without auto-reset: the time
limit as a truncation where Craftax says only `done`, lava as a termination) is in
tests/envs/test_suites.py. The tests that need craftax skip without it (CI installs it with
the dev extra)."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo.envs.make import make_env
from jaxppo.errors import ConfigError
from readme_commands import readme_train_config

ENV = "craftax:Craftax-Classic-Symbolic-v1"
TINY = jaxppo.PPOConfig(env=ENV, num_envs=4, num_steps=16, num_minibatches=2, num_epochs=1,
                        total_timesteps=4 * 16 * 2, network=jaxppo.NetworkConfig((16,)),
                        compilation_cache_dir=None)


def test_observations_are_in_the_unit_box_and_the_limit_is_jaxppos():
    """Craftax's own time limit stays as it is: jaxppo's max_steps_in_episode is the one
    that truncates (tests/envs/test_suites.py)."""
    pytest.importorskip("craftax")
    spec = make_env(TINY)
    space = spec.env.observation_space(spec.env_params)
    assert (float(space.low), float(space.high), space.dtype) == (0.0, 1.0, jnp.float32)
    limit = make_env(TINY.replace(env_kwargs={"max_steps_in_episode": 5})).env_params
    assert limit.max_steps_in_episode == 5 and limit.craftax.max_timesteps == 10000


def test_env_kwargs_set_craftax_params_and_errors_name_the_fix():
    pytest.importorskip("craftax")
    spec = make_env(TINY.replace(env_kwargs={"day_length": 100}))
    assert spec.env_params.craftax.day_length == 100
    with pytest.raises(ConfigError, match=r"\['day_lenght'\] are neither Craftax's EnvParams.*"
                                          r"'day_length'"):
        make_env(TINY.replace(env_kwargs={"day_lenght": 100}))


@pytest.mark.slow
def test_training_runs_end_to_end_with_a_run_folder(tmp_path):
    """Two tiny iterations (~30 s, nearly all compiling): Craftax learns over millions of
    steps, so this checks the whole program and the run folder, not a learning curve."""
    pytest.importorskip("craftax")
    cfg = readme_train_config(ENV).replace(compilation_cache_dir=None)  # README's command
    result = jaxppo.train(cfg, run_dir=tmp_path / "run", progress=False, plot=False)
    assert np.asarray(result.metrics["policy_loss"]).shape == (1, 2)
    assert np.isfinite(np.asarray(result.metrics["policy_loss"])).all()
    assert f"env: {ENV}" in (tmp_path / "run" / "config.yaml").read_text()
