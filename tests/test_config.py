"""PPOConfig: every validation error names field, value and fix; loading and round trips."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path

import numpy as np

import pytest
import yaml

from jaxppo.config import TUNED_DIR, ConfigError, NetworkConfig, PPOConfig
from jaxppo.program.resolved import note_partial_batch, resolve

BASE = PPOConfig(num_envs=4, num_steps=16, num_minibatches=4, total_timesteps=1024)


def bad(match: str, **changes):
    """Assert that resolving BASE with `changes` on this host (what every entry point does:
    validate each field, then what needs the env and devices) raises ConfigError matching
    `match`."""
    with pytest.raises(ConfigError, match=match) as info:
        resolve(BASE.replace(**changes), "local")
    return str(info.value)


def test_base_and_defaults_are_valid():
    assert BASE.validate() is BASE
    PPOConfig().validate()


# ------------------------------------------------------------------ batch shape
def test_num_minibatches_must_divide_num_steps():
    msg = bad(r"num_minibatches=3 does not divide", num_minibatches=3)
    assert "num_steps=16" in msg
    assert "4*16 = 64" in msg  # names the batch it failed to split
    # the fix: valid choices for this num_steps
    assert re.search(r"choose num_minibatches from \[1, 2, 4, 8, 16\]", msg), msg


def test_num_minibatches_dividing_batch_but_not_steps():
    # 4 envs * 6 steps = 24 is divisible by 4, but minibatches are whole rollout steps.
    msg = bad(r"num_minibatches=4 does not divide", num_steps=6, num_minibatches=4)
    assert "num_steps=6" in msg and "[1, 2, 3, 6]" in msg


@pytest.mark.parametrize(
    "field", ["num_envs", "num_steps", "num_epochs", "num_minibatches", "total_timesteps", "num_seeds"]
)
@pytest.mark.parametrize("value", [0, -3])
def test_positive_integers(field, value):
    msg = bad(rf"^{field}={value} must be an integer >= 1", **{field: value})
    assert "e.g." in msg  # a fix


@pytest.mark.parametrize("field", ["num_envs", "num_steps", "num_epochs", "total_timesteps"])
@pytest.mark.parametrize("value", [2.5, "8", True])
def test_integers_reject_other_types(field, value):
    bad(rf"^{field}={re.escape(repr(value))} must be an integer >= 1", **{field: value})


def test_log_every_may_be_zero_but_not_negative():
    BASE.replace(log_every=0).validate()
    bad(r"^log_every=-1 must be an integer >= 0", log_every=-1)


def test_num_devices():
    BASE.replace(num_devices=None).validate()
    BASE.replace(num_devices=2).validate()
    bad(r"^num_devices=0 must be an integer >= 1", num_devices=0)
    msg = bad(r"^num_envs=4 cannot be split evenly over num_devices=3", num_devices=3)
    assert "num_devices from [1, 2, 4]" in msg


def test_seed_must_be_an_integer():
    bad(r"^seed='1' must be an integer", seed="1")


def test_total_timesteps_smaller_than_one_iteration():
    msg = bad(r"^total_timesteps=63 is smaller than one iteration", total_timesteps=63)
    assert "num_envs\\*num_steps = 64" in re.escape(msg) or "num_envs*num_steps = 64" in msg
    assert "at least 64" in msg  # the fix
    BASE.replace(total_timesteps=64).validate()


# ------------------------------------------------------------------ returns
@pytest.mark.parametrize("field", ["gamma", "gae_lambda"])
@pytest.mark.parametrize("value", [-0.01, 1.01, 2, float("nan"), "0.9", None])
def test_gamma_lambda_in_unit_interval(field, value):
    msg = bad(rf"^{field}={re.escape(repr(value))} must be a number in \[0, 1\]", **{field: value})
    assert f"e.g. {field}=" in msg


@pytest.mark.parametrize("field", ["gamma", "gae_lambda"])
@pytest.mark.parametrize("value", [0.0, 1.0, 1])
def test_gamma_lambda_bounds_are_inclusive(field, value):
    BASE.replace(**{field: value}).validate()


# ------------------------------------------------------------------ schedules
@pytest.mark.parametrize("value", [0, 0.0, -1e-4])
def test_lr_must_be_positive(value):
    msg = bad(rf"^lr={re.escape(repr(value))} must be > 0", lr=value)
    assert "e.g. lr=" in msg


@pytest.mark.parametrize("value", ["fast", None, [], [[0]], [[0, 1e-3, 5]], [1e-3, 1e-4]])
def test_lr_wrong_type(value):
    msg = bad(r"^lr=.* must be a number or a piecewise schedule", lr=value)
    assert "[[env_step, value], ...]" in msg and "e.g. lr=[[" in msg


def test_lr_piecewise_steps_must_increase():
    msg = bad(r"^lr=\[\[1000, 0\.001\], \[0, 0\.0001\]\]: the env_step", lr=[[1000, 1e-3], [0, 1e-4]])
    assert "increasing" in msg
    bad(r"env_step of each \[env_step, value\] point must be >= 0", lr=[[-5, 1e-3], [10, 1e-4]])


def test_lr_piecewise_values_must_be_positive():
    bad(r"^lr=\[\[0, 0\.001\], \[1000, 0\]\]: every value must be > 0", lr=[[0, 1e-3], [1000, 0]])


def test_valid_piecewise_schedules():
    BASE.replace(lr=[[0, 1e-3], [500, 1e-4]], entropy_coeff=[[0, 0.01], [1000, 0.0]]).validate()


def test_entropy_coeff_may_be_zero_not_negative():
    BASE.replace(entropy_coeff=0.0).validate()
    bad(r"^entropy_coeff=-0\.1 must be >= 0", entropy_coeff=-0.1)


@pytest.mark.parametrize("field", ["lr_schedule", "entropy_schedule"])
def test_schedule_kind(field):
    msg = bad(rf"^{field}='cosine' is not one of \('constant', 'linear'\)", **{field: "cosine"})
    assert "piecewise schedule" in msg


# ------------------------------------------------------------------ loss / optimiser scalars
@pytest.mark.parametrize("field", ["clip_param", "adam_eps", "max_grad_norm", "kl_target"])
@pytest.mark.parametrize("value", [0, -0.5, float("inf")])
def test_positive_scalars(field, value):
    bad(rf"^{field}={re.escape(repr(value))} must be a positive number", **{field: value})


@pytest.mark.parametrize("field", ["vf_coeff", "kl_coeff"])
def test_nonnegative_scalars(field):
    BASE.replace(**{field: 0.0}).validate()
    bad(rf"^{field}=-1 must be a number >= 0", **{field: -1})


def test_vf_clip_param():
    BASE.replace(vf_clip_param=None).validate()
    BASE.replace(vf_clip_param=10.0).validate()
    msg = bad(r"^vf_clip_param=0 must be a positive number", vf_clip_param=0)
    assert "null to turn value clipping off" in msg


# ------------------------------------------------------------------ HyperParams
def test_hyperparams_declares_the_tunable_fields_in_order():
    """HyperParams writes its leaves out (so editors know `hp.clip_param`); they are the
    tunable declarations, in declaration order, which checkpoints and vmapped sweeps keep."""
    import typing

    import jax

    from jaxppo.config import HYPERPARAM_LEAVES, SCHEDULES, TUNABLE_FIELDS
    from jaxppo.core.hyperparams import HyperParams

    assert list(HYPERPARAM_LEAVES.values()) == list(TUNABLE_FIELDS)
    assert [f.name for f in dataclasses.fields(HyperParams)] == list(HYPERPARAM_LEAVES)
    assert typing.get_type_hints(HyperParams) == {leaf: jax.Array for leaf in HYPERPARAM_LEAVES}
    leaves = jax.tree_util.tree_flatten_with_path(HyperParams.from_config(PPOConfig()))[0]
    assert [path[0].name for path, _ in leaves] == list(HYPERPARAM_LEAVES)
    assert HyperParams.point_leaves == tuple(
        leaf for leaf, name in HYPERPARAM_LEAVES.items() if name in SCHEDULES)


# ------------------------------------------------------------------ network
@pytest.mark.parametrize("sizes", [(), (64, 0), (-1,)])
def test_hidden_sizes(sizes):
    msg = bad(r"^network\.hidden_sizes=.* must be a non-empty list of positive", network=NetworkConfig(hidden_sizes=sizes))
    assert "e.g. [64, 64]" in msg


def test_activation_suggests_nearest():
    msg = bad(r"^network\.activation='tahn' is not one of", network=NetworkConfig(activation="tahn"))
    assert "did you mean 'tanh'" in msg


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "-1", True])
def test_log_std_init_must_be_a_finite_number(value):
    msg = bad(r"^network\.log_std_init=.* must be a finite number", network=NetworkConfig(log_std_init=value))
    assert "e.g. -0.5" in msg


@pytest.mark.parametrize("value", [-5.0, 2.0, 3.5])
def test_state_dependent_log_std_init_must_lie_inside_the_clip(value):
    BASE.replace(network=NetworkConfig(log_std_init=value)).validate()  # free vector: any number
    bad(r"^network\.log_std_init=.* strictly between -5.0 and 2.0",
        network=NetworkConfig(log_std_init=value, state_dependent_std=True))


def test_state_dependent_std_must_be_a_bool():
    bad(r"^network\.state_dependent_std='yes' must be true or false",
        network=NetworkConfig(state_dependent_std="yes"))


def test_network_must_be_network_config():
    bad(r"^network=.* must be a NetworkConfig", network={"hidden_sizes": [8]})


# ------------------------------------------------------------------ environment
@pytest.mark.parametrize("name", ["CartPole-v0", "cartpole", "cartpole-v1", "CartPole"])
def test_unknown_env_suggests_cartpole(name):
    msg = bad(rf"^env={re.escape(repr(name))} is not a registered gymnax environment", env=name)
    suggestion = re.search(r"did you mean (.*?)\?", msg)
    assert suggestion, msg
    assert suggestion.group(1).startswith("'CartPole-v1'"), msg  # the nearest name comes first
    assert "Registered:" in msg and "Pendulum-v1" in msg


def test_unknown_env_suggests_pendulum():
    msg = bad(r"env='pendulum' is not a registered", env="pendulum")
    assert "did you mean 'Pendulum-v1'" in msg


def test_unknown_env_without_close_match_lists_registered():
    msg = bad(r"env='zzzz' is not a registered gymnax environment", env="zzzz")
    assert "did you mean" not in msg
    assert "CartPole-v1" in msg and "Pendulum-v1" in msg


def test_env_object_without_gymnax_api():
    bad(r"^env=.* is neither a registered gymnax name nor an object with the gymnax API", env=object())


def test_env_kwargs_must_be_mapping():
    bad(r"^env_kwargs=\[1, 2\] must be a mapping", env_kwargs=[1, 2])


# ------------------------------------------------------------------ unknown keys
def test_unknown_key_suggests_nearest_field():
    with pytest.raises(ConfigError, match=r"^unknown config key 'num_env'; did you mean 'num_envs'") as e:
        PPOConfig.from_dict({"num_env": 8})
    assert "valid keys:" in str(e.value)


def test_unknown_key_without_close_match_lists_valid_keys():
    # difflib finds nothing close to 'learning_rate' among the field names; the message must
    # still name the key and list the valid ones (among them 'lr').
    with pytest.raises(ConfigError, match=r"^unknown config key 'learning_rate'") as e:
        PPOConfig.from_dict({"learning_rate": 3e-4})
    keys = str(e.value).split("valid keys:")[1]
    assert re.search(r"\blr\b", keys) and "num_envs" in keys


def test_unknown_key_from_overrides():
    with pytest.raises(ConfigError, match=r"^unknown config key 'gama'; did you mean 'gamma'"):
        BASE.with_overrides(["gama=0.9"])


def test_unknown_key_from_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("num_env: 8\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'num_env'; did you mean 'num_envs'"):
        PPOConfig.from_file(path)


def test_unknown_network_key():
    with pytest.raises(ConfigError, match=r"^unknown config key 'network\.hidden_size'; "
                                          r"did you mean 'network\.hidden_sizes'") as e:
        PPOConfig.from_dict({"network": {"hidden_size": [32]}})
    assert "network.activation" in str(e.value)  # lists the valid network keys
    with pytest.raises(ConfigError, match=r"unknown config key 'network\.activaton'; did you mean 'network\.activation'"):
        BASE.with_overrides(["network.activaton=relu"])


@pytest.mark.parametrize("key,value", [("hidden_sizes", "[64,64]"), ("activation", "relu"),
                                       ("recurrent_size", "8"), ("shared_trunk", "true")])
def test_a_network_field_given_at_the_top_level_names_network(key, value, tmp_path):
    """`--set hidden_sizes=[64,64]`, a file's top-level `activation:`, PPOConfig(hidden_sizes=...)
    point to the network field of that name, and say how to set it."""
    with pytest.raises(ConfigError, match=rf"^unknown config key '{key}'; did you mean "
                                          rf"'network\.{key}'\? It is a field of network: --set "
                                          rf"network\.{key}=\S+, or in a file {key} under network:"):
        BASE.with_overrides([f"{key}={value}"])
    path = tmp_path / "c.yaml"
    path.write_text(f"{key}: {value}\n")
    with pytest.raises(ConfigError, match=rf"did you mean 'network\.{key}'\?"):
        PPOConfig.from_file(path)
    with pytest.raises(ConfigError, match=rf"^PPOConfig has no field '{key}'; did you mean "
                                          rf"network\.{key}\? It is a field of network: "
                                          rf"network=NetworkConfig\({key}=\.\.\.\)"):
        PPOConfig(**{key: value})
    assert BASE.with_overrides([f"network.{key}={value}"])  # the nested key itself is fine


def test_a_misspelt_network_field_at_the_top_level_names_network():
    with pytest.raises(ConfigError, match=r"^unknown config key 'hidden_size'; did you mean "
                                          r"'network\.hidden_sizes'\?"):
        PPOConfig.from_dict({"hidden_size": [32]})
    # a top-level field spelt nearly right is still the top-level field
    with pytest.raises(ConfigError, match=r"^unknown config key 'num_env'; did you mean 'num_envs'"):
        PPOConfig.from_dict({"num_env": 8})


def test_network_not_a_mapping():
    with pytest.raises(ConfigError, match=r"^network=\[64, 64\] must be a mapping"):
        PPOConfig.from_dict({"network": [64, 64]})


def test_override_without_equals():
    with pytest.raises(ConfigError, match=r"--set 'lr' must have the form key=value, e\.g\. lr=3e-4"):
        BASE.with_overrides(["lr"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match=r"config file '.*nope\.yaml' does not exist"):
        PPOConfig.from_file(tmp_path / "nope.yaml")
    p = tmp_path / "list.yaml"
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"must hold a mapping of field: value"):
        PPOConfig.from_file(p)


# ------------------------------------------------------------------ round trips and parsing
NON_DEFAULT = PPOConfig(
    env="Pendulum-v1", env_kwargs={"max_steps_in_episode": 100}, num_envs=8, num_steps=32,
    total_timesteps=12_345, num_epochs=3, num_minibatches=8, gamma=0.95, gae_lambda=0.9,
    lr=[[0, 1e-3], [5000, 1e-4]], lr_schedule="constant", adam_eps=1e-7, max_grad_norm=1.5,
    critic_lr=[[0, 2e-3], [5000, 2e-4]],
    clip_param=0.3, vf_clip_param=5.0, vf_coeff=0.25, entropy_coeff=0.0,
    entropy_schedule="linear", use_kl_loss=True, kl_coeff=0.5, kl_target=0.02,
    normalize_advantages=False, normalize_observations=True, normalize_rewards=True,
    network=NetworkConfig(hidden_sizes=(32, 16), activation="relu", shared_trunk=True,
                          log_std_init=-0.5, state_dependent_std=True, head_sizes=(8,)),
    num_devices=2, seed=7, num_seeds=3, log_every=5, compilation_cache_dir=None,
    search={"population": 3, "clip_param": {"uniform": [0.1, 0.3]},
            "gamma": {"choice": [0.95, 0.99]}},
    pbt={"interval": 5, "fraction": 0.5, "perturb": [0.9, 1.1], "fitness": "return"},
)


def _tweaked(name: str, value, annotation: str):
    """A value of the field's type that differs from its default (validity not needed)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 3
    if isinstance(value, float):
        return value / 2 + 0.125
    if isinstance(value, str):
        return value + "x"
    if value is None:
        if "int" in annotation:
            return 5
        if "float" in annotation:
            return 0.75
        if "str" in annotation:
            return "/tmp/somewhere"
    return None  # structured fields are covered by NON_DEFAULT


