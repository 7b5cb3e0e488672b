"""A user's own flax module as the network: the same numbers as the built-in network it
mirrors, the shipped examples training (vmapped seeds), exact resume, rebuilding from
config.yaml (load_policy, eval, export), the contract checked before compiling, and the trust
rules of a module a config names."""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

import jaxppo
from jaxppo import cli
from jaxppo.config import ConfigError, NetworkConfig, PPOConfig
from jaxppo.core.networks import MLP, _dense
from jaxppo.examples.networks import LayerNormActorCritic, LSTMActorCritic
from jaxppo.program.resolved import resolve

BASE = PPOConfig(
    env="CartPole-v1", num_envs=4, num_steps=16, total_timesteps=3 * 64, num_minibatches=2,
    num_epochs=2, compilation_cache_dir=None,
)
LSTM = "jaxppo.examples.networks:LSTMActorCritic"
LAYER_NORM = "jaxppo.examples.networks:LayerNormActorCritic"


def _tree_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(la, lb))


class BuiltinLike(nn.Module):
    """The built-in feed-forward ActorCritic (separate torsos) written as a user's module: the
    same layers, names and init."""

    hidden_sizes: tuple = (64, 64)
    action_dim: int | None = None
    discrete: bool | None = None

    def setup(self):
        self.actor_torso = MLP(self.hidden_sizes, "tanh")
        self.critic_torso = MLP(self.hidden_sizes, "tanh")
        self.policy_head = _dense(self.action_dim, 0.01)
        self.value_head = _dense(1, 1.0)

    def __call__(self, obs, carry, reset):
        logits = self.policy_head(self.actor_torso(obs))
        return logits, self.value_head(self.critic_torso(obs))[..., 0], carry


# ---------------------------------------------------------------------- the same numbers
def test_a_module_like_the_builtin_mlp_trains_to_the_same_numbers():
    cfg = BASE.replace(network=NetworkConfig((16, 16)))
    builtin = jaxppo.train(cfg, progress=False)
    custom = jaxppo.train(BASE.replace(network=BuiltinLike((16, 16))), progress=False)
    assert _tree_equal(builtin.params, custom.params)
    for k, v in builtin.metrics.items():
        if k not in ("wall_time", "sps"):
            np.testing.assert_array_equal(v, custom.metrics[k], err_msg=k)
    assert np.isfinite(custom.metrics["value_loss"]).all()


# ---------------------------------------------------------------------- the examples
@pytest.fixture(scope="module")
def lstm_runs(tmp_path_factory):
    """The LSTM example with 2 seeds: uninterrupted, and stopped after 1 iteration then
    resumed from its folder (its config.yaml names the module)."""
    base = tmp_path_factory.mktemp("lstm")
    cfg = BASE.replace(network=LSTMActorCritic(features=8, hidden_size=16), num_seeds=2,
                       checkpoint_every=1)
    full = jaxppo.train(cfg, run_dir=base / "full", progress=False)
    jaxppo.train(cfg, run_dir=base / "part", progress=False, stop_after_iterations=1)
    resumed = jaxppo.train(None, resume=base / "part", progress=False)
    return {"base": base, "full": full, "resumed": resumed}


def test_the_lstm_example_trains_with_seeds_and_resumes_exactly(lstm_runs):
    full, resumed = lstm_runs["full"], lstm_runs["resumed"]
    assert full.metrics["value_loss"].shape == (2, 3)
    assert np.isfinite(full.metrics["value_loss"]).all()
    # the seeds differ; the carry is the LSTM's (c, h) per env
    assert not np.array_equal(full.metrics["value_loss"][0], full.metrics["value_loss"][1])
    c, h = full.state.carry.state
    assert c.shape == h.shape == (2, 4, 8)
    assert _tree_equal(full.state, resumed.state)
    for k, v in full.metrics.items():
        if k not in ("wall_time", "sps"):
            np.testing.assert_array_equal(v, resumed.metrics[k], err_msg=k)
    recorded = yaml.safe_load((lstm_runs["base"] / "part" / "config.yaml").read_text())["network"]
    assert recorded["module"] == LSTM and recorded["kwargs"] == {"features": 8, "hidden_size": 16}


