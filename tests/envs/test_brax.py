"""Brax envs by name ("brax:<name>", jaxppo.envs.brax_suite): what only Brax has (its action
bounds, its own errors, gymnax training without it) and a short learning run. The contract
every suite keeps (checked against Brax's own reset and step) is in tests/envs/test_suites.py.
The tests that need brax skip without it (CI installs it with the dev extra)."""

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import jaxppo
from jaxppo.envs.make import make_env
from jaxppo.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
pytestmark = [  # brax's and jaxopt's own deprecation notices, not this package's
    pytest.mark.filterwarnings("ignore:Accessing `ncon` directly:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:JAXopt is no longer maintained:DeprecationWarning"),
]
needs_brax = pytest.mark.skipif(
    importlib.util.find_spec("brax") is None,
    reason="brax is not installed: pip install 'jaxppo[brax]' (the dev extra installs it)")

ENV = "brax:inverted_pendulum"
TINY = jaxppo.PPOConfig(env=ENV, num_envs=2, num_steps=8, num_minibatches=2, num_epochs=1,
                        total_timesteps=16, network=jaxppo.NetworkConfig((8,)),
                        compilation_cache_dir=None)


@needs_brax
def test_the_action_space_is_brax_own():
    spec = make_env(TINY)
    np.testing.assert_array_equal(spec.action_low, [-1.0])
    np.testing.assert_array_equal(spec.action_high, [1.0])


@needs_brax
def test_errors_name_the_fix(monkeypatch):
    import brax.envs
    from brax.envs.inverted_pendulum import InvertedPendulum

    class Broken(InvertedPendulum):  # as brax 0.14.2's swimmer under jax 0.10 (jnp.clip(a_min=))
        def step(self, state, action):
            raise TypeError("clip() got an unexpected keyword argument 'a_min'")

    monkeypatch.setitem(brax.envs._envs, "broken_pendulum", Broken)
    with pytest.raises(ConfigError, match=r"Brax's own reset or step fails with brax .*a_min"):
        make_env(TINY.replace(env="brax:broken_pendulum"))
    with pytest.raises(ConfigError, match=r"get_environment\('reacher', backend='nope'\) raised"):
        make_env(TINY.replace(env="brax:reacher", env_kwargs={"backend": "nope"}))


def test_gymnax_training_never_imports_brax():
    code = textwrap.dedent("""
        import sys
        import jaxppo
        from jaxppo.program.resolved import resolve
        assert "brax" not in sys.modules
        cfg = jaxppo.PPOConfig(num_envs=2, num_steps=8, num_minibatches=2, num_epochs=1,
                               total_timesteps=16, network=jaxppo.NetworkConfig((8,)),
                               compilation_cache_dir=None)
        resolve(cfg)
        jaxppo.train(cfg, progress=False)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("brax", "mujoco"))
        assert not loaded, loaded
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]


@needs_brax
@pytest.mark.slow
def test_ppo_learns_to_balance_the_brax_pendulum(tmp_path):
    cfg = jaxppo.PPOConfig(
        env=ENV, num_envs=16, num_steps=32, num_minibatches=4, num_epochs=4,
        total_timesteps=16 * 32 * 40, lr=3e-4, lr_schedule="constant", gamma=0.97,
        entropy_coeff=0.0, normalize_observations=True, network=jaxppo.NetworkConfig((32, 32)),
        compilation_cache_dir=None)
    result = jaxppo.train(cfg, run_dir=tmp_path / "run", progress=False, plot=False)
    returns = np.asarray(result.metrics["episode_return_mean"]).reshape(-1)
    first, last = np.nanmean(returns[:5]), np.nanmean(returns[-5:])
    assert first < 15 and last > 3 * first, returns  # random: ~5 steps upright
    assert "env: brax:inverted_pendulum" in (tmp_path / "run" / "config.yaml").read_text()