FIELDS = [(f.name, f.type) for f in dataclasses.fields(PPOConfig)]


@pytest.mark.parametrize("name,annotation", FIELDS, ids=[n for n, _ in FIELDS])
def test_every_simple_field_round_trips(name, annotation):
    """Every scalar field (including ones added later) survives to_dict -> YAML -> from_dict."""
    default = getattr(PPOConfig(), name)
    value = _tweaked(name, default, str(annotation))
    if value is None:
        pytest.skip(f"{name} is structured; covered by NON_DEFAULT")
    cfg = PPOConfig().replace(**{name: value})
    assert PPOConfig.from_dict(cfg.to_dict()) == cfg
    assert PPOConfig.from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg


def test_default_config_round_trips():
    cfg = PPOConfig()
    assert PPOConfig.from_dict(cfg.to_dict()) == cfg
    assert PPOConfig.from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg


def test_round_trip_dict():
    NON_DEFAULT.validate()
    assert PPOConfig.from_dict(NON_DEFAULT.to_dict()) == NON_DEFAULT


def test_round_trip_yaml_and_json(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text(yaml.safe_dump(NON_DEFAULT.to_dict(), sort_keys=False))
    assert PPOConfig.from_file(y) == NON_DEFAULT
    j = tmp_path / "c.json"
    j.write_text(json.dumps(NON_DEFAULT.to_dict()))
    assert PPOConfig.from_file(j) == NON_DEFAULT


def test_from_file_yaml(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(
        "env: Acrobot-v1\n"
        "num_envs: 8\n"
        "lr: 0.001\n"
        "lr_schedule: constant\n"
        "vf_clip_param: null\n"
        "network:\n"
        "  hidden_sizes: [32, 32]\n"
    )
    cfg = PPOConfig.from_file(path).validate()
    assert cfg.env == "Acrobot-v1" and cfg.num_envs == 8 and cfg.lr == 0.001
    assert cfg.vf_clip_param is None and cfg.lr_schedule == "constant"
    assert cfg.network == NetworkConfig(hidden_sizes=(32, 32))  # other network fields keep defaults
    assert cfg.num_steps == PPOConfig().num_steps


def test_from_file_on_top_of_base(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("network:\n  activation: relu\n")
    base = PPOConfig(network=NetworkConfig(hidden_sizes=(8,)))
    cfg = PPOConfig.from_file(path, base)
    assert cfg.network == NetworkConfig(hidden_sizes=(8,), activation="relu")


def test_empty_yaml_file_gives_base(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert PPOConfig.from_file(path, BASE) == BASE


def test_with_overrides_parses_values():
    cfg = BASE.with_overrides([
        "num_envs=8", "gamma=0.9", "lr=[[0, 0.001], [1000, 0.0001]]", "vf_clip_param=null",
        "use_kl_loss=true", "env=Pendulum-v1", "network.hidden_sizes=[32,32]",
        "network.activation=relu", "env_kwargs={max_steps_in_episode: 50}",
    ])
    assert cfg.num_envs == 8 and isinstance(cfg.num_envs, int)
    assert cfg.gamma == 0.9
    assert cfg.lr == [[0, 0.001], [1000, 0.0001]]
    assert cfg.vf_clip_param is None
    assert cfg.use_kl_loss is True
    assert cfg.env == "Pendulum-v1"
    assert cfg.network == NetworkConfig(hidden_sizes=(32, 32), activation="relu")
    assert cfg.env_kwargs == {"max_steps_in_episode": 50}
    cfg.validate()
    # untouched fields keep the base's values
    assert cfg.num_steps == BASE.num_steps and cfg.total_timesteps == BASE.total_timesteps


def test_with_overrides_vf_clip_null_turns_clipping_off():
    cfg = BASE.replace(vf_clip_param=10.0).with_overrides(["vf_clip_param=null"])
    assert cfg.vf_clip_param is None
    cfg.validate()


def test_with_overrides_later_pair_wins():
    assert BASE.with_overrides(["num_envs=2", "num_envs=8"]).num_envs == 8


# Scientific notation without a dot ("3e-4") is a *string* to YAML 1.1 (PyYAML). The CLI's own
# help shows `--set lr=3e-4`; it must give the number 3e-4, not a ConfigError.
@pytest.mark.parametrize("raw,expected", [("3e-4", 3e-4), ("1e-3", 1e-3), ("2.5e-4", 2.5e-4)])
def test_with_overrides_scientific_notation_lr(raw, expected):
    cfg = BASE.with_overrides([f"lr={raw}"]).validate()
    assert cfg.lr == pytest.approx(expected)


@pytest.mark.parametrize("raw", ["5e5", "5.0e+5", "500000"])
def test_with_overrides_scientific_notation_total_timesteps(raw):
    cfg = BASE.with_overrides([f"total_timesteps={raw}"]).validate()
    assert cfg.total_timesteps == 500_000 and isinstance(cfg.total_timesteps, int)


def test_yaml_file_scientific_notation(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("lr: 3e-4\nadam_eps: 1e-5\n")
    cfg = PPOConfig.from_file(path, BASE).validate()
    assert cfg.lr == pytest.approx(3e-4) and cfg.adam_eps == pytest.approx(1e-5)


def test_derived_sizes():
    cfg = PPOConfig(num_envs=8, num_steps=32, num_minibatches=4, total_timesteps=1000)
    assert cfg.batch_size == 256 and cfg.minibatch_size is None and cfg.num_iterations == 3
    sized = PPOConfig(num_envs=8, num_steps=32, minibatch_size=64, total_timesteps=1000)
    assert resolve(sized).config == cfg  # minibatch_size=64 is num_minibatches=4
    assert resolve(sized.replace(minibatch_size=16)).config.num_minibatches == 16


# ------------------------------------------------------------------ minibatch_size
def test_minibatch_size_is_the_other_way_to_size_minibatches(tmp_path):
    """Given alone it replaces a lower layer's num_minibatches (the tuned config's 8), and
    num_minibatches given alone replaces a lower layer's minibatch_size; both in one layer,
    or both set on one config, are refused."""
    from jaxppo.config import tuned_config_path

    tuned = PPOConfig.tuned("CartPole-v1")  # 16 envs x 128 steps, num_minibatches=8
    assert tuned.num_minibatches == 8 and tuned.minibatch_size is None
    cfg = tuned.with_overrides(["minibatch_size=512"])
    assert (cfg.minibatch_size, cfg.num_minibatches) == (512, 4)
    assert resolve(cfg).config.num_minibatches == 2048 // 512
    back = cfg.with_overrides(["num_minibatches=16"])
    assert (back.minibatch_size, back.num_minibatches) == (None, 16)
    path = tmp_path / "c.yaml"
    path.write_text("minibatch_size: 256\n")
    assert resolve(PPOConfig.from_file(path, tuned)).config.num_minibatches == 8
    assert tuned_config_path("CartPole-v1").read_text().count("minibatch_size") == 0
    with pytest.raises(ConfigError, match=r"^minibatch_size=32 and num_minibatches=16 are both "
                                          r"given; .*keep one"):
        PPOConfig().with_overrides(["num_minibatches=16", "minibatch_size=32"])
    # A config sized by minibatch_size round-trips: to_dict writes num_minibatches at its default.
    assert PPOConfig.from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg
    path.write_text("minibatch_size: 256\nnum_minibatches: 8\n")
    with pytest.raises(ConfigError, match=r"^minibatch_size=256 and num_minibatches=8 are both given"):
        PPOConfig.from_file(path)
    bad(r"^minibatch_size=16 and num_minibatches=2 are both set; .*keep one", minibatch_size=16,
        num_minibatches=2)
    # A resolved config (what config.yaml records) reads back as the same config.
    resolved = resolve(cfg).config
    assert PPOConfig.from_dict(yaml.safe_load(yaml.safe_dump(resolved.to_dict()))) == resolved


@pytest.mark.parametrize("changes,match", [
    # BASE: 4 envs x 16 steps = 64 transitions per batch
    (dict(minibatch_size=0), r"^minibatch_size=0 must be an integer >= 1"),
    (dict(minibatch_size=24), r"^minibatch_size=24 does not cut the batch of num_envs\*num_steps = "
                              r"4\*16 = 64 transitions into minibatches of whole rollout steps "
                              r"\(num_steps=16 must be a multiple .*choose one of \[4, 8, 16, 32, 64\]"),
    (dict(minibatch_size=128), r"^minibatch_size=128 is larger than the batch .*= 64 transitions; "
                               r"choose one of \[4, 8, 16, 32, 64\]"),
    # recurrent: whole env sequences, so the number of minibatches divides num_envs (4)
    (dict(minibatch_size=8, network=NetworkConfig(recurrent_size=8)),
     r"^minibatch_size=8 does not cut .*whole env sequences \(num_envs=4 .*\[16, 32, 64\]"),
])
def test_minibatch_size_must_cut_the_batch_into_whole_minibatches(changes, match):
    bad(match, **changes)


def test_minibatch_size_named_in_a_per_device_split_error():
    """The per-device rule of recurrent minibatches, on the num_minibatches minibatch_size
    gives, names minibatch_size."""
    from jaxppo.program.layout import Layout

    cfg = BASE.replace(num_envs=8, minibatch_size=16, network=NetworkConfig(recurrent_size=8))
    resolved = resolve(cfg)  # one device: 8 envs / 8 minibatches
    assert resolved.config.num_minibatches == 8
    with pytest.raises(ConfigError, match=r"num_minibatches=8 does not divide the envs on each device"):
        resolved.with_layout(Layout(local_devices=2))


# ------------------------------------------------------------------ strict scalar types
@pytest.mark.parametrize("field", ["use_kl_loss", "normalize_advantages", "normalize_observations",
                                   "normalize_rewards", "eval_deterministic", "tensorboard"])
@pytest.mark.parametrize("value", ["false", "maybe", "abc", 1, 0, None])
def test_booleans_take_only_booleans(field, value):
    bad(rf"^{field}={re.escape(repr(value))} must be true or false", **{field: value})


def test_advantages_are_standardised_over_the_batch_or_each_minibatch():
    assert PPOConfig().normalize_advantages_over == "batch"
    PPOConfig(normalize_advantages_over="minibatch").validate()
    bad(r"^normalize_advantages_over='minibatches' is not one of \('batch', 'minibatch'\).*"
        r"did you mean 'minibatch'", normalize_advantages_over="minibatches")


def test_gradients_are_clipped_over_all_parameters_or_each_network_apart():
    assert PPOConfig().max_grad_norm_over == "all"
    resolve(BASE.replace(max_grad_norm_over="each_network"), "local")  # two torsos: apart
    bad(r"^max_grad_norm_over='each' is not one of \('all', 'each_network'\).*"
        r"did you mean 'each_network'", max_grad_norm_over="each")
    bad(r"^max_grad_norm_over='each_network' clips .* network\.shared_trunk=true gives them "
        r"one torso; set network\.shared_trunk: false, or max_grad_norm_over: all",
        max_grad_norm_over="each_network", network=NetworkConfig(shared_trunk=True))
    bad(r"^max_grad_norm_over='each_network' clips .* network\.recurrent_size=8 they share "
        r"one GRU unless the critic has an input of its own \(critic_input: world_state",
        max_grad_norm_over="each_network", network=NetworkConfig(recurrent_size=8))
    bad(r"^max_grad_norm_over='each_network' clips .* network\.module=.* replaces it; use "
        r"max_grad_norm_over: all", max_grad_norm_over="each_network",
        network=NetworkConfig(module="jaxppo.examples.networks:LayerNormActorCritic"))


def test_critic_lr_is_lr_unless_given_and_needs_networks_apart():
    """critic_lr null is lr (the leaf: lr's points with values below 0); a value, its schedule in lr's
    form; searched, the critic's own; refused where actor and critic share a layer, and
    where hparams give it a value the config's program would not use."""
    import jax
    import jax.numpy as jnp

    from jaxppo.config import own_critic_lr
    from jaxppo.core.hyperparams import FOLLOWS_LR, HyperParams
    from jaxppo.core.ppo import critic_lr_at
    from jaxppo.run.train import check_hparams
    from jaxppo.search.sweep import hparams_from_record, make_record

    assert PPOConfig().critic_lr is None and not own_critic_lr(BASE)
    hp = HyperParams.from_config(BASE)
    np.testing.assert_array_equal(hp.critic_lr_points, [[0.0, FOLLOWS_LR], [1024.0, FOLLOWS_LR]])
    steps = jnp.asarray(512, jnp.int32)
    assert float(critic_lr_at(hp, jnp.float32(1e-3), steps)) == pytest.approx(1e-3)  # lr
    own = BASE.replace(critic_lr=1e-3)  # linear, as lr_schedule: 5e-4 half-way
    assert own_critic_lr(own) and own_critic_lr(BASE.replace(
        num_seeds=2, search={"critic_lr": {"loguniform": [1e-4, 1e-3]}}))
    assert float(critic_lr_at(HyperParams.from_config(own), jnp.float32(1.0), steps)) == \
        pytest.approx(5e-4)
    resolve(own, "local")
    bad(r"^critic_lr=0 must be > 0", critic_lr=0)
    bad(r"^critic_lr gives the critic a learning rate of its own, but network\.shared_trunk="
        r"true gives them one torso; set network\.shared_trunk: false, or critic_lr: null",
        critic_lr=1e-3, network=NetworkConfig(shared_trunk=True))
    bad(r"^critic_lr gives .* network\.recurrent_size=8 they share one GRU .* use critic_lr: "
        r"null", critic_lr=1e-3, network=NetworkConfig(recurrent_size=8))
    bad(r"^search\.critic_lr gives .* network\.module=.* replaces it; use critic_lr: null",
        num_seeds=2, search={"critic_lr": {"loguniform": [1e-4, 1e-3]}},
        network=NetworkConfig(module="jaxppo.examples.networks:LayerNormActorCritic"))
    # A sweep records null as null, and reads a record from before critic_lr as null.
    sweep = HyperParams.stack([HyperParams.from_config(BASE.replace(lr=lr)) for lr in (1e-4, 1e-3)])
    record = make_record(sweep, 2)
    assert record["differing"].keys() == {"lr"} and record["hparams"][0]["critic_lr"] is None
    for m in record["hparams"]:
        del m["critic_lr"]
    jax.tree.map(np.testing.assert_array_equal, hparams_from_record(record), sweep)
    mixed = HyperParams.stack([HyperParams.from_config(BASE.replace(critic_lr=c))
                               for c in (None, 1e-3)])
    record = make_record(mixed, 2)
    assert record["differing"] == {"critic_lr": [None, [[0.0, 0.001], [1024.0, 0.0]]]}
    jax.tree.map(np.testing.assert_array_equal, hparams_from_record(record), mixed)
    with pytest.raises(ConfigError, match=r"hparams give critic_lr a value, but the config's "
                       r"critic_lr is null, .* set critic_lr in the config too"):
        check_hparams(mixed, 2, config=BASE.replace(num_seeds=2))
    check_hparams(mixed, 2, config=BASE.replace(num_seeds=2, critic_lr=1e-3))


def test_network_booleans_and_sizes_are_strict():
    bad(r"^network\.shared_trunk='abc' must be true or false", network=NetworkConfig(shared_trunk="abc"))
    bad(r"^network\.state_dependent_std='yes' must be true or false",
        network=NetworkConfig(state_dependent_std="yes"))
    bad(r"^network\.hidden_sizes=\[64\.7\] must be", network=NetworkConfig(hidden_sizes=[64.7]))
    bad(r"^network\.hidden_sizes=\['abc'\] must be", network=NetworkConfig(hidden_sizes=["abc"]))
    bad(r"^network\.conv_channels=\[16\.5\]", network=NetworkConfig(conv_channels=[16.5]))
    assert NetworkConfig(hidden_sizes=[64.0, np.int64(32)]).hidden_sizes == (64, 32)


def test_integers_take_whole_numbers_and_numpy_or_jax_scalars():
    import jax.numpy as jnp

    cfg = BASE.replace(num_envs=np.int64(8), num_steps=jnp.int32(16), total_timesteps=2048.0,
                       gamma=np.float32(0.98), lr=jnp.float32(1e-3), use_kl_loss=np.bool_(True))
    resolve(cfg)
    assert (cfg.num_envs, cfg.num_steps, cfg.total_timesteps) == (8, 16, 2048)
    assert all(type(v) is int for v in (cfg.num_envs, cfg.num_steps, cfg.total_timesteps))
    assert type(cfg.gamma) is float and type(cfg.lr) is float and cfg.use_kl_loss is True
    bad(r"^num_envs=4\.5 must be an integer >= 1", num_envs=4.5)
    bad(r"^num_envs='4' must be an integer >= 1", num_envs="4")
    bad(r"^gamma=nan must be a number in \[0, 1\]", gamma=float("nan"))


@pytest.mark.parametrize("path", sorted(TUNED_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_budgets_are_whole_batches(path, recwarn):
    """No shipped tuned config prints the partial-batch note: its budget is a whole number
    of batches (num_envs*num_steps)."""
    cfg = PPOConfig.from_file(path)
    assert cfg.total_timesteps % cfg.batch_size == 0, (cfg.total_timesteps, cfg.batch_size)
    note_partial_batch(cfg)
    assert not [w for w in recwarn if "not a multiple of the batch" in str(w.message)]


def test_total_timesteps_beyond_the_int32_counter_is_refused_and_a_partial_batch_is_said():
    msg = bad(r"^total_timesteps=2147483648 is more than 2147483647", total_timesteps=2**31)
    assert "int32 step counter" in msg
    resolve(BASE.replace(total_timesteps=2**31 - 64))  # a whole number of batches
    with pytest.warns(UserWarning, match=r"total_timesteps=1000 is not a multiple of the batch "
                                         r"\(num_envs\*num_steps = 64\): the run does 15 iteration\(s\) = 960"):
        note_partial_batch(resolve(BASE.replace(total_timesteps=1000)).config)
    with warnings.catch_warnings():  # 1e5 + 10 loses 10 steps (0.01%): nothing is said
        warnings.simplefilter("error")
        note_partial_batch(resolve(BASE.replace(total_timesteps=100_010)).config)


def test_warnings_point_at_the_users_line(recwarn):
    """A warning from deep inside jaxppo is attributed to the caller's own line."""
    note_partial_batch(resolve(BASE.replace(total_timesteps=1000)).config)
    (w,) = [w for w in recwarn if "not a multiple of the batch" in str(w.message)]
    assert w.filename == __file__, w.filename


# ------------------------------------------------------------------ config files and --set text
_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi"))


@pytest.mark.parametrize("name,text,match", [
    ("bad.yaml", "lr: [1,\n", r"is not valid YAML: expected the node content, but found '<stream "
                              r"end>' at line 2, column 1"),
    ("bad.json", '{"lr": 1', r"is not valid JSON: Expecting ',' delimiter at line 1, column 9"),
    ("dup.yaml", "lr: 1e-3\nnum_envs: 8\nlr: 2e-3\n", r"key 'lr' is given twice \(lines 1 and 3\); keep one"),
    ("dup.json", '{"lr": 1, "lr": 2}', r"key 'lr' is given twice in one JSON object"),
    ("netdup.yaml", "network:\n  activation: relu\n  activation: tanh\n", r"key 'activation' is given twice"),
    ("bomb.yaml", _BOMB, r"expands to more than 100,000 values \(YAML aliases\?\)"),
    ("bomb_in_field.yaml", _BOMB.replace("i:", "transforms:"), r"expands to more than 100,000 values"),
    ("python.yaml", "lr: !!python/object/apply:os.system ['touch /tmp/jaxppo-pwned']\n",
     r"is not valid YAML: .*python/object/apply:os\.system"),
    ("binary.yaml", b"\xff\xfe\x00lr", r"cannot be read as text"),
], ids=lambda v: v if isinstance(v, str) and v.endswith(("yaml", "json")) else "")
def test_bad_config_files_are_clear_errors(tmp_path, capsys, name, text, match):
    """Malformed YAML/JSON, duplicate keys, alias bombs (bounded: refused before anything
    walks the values), python tags (never executed) and binary files: one ConfigError naming
    the file and the problem, from the API and from the CLI (exit 2, no traceback)."""
    from jaxppo import cli

    path = tmp_path / name
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    with pytest.raises(ConfigError, match=match):
        PPOConfig.from_file(path)
    assert cli.main(["train", "--config", str(path), "--runs-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "Traceback" not in err and len(err.splitlines()) <= 3, err
    assert not (tmp_path / "runs").exists() and not Path("/tmp/jaxppo-pwned").exists()


def test_a_directory_as_config_file_and_broken_set_values(tmp_path, capsys):
    from jaxppo import cli

    with pytest.raises(ConfigError, match=r"is a directory; give the YAML or JSON file itself"):
        PPOConfig.from_file(tmp_path)
    with pytest.raises(ConfigError, match=r"--set 'lr=\[1,' is not valid YAML: .* at line 1, column 4"):
        PPOConfig().with_overrides(["lr=[1,"])
    with pytest.raises(ConfigError, match=r"--set 'lr=\{a: 1, a: 2\}': key 'a' is given twice"):
        PPOConfig().with_overrides(["lr={a: 1, a: 2}"])
    for argv in (["--config", str(tmp_path)], ["--set", "lr=[1,"]):
        assert cli.main(["train", *argv, "--runs-dir", str(tmp_path / "runs")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "Traceback" not in err


@pytest.mark.parametrize("network,match", [
    (dict(state_dependent_std=True), r"network\.state_dependent_std=True only applies to the Gaussian"),
    (dict(log_std_init=-0.5), r"network\.log_std_init=-0\.5 only applies to the Gaussian of "
                              r"continuous actions, but CartPole-v1 has 2 discrete actions"),
])
def test_continuous_action_options_on_a_discrete_env_are_errors(network, match):
    with pytest.raises(ConfigError, match=match):
        resolve(PPOConfig(env="CartPole-v1", network=NetworkConfig(**network)))
    resolve(PPOConfig(env="Pendulum-v1", network=NetworkConfig(**network)))  # meaningful there


@pytest.mark.parametrize("steps", [-5, 0])
def test_a_time_limit_below_one_step_is_an_error(steps):
    with pytest.raises(ConfigError, match=rf"max_steps_in_episode={steps} \(env_kwargs/env_params\) "
                                          r"must be >= 1: .*the CartPole-v1 default is 500"):
        resolve(PPOConfig(env="CartPole-v1", env_kwargs={"max_steps_in_episode": steps}))


# ---------------------------------------------------------------------- adversarial input
@pytest.mark.parametrize("make,match", [
    (lambda: PPOConfig(num_env=8), r"^PPOConfig has no field 'num_env'; did you mean 'num_envs'"),
    (lambda: PPOConfig(learning_rate=1e-3), r"^PPOConfig has no field 'learning_rate'; did you mean 'lr'\?"),
    (lambda: BASE.replace(clip_eps=0.1), r"^PPOConfig has no field 'clip_eps'; did you mean 'clip_param'\?"),
    (lambda: PPOConfig(frame_stack=4), r"^PPOConfig has no field 'frame_stack'; it is an env "
     r"transform, given in the list `transforms`: transforms=\[\{frame_stack: \{k: 4\}\}\]"),
    (lambda: PPOConfig.from_dict({"count_bonus": 0.1}),
     r"^unknown config key 'count_bonus'; .*transforms=\[\{count_bonus: \{scale: 0\.1\}\}\]"),
    (lambda: NetworkConfig(hidden_size=(8,)),
     r"^NetworkConfig has no field 'network\.hidden_size'; did you mean 'network\.hidden_sizes'"),
])
def test_unknown_keywords_name_the_nearest_field(make, match):
    """Not the dataclass's bare TypeError ("__init__() got an unexpected keyword argument")."""
    with pytest.raises(ConfigError, match=match):
        make()


def test_every_builtin_transform_given_as_a_field_is_pointed_to_transforms():
    from jaxppo.config_files import TRANSFORM_KEYS
    from jaxppo.envs.transforms import BUILTIN_TRANSFORMS

    assert set(BUILTIN_TRANSFORMS) <= set(TRANSFORM_KEYS)
    for example in TRANSFORM_KEYS.values():  # each example is a valid transforms entry
        PPOConfig.from_dict({"transforms": [yaml.safe_load(example)]}).validate()


@pytest.mark.parametrize("network,match", [
    (dict(hidden_sizes=64), r"^network\.hidden_sizes=64 must be a non-empty list"),
    (dict(hidden_sizes=None), r"^network\.hidden_sizes=None must be a non-empty list"),
    (dict(hidden_sizes="64"), r"^network\.hidden_sizes='64' must be a non-empty list"),
    (dict(conv_channels=16), r"^network\.conv_channels=16 / conv_kernel=3 must be positive"),
    (dict(conv_channels=None), r"^network\.conv_channels=None / conv_kernel=3 must be positive"),
    (dict(conv_pool=0), r"^network\.conv_pool=0 must be an integer >= 1"),
    (dict(conv_pool=1.5), r"^network\.conv_pool=1\.5 must be an integer >= 1"),
])
def test_list_fields_given_a_scalar_are_config_errors(network, match):
    bad(match, network=NetworkConfig(**network))


@pytest.mark.parametrize("changes,match", [
    (dict(seed=2**70), r"^seed=1180591620717411303424 must be an integer from -2\*\*63 to 2\*\*63 - 1"),
    (dict(seed=-2**63 - 1), r"^seed=-9223372036854775809 must be an integer from -2\*\*63"),
    (dict(compilation_cache_dir=5), r"^compilation_cache_dir=5 must be a folder path .* or null"),
    (dict(compilation_cache_dir=["a"]), r"^compilation_cache_dir=\['a'\] must be a folder path"),
    (dict(eval_max_steps=10**12), r"^eval_max_steps=1000000000000 is more than 2147483647"),
    (dict(lr=1e300), r"^lr=1e\+300 is beyond the float32 range"),
    (dict(lr=[[0, 1e-3], [100, 1e39]]), r"^lr=1e\+39 is beyond the float32 range"),
    (dict(clip_param=1e39), r"^clip_param=1e\+39 is beyond the float32 range"),
    (dict(vf_coeff=-1e39), r"^vf_coeff=-1e\+39 is beyond the float32 range"),
    (dict(entropy_coeff=1e39), r"^entropy_coeff=1e\+39 is beyond the float32 range"),
])
def test_values_beyond_what_the_program_holds_are_refused(changes, match):
    """A seed beyond 64 bits, a step bound beyond int32 and a float beyond float32 would fail
    (or turn inf) inside JAX; the config names the field instead."""
    bad(match, **changes)


def test_large_but_representable_values_pass():
    BASE.replace(seed=2**63 - 1, eval_max_steps=2**31 - 1, lr=1e38, checkpoint_minutes=1e300).validate()


@pytest.mark.parametrize("call,match", [
    (lambda: PPOConfig.from_dict("lr=3"), r"^PPOConfig\.from_dict takes a mapping of field: value, got str 'lr=3'"),
    (lambda: PPOConfig.from_dict(None), r"^PPOConfig\.from_dict takes a mapping .* got NoneType None"),
    (lambda: PPOConfig.from_dict([("lr", 3)]), r"^PPOConfig\.from_dict takes a mapping"),
    (lambda: PPOConfig.from_dict({}, base={"lr": 1}), r"^base=\{'lr': 1\} must be a PPOConfig"),
    (lambda: PPOConfig.from_file(None), r"^PPOConfig\.from_file takes the path of a YAML or JSON file, got NoneType"),
    (lambda: PPOConfig.from_file(5), r"^PPOConfig\.from_file takes the path .* got int 5"),
])
def test_loaders_given_the_wrong_kind_of_argument(call, match):
    with pytest.raises(ConfigError, match=match):
        call()


@pytest.mark.parametrize("env_kwargs,match", [
    ({"max_steps_in_episode": "abc"}, r"^env_kwargs max_steps_in_episode='abc' must be a number: it sets "
                                      r"CartPole-v1's param max_steps_in_episode \(default 500\)"),
    ({"gravity": "strong"}, r"^env_kwargs gravity='strong' must be a number: .*default 9\.8"),
    ({"gravity": [1.0, 2.0]}, r"^env_kwargs gravity=\[1\.0, 2\.0\] must be a number"),
    ({"gravity": None}, r"^env_kwargs gravity=None must be a number"),
])
def test_env_params_given_a_non_number_are_config_errors(env_kwargs, match):
    with pytest.raises(ConfigError, match=match):
        resolve(PPOConfig(env="CartPole-v1", env_kwargs=env_kwargs))


@pytest.mark.parametrize("env,network,match", [
    ("CartPole-v1", dict(conv_channels=(32,)),
     r"^network\.conv_channels=\[32\] only shapes a CNN torso, but CartPole-v1's observations "
     r"\(4,\) are not images"),
    ("CartPole-v1", dict(conv_channels=(32,), conv_kernel=5),
     r"^network\.conv_channels=\[32\] and network\.conv_kernel=5 only shape a CNN torso"),
    ("Breakout-MinAtar", dict(torso="mlp", conv_kernel=5),
     r"^network\.conv_kernel=5 only shapes a CNN torso, but network\.torso is 'mlp'; remove it"),
    ("Breakout-MinAtar", dict(conv_kernel=50),
     r"^network\.conv_kernel=50 is wider than Breakout-MinAtar's 10x10 images .* at most 10"),
    ("CartPole-v1", dict(conv_pool=2),
     r"^network\.conv_pool=2 only shapes a CNN torso, but CartPole-v1's observations"),
    ("Breakout-MinAtar", dict(conv_channels=(8, 8), conv_pool=4),
     r"^network\.conv_pool=4 after each of 2 conv layer\(s\) shrinks Breakout-MinAtar's 10x10 "
     r"images to nothing; use fewer conv layers or a smaller conv_pool"),
])
def test_conv_options_that_shape_nothing_are_errors(env, network, match):
    with pytest.raises(ConfigError, match=match):
        resolve(PPOConfig(env=env, network=NetworkConfig(**network)))


def test_conv_options_of_a_cnn_torso_pass():
    resolve(PPOConfig(env="Breakout-MinAtar", network=NetworkConfig(conv_channels=(8, 8), conv_kernel=10)))
    resolve(PPOConfig(env="Breakout-MinAtar", network=NetworkConfig(conv_channels=(8, 8), conv_pool=3)))
    resolve(PPOConfig(env="Breakout-MinAtar", network=NetworkConfig(torso="mlp")))


# ---------------------------------------------------------------------- memory
FREE = 8 * 2**30  # the free memory the memory tests pretend to have


@pytest.mark.parametrize("setting,first,advice", [
    ("num_seeds=500000", r"Its largest parts, for all 500,000 seeds: the rollout buffer and live envs",
     r"Lower num_seeds \(at most about ([\d,]+) would fit\)"),
    ("eval_episodes=1e9", (r"Its largest parts: the evaluation envs [\d.,]+ GiB \(eval_episodes="
                           r"1,000,000,000 envs run at once\)"), r"Lower eval_episodes \(at most about ([\d,]+) would fit\)\.$"),
    ("network.hidden_sizes=[100000,100000]",
     # per seed: two torsos of 4*1e5 + 1e5 + 1e10 + 1e5, a 2-action policy head and a value head
     (r"Its largest parts: network parameters, gradients and optimizer state 298\.0 GiB \("
      r"network\.hidden_sizes=\[100000, 100000\]: 20,001,500,003 parameters per seed\)"),
     r"Use fewer or narrower layers in network\.hidden_sizes\.$()"),
], ids=["num_seeds", "eval_episodes", "hidden_sizes"])
def test_memory_errors_name_the_field_that_needs_the_memory(tmp_path, capsys, monkeypatch, setting,
                                                            first, advice):
    """A config whose buffers cannot fit is refused before anything is allocated or compiled,
    from the command line: one paragraph that lists the largest parts with their sizes and
    the fields behind them and advises lowering the one that dominates (never num_envs
    here), exit 2, no traceback, no run folder."""
    from jaxppo import cli
    from jaxppo.program import build, memory

    def compiling(*args, **kw):
        raise AssertionError("compiled before the memory check")

    monkeypatch.setattr(memory, "free_memory", lambda: FREE)
    monkeypatch.setattr(build, "initialise_and_compile", compiling)
    settings = [setting] + (["eval_every=10"] if setting.startswith("eval") else [])
    assert cli.main(["train", "--env", "CartPole-v1", "--set", *settings, "--runs-dir",
                     str(tmp_path / "runs"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("error: "))
    assert line.startswith("error: the training program needs at least "), err
    assert "8.0 GiB is free on " in line
    assert re.search(first, line), line
    fits = re.search(advice, line)
    assert fits, line
    assert "num_envs (" not in line and "Traceback" not in err
    assert not (tmp_path / "runs").exists()
    if fits.group(1):  # the count that would fit is below the one asked and fits the free memory
        n = int(fits.group(1).replace(",", ""))
        asked = 500_000 if "seeds" in setting else 10**9
        assert 1 <= n < asked
        if "eval" in setting:  # each eval env holds at least its observation and a layer of 64
            assert n <= FREE / (4 * 4 + 64 * 4)