def test_load_policy_and_export_rebuild_the_lstm_from_config_yaml(lstm_runs, tmp_path):
    run = lstm_runs["base"] / "full"
    policy = jaxppo.load_policy(run, seed_index=1)
    assert isinstance(policy.algorithm.network.module, LSTMActorCritic) and policy.recurrent
    assert _tree_equal(policy.params, jax.tree.map(lambda x: x[1], lstm_runs["full"].params))
    carry = policy.initial_carry((3,))
    obs = np.zeros((3, 4), np.float32)
    action, carry = policy.step(obs, carry)
    assert action.shape == (3,) and carry[0].shape == (3, 8)
    with pytest.raises(ValueError, match=r"need a carry of shape \(\(3, 8\), \(3, 8\)\)"):
        policy.step(obs, np.zeros((3, 8)))
    assert np.isfinite(policy.evaluate(episodes=2)["return_mean"])
    exported = jaxppo.export_policy(run, format="jax", path=tmp_path / "lstm.jaxexport",
                                    seed_index=1)
    fn = jax.export.deserialize(exported.path.read_bytes())
    out, next_carry = fn.call(obs, carry)
    want, want_carry = policy.step(obs, carry)
    np.testing.assert_array_equal(out, want)
    assert _tree_equal(next_carry, want_carry)
    assert [leaf["shape"] for leaf in exported.metadata["carry"]["leaves"]] == [["b", 8]] * 2


@pytest.fixture(scope="module")
def layer_norm_run(tmp_path_factory):
    """The layer-norm example trained from the CLI with a YAML file naming it."""
    base = tmp_path_factory.mktemp("layer_norm")
    path = base / "net.yaml"
    path.write_text(yaml.safe_dump({
        "env": "CartPole-v1", "num_envs": 4, "num_steps": 16, "total_timesteps": 3 * 64,
        "num_minibatches": 2, "num_epochs": 2, "num_seeds": 2, "compilation_cache_dir": None,
        "network": {"module": LAYER_NORM,
                    "kwargs": {"hidden_sizes": [16], "value_hidden_sizes": [32, 32]}}}))
    assert cli.main(["train", "--config", str(path), "--runs-dir", str(base), "--run-name",
                     "run", "--no-progress", "--no-plot"]) == 0
    return {"base": base, "yaml": path, "run": base / "run"}


def test_the_layer_norm_example_trains_from_a_yaml_file(layer_norm_run, capsys):
    run = layer_norm_run["run"]
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert {r["seed"] for r in rows} == {0, 1} and len(rows) == 6
    net = jaxppo.load_policy(run).algorithm.network.module
    assert isinstance(net, LayerNormActorCritic)
    assert tuple(net.value_hidden_sizes) == (32, 32) and net.discrete is True
    params = jaxppo.load_policy(run).params["params"]
    # the value trunk's own widths beside the policy's [16]
    assert params["Dense_0"]["kernel"].shape == (4, 16)
    assert params["Dense_1"]["kernel"].shape == (4, 32)
    assert params["Dense_2"]["kernel"].shape == (32, 32)
    capsys.readouterr()
    assert cli.main(["eval", str(run), "--episodes", "2", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["per_seed"]) == 2


def test_no_imports_refuses_a_network_module(layer_norm_run, capsys):
    run, path = layer_norm_run["run"], layer_norm_run["yaml"]
    for argv in (["eval", str(run), "--no-imports"],
                 ["train", "--config", str(path), "--env", "CartPole-v1", "--no-imports",
                  "--runs-dir", str(layer_norm_run["base"]), "--run-name", "refused"]):
        capsys.readouterr()
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert f"network.module='{LAYER_NORM}'" in err and "'jaxppo.examples.networks'" in err
    assert not (layer_norm_run["base"] / "refused").exists()
    with pytest.raises(ConfigError, match="would import the module 'jaxppo.examples.networks'"):
        jaxppo.load_policy(run, trust_config=False)


# ---------------------------------------------------------------------- config and record
def test_a_module_object_is_recorded_by_its_import_path():
    cfg = PPOConfig(network=LSTMActorCritic(features=8))
    assert cfg.network.module == LSTMActorCritic(features=8)
    rec = cfg.to_dict()["network"]
    assert rec["module"] == LSTM and rec["kwargs"] == {"features": 8}
    again = PPOConfig.from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict()
    # a module replaces the built-in network: a base's built-in shape is not kept
    tuned = PPOConfig.from_dict({"network": {"module": LSTM}},
                                PPOConfig(network=NetworkConfig((8,))))
    assert tuned.network.hidden_sizes == NetworkConfig().hidden_sizes


def test_a_module_that_cannot_be_named_is_recorded_so_loading_says_why():
    class Local(BuiltinLike):
        pass

    rec = PPOConfig(network=Local()).to_dict()
    assert ":" not in rec["network"]["module"]
    with pytest.raises(ConfigError, match=r"must be the import path \"module:Class\".*__main__ "
                                          "or inside a function"):
        PPOConfig.from_dict(rec).validate()


def test_a_run_of_a_module_that_cannot_be_named_warns_and_loads_with_network(tmp_path):
    """Training says that config.yaml can only name the module; load_policy(network=) loads
    the folder's policy with the module given again (the params are the run's)."""
    class Local(BuiltinLike):
        pass

    cfg = BASE.replace(network=Local(hidden_sizes=(8,)), total_timesteps=64)
    with pytest.warns(UserWarning, match=r"the network \S*Local \(defined in .*, not importable\) "
                                         r"cannot be imported by another process.*"
                                         r"load_policy\(RUN_DIR, network=Local\(\.\.\.\)\)"):
        result = jaxppo.train(cfg, run_dir=tmp_path / "run", progress=False, plot=False)
    with pytest.raises(ConfigError, match=r"load_policy\(run_dir, network=YourNetwork"):
        jaxppo.load_policy(tmp_path / "run")
    policy = jaxppo.load_policy(tmp_path / "run", network=Local(hidden_sizes=(8,)))
    assert _tree_equal(policy.params, result.params)
    obs = np.zeros((3, 4), np.float32)
    np.testing.assert_array_equal(policy(obs), result.policy(obs, deterministic=True))


def test_builtin_fields_and_kwargs_beside_a_module_are_errors():
    with pytest.raises(ConfigError, match=r"network.hidden_sizes=\[8\] shapes the built-in "
                                          "network, but network.module="):
        PPOConfig(network=NetworkConfig((8,), module=LSTMActorCritic())).validate()
    with pytest.raises(ConfigError, match="network.kwargs=.* are constructor arguments"):
        PPOConfig(network=NetworkConfig(module=LSTMActorCritic(), kwargs={"features": 8})).validate()


def test_a_config_may_name_only_a_flax_module_class(tmp_path):
    planted = tmp_path / "called"
    cfg = PPOConfig.from_dict({"network": {"module": "os:system",
                                           "kwargs": {"command": f"touch {planted}"}}})
    with pytest.raises(ConfigError, match="'os:system' is a function system, not a "
                                          "flax.linen.Module subclass"):
        resolve(cfg)
    assert not planted.exists()
    with pytest.raises(ConfigError, match="there is no module 'no_such_nets'"):
        resolve(PPOConfig.from_dict({"network": {"module": "no_such_nets:Net"}}))
    with pytest.raises(ConfigError, match=r"LSTMActorCritic\(width=3\) raised TypeError"):
        resolve(PPOConfig.from_dict({"network": {"module": LSTM, "kwargs": {"width": 3}}}))


# ---------------------------------------------------------------------- the contract
class WrongLogits(nn.Module):
    @nn.compact
    def __call__(self, obs, carry, reset):
        return nn.Dense(3)(obs), nn.Dense(1)(obs)[..., 0], carry


class ValueWithTrailingOne(nn.Module):
    @nn.compact
    def __call__(self, obs, carry, reset):
        return nn.Dense(2)(obs), nn.Dense(1)(obs), carry


class TwoOutputs(nn.Module):
    @nn.compact
    def __call__(self, obs, carry, reset):
        return nn.Dense(2)(obs), nn.Dense(1)(obs)[..., 0]


class GrowingCarry(nn.Module):
    def initial_carry(self, batch_shape):
        return jnp.zeros(tuple(batch_shape) + (4,))

    @nn.compact
    def __call__(self, obs, carry, reset):
        carry = jnp.concatenate([carry, obs[..., :1]], axis=-1)
        return nn.Dense(2)(obs), nn.Dense(1)(obs)[..., 0], carry


class IntegerParam(nn.Module):
    @nn.compact
    def __call__(self, obs, carry, reset):
        self.param("count", lambda key: jnp.zeros((), jnp.int32))
        return nn.Dense(2)(obs), nn.Dense(1)(obs)[..., 0], carry


class BatchStats(nn.Module):
    @nn.compact
    def __call__(self, obs, carry, reset):
        h = nn.BatchNorm(use_running_average=True)(obs)
        return nn.Dense(2)(h), nn.Dense(1)(h)[..., 0], carry


class FixedBatch(nn.Module):
    @nn.compact
    def __call__(self, obs, carry, reset):
        h = nn.Dense(2)(obs.reshape(-1, 4))  # loses any leading axes but one
        return h, h[:, 0], carry


class NoGaussian(nn.Module):
    @nn.compact
    def __call__(self, obs, carry, reset):
        return nn.Dense(1)(obs), nn.Dense(1)(obs)[..., 0], carry


@pytest.mark.parametrize("module, env, match", [
    (WrongLogits(), "CartPole-v1", (r"2 discrete actions the outputs must be the logits, a "
                                    r"float array of shape \[2, 2\], got float32\[2, 3\]")),
    (ValueWithTrailingOne(), "CartPole-v1", (r"the value must be a float array of shape \[2\].*"
                                             r"got float32\[2, 1\]")),
    (TwoOutputs(), "CartPole-v1", (r"must return \(outputs, value, new_carry\), got "
                                   r"\(float32\[2, 2\], float32\[2\]\)")),
    (GrowingCarry(), "CartPole-v1", (r"the new carry must have the structure, shapes and dtypes "
                                     r"of the carry it is given \(initial_carry\(\(2,\)\) = "
                                     r"float32\[2, 4\]\), got float32\[2, 5\]")),
    (IntegerParam(), "CartPole-v1", (r"every param must be a float array.*params\['count'\] is "
                                     r"int32\[\]")),
    (BatchStats(), "CartPole-v1", (r"only the 'params' collection.*got collections "
                                   r"\['batch_stats', 'params'\]")),
    (FixedBatch(), "CartPole-v1", (r"logits, a float array of shape \[3, 2, 2\], got "
                                   r"float32\[6, 2\]")),
    (NoGaussian(), "Pendulum-v1", (r"continuous actions the outputs must be \(mean, log_std\).*"
                                   r"got float32\[2, 1\]")),
])
def test_a_module_that_breaks_the_contract_is_a_config_error(module, env, match):
    with pytest.raises(ConfigError, match=f"network.module={type(module).__name__}: .*{match}"):
        resolve(BASE.replace(env=env, network=module))


def test_the_examples_keep_the_contract_for_continuous_actions():
    for module in (LayerNormActorCritic(), LSTMActorCritic()):
        net = resolve(BASE.replace(env="Pendulum-v1", network=module)).network
        # jitted: op by op, these modules compile ~75 small programs each
        params = jax.jit(net.init)(jax.random.PRNGKey(0), jnp.zeros((1, 3)))
        dist, value, _ = jax.jit(net.apply)(params, jnp.zeros((5, 3)))
        assert dist.loc.shape == (5, 1) and dist.log_std.shape == (1,) and value.shape == (5,)


# ---------------------------------------------------------------------- devices, sweeps, PBT
SPREAD_SCRIPT = """
import json, os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
import jax, jaxppo, numpy as np
from jaxppo import NetworkConfig
base = jaxppo.PPOConfig(env="CartPole-v1", num_envs=4, num_steps=16, total_timesteps=3 * 64,
                        num_minibatches=2, num_epochs=2, compilation_cache_dir=None)
lstm = base.replace(network=NetworkConfig(module="jaxppo.examples.networks:LSTMActorCritic",
                                          kwargs={"features": 8}))
norm = base.replace(network=NetworkConfig(module="jaxppo.examples.networks:LayerNormActorCritic",
                                          kwargs={"hidden_sizes": [16], "value_hidden_sizes": [8]}))
keys = ("policy_loss", "value_loss", "entropy", "kl")
m = lambda r: {k: np.asarray(r.metrics[k]).tolist() for k in keys}
out = {"devices": jax.local_device_count()}
for nd in (1, 2):
    out[f"lstm-{nd}"] = m(jaxppo.train(lstm.replace(num_devices=nd), progress=False, plot=False))
pbt = jaxppo.train(norm.replace(num_seeds=2, search={"lr": {"loguniform": [1e-4, 1e-2]}},
                                pbt={"interval": 1, "fraction": 0.5}, log_every=1),
                   progress=False, plot=False)
out["pbt"] = m(pbt)
print(json.dumps(out))
"""


KEYS = ("policy_loss", "value_loss", "entropy", "kl")


def test_a_module_splits_over_devices_and_trains_in_sweeps_and_pbt(layer_norm_run):
    """Your own network wherever a built-in one goes: envs split over 2 devices (the LSTM
    example: the same numbers as one device), a vmapped sweep (member 0 is seed 0 of a
    two-seed run at its lr: the layer-norm example's run from its YAML file) and a PBT
    population over the devices."""
    import os
    import subprocess
    import sys

    from jaxppo import HyperParams

    env = {**os.environ, "JAXPPO_CPU_DEVICES": "2"}
    proc = subprocess.run([sys.executable, "-c", SPREAD_SCRIPT], capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 2
    for k, v in out["lstm-1"].items():
        np.testing.assert_allclose(out["lstm-2"][k], v, rtol=1e-4, atol=1e-6, err_msg=k)
    assert np.isfinite(np.asarray(out["pbt"]["value_loss"])).all()
    # The two-seed run, and a sweep of its lr and another with its config otherwise.
    run = layer_norm_run["run"]
    two_seeds = PPOConfig.from_file(run / "config.yaml")
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    seeds = {k: np.asarray([[r[k] for r in rows if r["seed"] == s] for s in (0, 1)]) for k in KEYS}
    sweep = jaxppo.train(two_seeds.replace(num_devices=1), progress=False, plot=False,
                         hparams=HyperParams.stack([HyperParams.from_config(two_seeds.replace(
                             lr=lr)) for lr in (two_seeds.lr, 3 * two_seeds.lr)]))
    for k, v in seeds.items():  # seed 0 at the run's lr, in a sweep or in a 2-seed run
        np.testing.assert_allclose(np.asarray(sweep.metrics[k])[0], v[0], rtol=1e-5, atol=1e-7,
                                   err_msg=k)
    assert not np.allclose(sweep.metrics["policy_loss"][1], seeds["policy_loss"][1])
