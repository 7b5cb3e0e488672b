"""The one PPO configuration object, its validation and its loading from files and the CLI.

`PPOConfig` holds everything a run needs. Its fields split in two:

* static fields fix shapes and program structure (env, num_envs, num_steps, network, ...);
  changing one means compiling a new program;
* tunable scalars (`HyperParams`: lr, clip_param, entropy_coeff, gamma, ...) are pytree
  leaves of the compiled program, so a sweep is `jax.vmap` over a batch of `HyperParams`.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import math
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, Union

from jaxppo.search import space
from jaxppo.errors import ConfigError

# A schedule is a constant, or a piecewise-linear list of [env_step, value] points.
Schedule = Union[float, Sequence[Sequence[float]]]

ACTIVATIONS = ("tanh", "relu", "gelu", "silu", "elu")
TORSOS = ("auto", "mlp", "cnn")
SCHEDULE_KINDS = ("constant", "linear")
SYNC_KINDS = ("gradients", "batch")


MAX_TIMESTEPS = 2**31 - 1  # env steps per seed: the step counter is int32
LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0  # bounds of a state-dependent log std

# Tuned configs shipped with the package: configs/<env>.yaml.
TUNED_DIR = Path(__file__).resolve().parent / "configs"


def tuned_config_path(env_name: str) -> Path | None:
    """The packaged tuned config of `env_name`, or None when there is none."""
    path = TUNED_DIR / f"{env_name}.yaml"
    return path if path.is_file() else None


def tuned_env_names() -> list[str]:
    return sorted(p.stem for p in TUNED_DIR.glob("*.yaml"))


@dataclass(frozen=True)
class NetworkConfig:
    """Actor-critic MLP shape."""

    hidden_sizes: tuple[int, ...] = (64, 64)  # widths of the MLP layers (of each torso)
    activation: str = "tanh"  # tanh | relu | gelu | silu | elu
    shared_trunk: bool = False  # one torso for actor and critic, two heads
    torso: str = "auto"  # "mlp", "cnn" (image observations), or "auto": cnn for [H, W, C] obs
    conv_channels: tuple[int, ...] = (16,)  # cnn torso: channels of each conv layer
    conv_kernel: int = 3  # cnn torso: kernel size
    conv_pool: int = 1  # cnn torso: average-pool window (and stride) after each conv; 1 = none
    recurrent_size: int = 0  # 0 = feed-forward; > 0 = a GRU core of this size
    # continuous actions: the Gaussian's initial log std, and whether the std is a learned
    # vector shared by all states (False) or a head on the actor's features (True)
    log_std_init: float = 0.0  # continuous actions: the Gaussian's initial log std
    state_dependent_std: bool = False  # continuous actions: std from the actor's features

    def __post_init__(self):
        for name in ("hidden_sizes", "conv_channels"):
            v = getattr(self, name)
            if isinstance(v, (list, tuple)):  # whole numbers become ints; others stay for validate
                object.__setattr__(self, name, tuple(_whole(_plain(x)) for x in v))
        for f in dataclasses.fields(self):
            if f.name not in ("hidden_sizes", "conv_channels"):
                v = _plain(getattr(self, f.name))
                object.__setattr__(self, f.name, _whole(v) if f.name in _NET_INT_FIELDS else v)


@dataclass(frozen=True)
class PPOConfig:
    """Everything a PPO run needs. Defaults are PureJaxRL's CartPole settings.

    Units: `total_timesteps`, schedule points and `env_steps` metrics count single env
    transitions summed over all envs (and seeds count separately: each seed gets the budget).
    """

    # --- environment ---
    env: Any = "CartPole-v1"  # a gymnax-registered name, or an env object with the gymnax API
    env_kwargs: dict = field(default_factory=dict)  # env constructor args and env params
    env_params: Any = None  # gymnax EnvParams override; null = the env's defaults
    # --- batch shape ---
    num_envs: int = 4  # parallel envs (global: split over devices and hosts)
    num_steps: int = 128  # rollout length per env per iteration
    total_timesteps: int = 500_000  # env steps per seed
    num_epochs: int = 4  # passes over each batch
    num_minibatches: int = 4  # minibatches per epoch
    # --- returns ---
    gamma: float = 0.99  # discount
    gae_lambda: float = 0.95  # GAE lambda
    # --- optimisation ---
    lr: Schedule = 2.5e-4  # a number, or [[env_step, value], ...] (piecewise linear)
    lr_schedule: str = "linear"  # "constant" | "linear" (anneal to 0); ignored for a list
    adam_eps: float = 1e-5  # Adam epsilon
    max_grad_norm: float = 0.5  # global-norm gradient clipping
    # --- loss ---
    clip_param: float = 0.2  # PPO's ratio clip epsilon
    # Value-loss clipping around the acting value, as PureJaxRL (CLIP_EPS) and RLlib do;
    # None = unclipped. At PureJaxRL's CartPole config it keeps late training stable.
    vf_clip_param: float | None = 0.2  # clip of the value change; null = unclipped
    vf_coeff: float = 0.5  # weight of the value loss
    entropy_coeff: Schedule = 0.01  # a number or a schedule, as lr
    entropy_schedule: str = "constant"  # "constant" | "linear"; ignored for a list
    use_kl_loss: bool = False  # add an adaptive KL(old||new) penalty (RLlib's)
    kl_coeff: float = 0.2  # initial coefficient of the KL penalty
    kl_target: float = 0.01  # the KL the coefficient adapts towards
    normalize_advantages: bool = True  # standardise advantages over the whole batch
    # --- normalisation ---
    normalize_observations: bool = False  # running mean/std of observations
    normalize_rewards: bool = False  # scale rewards by the std of the discounted return
    # --- network ---
    network: NetworkConfig = field(default_factory=NetworkConfig)
    # --- user transforms (jaxppo.envs.transforms): observation wrappers and reward hooks, in order,
    # e.g. [{"frame_stack": {"k": 4}}, {"count_bonus": {"scale": 0.1}}] ---
    transforms: tuple = ()  # observation wrappers and reward hooks, in order
    # --- devices ---
    num_devices: int | None = None  # local devices to pmap over; null = all of them
    # How shards (devices, hosts) combine: "gradients" all-reduces every minibatch's gradient
    # (the update's compute is split); "batch" all-gathers the rollout once per iteration and
    # every shard runs the whole update (one collective per iteration instead of one per
    # minibatch: for small networks where collectives are slow, e.g. CPU hosts).
    sync: str = "gradients"  # "gradients" (per minibatch) | "batch" (per iteration)
    # --- run ---
    seed: int = 0  # seed of the run (seed i of num_seeds derives from it)
    num_seeds: int = 1  # seeds trained together in one vmapped program
    log_every: int = 0  # iterations per compiled chunk between progress updates; 0 = auto
    compilation_cache_dir: str | None = "~/.cache/jaxppo/xla"  # null disables the cache
    # --- run lifecycle (checkpoints, evaluation, logs) ---
    checkpoint_every: int = 0  # iterations between checkpoints in RUN_DIR/checkpoints; 0 = none by count
    # Minutes of training between checkpoints (at the end of the chunk that passes the mark),
    # so a long run keeps recent state whatever checkpoint_every says; 0 = none by time. A
    # run always checkpoints at its end and when stopped by SIGINT/SIGTERM.
    checkpoint_minutes: float = 5.0  # minutes between checkpoints; 0 = none by time
    keep_checkpoints: int = 3  # newest checkpoints kept; older ones are deleted after a save
    eval_every: int = 0  # iterations between evaluations (and at the last one); 0 = no evaluation
    eval_episodes: int = 8  # eval envs, each runs one full episode per evaluation
    eval_deterministic: bool = True  # act with the policy's mode rather than sampling
    eval_max_steps: int | None = None  # bound on an eval episode; null = env's max_steps_in_episode
    tensorboard: bool = False  # also write TensorBoard event files to RUN_DIR/tensorboard
    # Weights & Biases: {project: ..., mode: online|offline|disabled, entity, name, dir, group,
    # tags, notes} (only project is needed; mode defaults to WANDB_MODE, else online). Logging
    # only: it changes neither the compiled program nor what a resume may change.
    wandb: dict | None = None  # W&B logging, e.g. {project: jaxppo, mode: offline}; null = off
    # --- hyperparameter search and population-based training (jaxppo.search.space) ---
    # Distributions over tunable fields, drawn once per member of the vmapped population, e.g.
    # {population: 8, lr: {loguniform: [1e-4, 1e-2]}, gamma: {choice: [0.99, 0.995]}};
    # population = settings (num_seeds follows it when left at 1), each num_seeds/population seeds.
    search: dict | None = None  # hyperparameter search over the members; null = off
    # Population-based training inside the compiled program: every `interval` iterations the
    # worst `fraction` of members copy a best member's learner state and perturb (x `perturb`)
    # or redraw (`resample_probability`) the searched fields; ranked by `fitness` ("return" |
    # "eval"). Needs `search`.
    pbt: dict | None = None  # e.g. {interval: 10, fraction: 0.25}; null = off

    def __post_init__(self):
        # Lists from YAML/JSON and tuples from Python mean the same config: store one form,
        # so a config read back from its own config.yaml compares equal to the original.
        for name in ("lr", "entropy_coeff"):
            v = getattr(self, name)
            if isinstance(v, (list, tuple)):
                object.__setattr__(self, name, [
                    list(p) if isinstance(p, (list, tuple)) else p for p in v])
        if isinstance(self.transforms, list):
            object.__setattr__(self, "transforms", tuple(self.transforms))
        for f in dataclasses.fields(self):  # numpy / jax scalars become Python numbers
            v = _plain(getattr(self, f.name))
            if f.name in _INT_FIELDS:
                v = _whole(v)
            object.__setattr__(self, f.name, v)
        # A search that names its population trains that many members unless num_seeds
        # says more (seeds of each setting).
        settings = self.search.get("population") if isinstance(self.search, dict) else None
        if self.num_seeds == 1 and _is_int(settings) and settings > 1:
            object.__setattr__(self, "num_seeds", settings)

    # ------------------------------------------------------------------ derived sizes
    @property
    def batch_size(self) -> int:
        """Transitions per iteration (one seed): num_envs * num_steps."""
        return self.num_envs * self.num_steps

    @property
    def minibatch_size(self) -> int:
        return self.batch_size // self.num_minibatches

    @property
    def num_iterations(self) -> int:
        return self.total_timesteps // self.batch_size

    @property
    def env_name(self) -> str:
        """A short readable name of the env (run folder names, labels): the registered name,
        "brax-<name>" for "brax:<name>" (no ':' in folder names), the class of a
        "module:Class" env, or an env object's `name` (else its class name)."""
        if isinstance(self.env, str):
            if self.env.startswith("brax:"):  # "brax-halfcheetah": the suite stays in the name
                return "brax-" + self.env[len("brax:"):]
            return self.env.rpartition(":")[2].rpartition(".")[2] or self.env
        return getattr(self.env, "name", type(self.env).__name__)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, values: dict, base: "PPOConfig | None" = None) -> "PPOConfig":
        """Build a config from a plain dict (a YAML/JSON file, `--set` pairs).

        Unknown keys raise ConfigError suggesting the nearest field.
        """
        if not isinstance(values, dict):
            raise ConfigError(
                f"PPOConfig.from_dict takes a mapping of field: value, got "
                f"{type(values).__name__} {_short_repr(values)}; e.g. "
                "PPOConfig.from_dict({'env': 'CartPole-v1', 'lr': 3e-4}) (a file: "
                "PPOConfig.from_file(path); key=value strings: config.with_overrides([...]))")
        if base is not None and not isinstance(base, PPOConfig):
            raise ConfigError(f"base={_short_repr(base)} must be a PPOConfig (or None for the "
                              "defaults)")
        base = base if base is not None else cls()
        values = dict(values)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in values if k not in names]
        if unknown:
            key = unknown[0]
            raise ConfigError(
                f"unknown config key {key!r}{_suggest_field(key, names)}; "
                f"valid keys: {', '.join(sorted(names))}"
            )
        if "network" in values:
            net = values["network"]
            if isinstance(net, dict):
                net_names = {f.name for f in dataclasses.fields(NetworkConfig)}
                for k in net:
                    if k not in net_names:
                        raise ConfigError(
                            f"unknown config key 'network.{k}'"
                            f"{_did_you_mean(k, net_names, prefix='network.')}; "
                            f"valid keys: {', '.join('network.' + n for n in sorted(net_names))}"
                        )
                values["network"] = dataclasses.replace(base.network, **net)
            elif not isinstance(net, NetworkConfig):
                raise ConfigError(
                    f"network={net!r} must be a mapping such as "
                    "{'hidden_sizes': [64, 64], 'activation': 'tanh', 'shared_trunk': False}"
                )
        return dataclasses.replace(base, **values)

    @classmethod
    def from_file(cls, path: str | Path, base: "PPOConfig | None" = None) -> "PPOConfig":
        """`base` (default: the defaults) with the fields a YAML or JSON file sets."""
        if not isinstance(path, (str, Path)):
            raise ConfigError(f"PPOConfig.from_file takes the path of a YAML or JSON file, got "
                              f"{type(path).__name__} {_short_repr(path)}")
        return cls.from_dict(read_config_file(path), base)

    @classmethod
    def tuned(cls, env: str, **overrides) -> "PPOConfig":
        """The packaged tuned config of `env` (see `tuned_env_names()`), with `overrides`
        (field=value; `network` takes a mapping of its fields) on top."""
        path = tuned_config_path(env) if isinstance(env, str) else None
        if path is None:
            names = tuned_env_names()
            raise ConfigError(
                f"no tuned config for env={env!r}{_did_you_mean(str(env), names)}; tuned "
                f"configs exist for {', '.join(names)}. For another env start from "
                f"PPOConfig(env={env!r}, ...)")
        return cls.from_dict(overrides, cls.from_file(path))

    def with_overrides(self, pairs: Sequence[str]) -> "PPOConfig":
        """Apply CLI `key=value` pairs; values are parsed as YAML (numbers, lists, null...)."""
        values: dict[str, Any] = {}
        for pair in pairs:
            if "=" not in pair:
                raise ConfigError(f"--set {pair!r} must have the form key=value, e.g. lr=3e-4")
            key, raw = pair.split("=", 1)
            key = key.strip()
            value = load_yaml(raw, where=f"--set {pair!r}") if raw.strip() else None
            if key.startswith("network."):
                values.setdefault("network", {})[key[len("network."):]] = value
            elif key.split(".", 1)[0] in ("wandb", "search", "pbt") and "." in key:
                # wandb.project=..., search.lr={...}, pbt.interval=10: on top of the config's
                section, sub = key.split(".", 1)
                base = getattr(self, section)
                values.setdefault(section, dict(base) if isinstance(base, dict) else {})[sub] = value
            else:
                values[key] = value
        return self.from_dict(values, self)

    def replace(self, **changes) -> "PPOConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """A JSON-friendly dict that `from_dict` reads back. An env object becomes
        "module:Class" when that rebuilds it (`env_record`), else its name."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "network":
                v = {n.name: list(x) if isinstance(x, tuple) else x
                     for n in dataclasses.fields(v) for x in [getattr(v, n.name)]}
            elif f.name == "transforms":
                v = transforms_to_list(v)
            elif f.name == "env":
                v = env_record(self.env, self.env_kwargs) or self.env_name
            elif f.name == "env_params":
                v = None if v is None else repr(v)
            elif isinstance(v, tuple):
                v = [list(p) if isinstance(p, (tuple, list)) else p for p in v]
            out[f.name] = v
        return out

    # ------------------------------------------------------------------ validation
    def validate(self) -> "PPOConfig":
        """Raise ConfigError for every impossible field value; return self so calls chain.

        This checks each field on its own. What needs the env, the transforms or the devices
        (the env name, the network's torso, minibatches over the envs of each device, an
        evaluation bound) is checked by `jaxppo.resolve(config)`, which every entry point calls.
        """
        _check_int(self, "num_envs", 1)
        _check_int(self, "num_steps", 1)
        _check_int(self, "total_timesteps", 1)
        _check_int(self, "num_epochs", 1)
        _check_int(self, "num_minibatches", 1)
        _check_int(self, "num_seeds", 1)
        _check_int(self, "log_every", 0)
        _check_int(self, "checkpoint_every", 0)
        _check_nonneg(self, "checkpoint_minutes", float32=False)
        _check_int(self, "keep_checkpoints", 1)
        _check_int(self, "eval_every", 0)
        _check_int(self, "eval_episodes", 1)
        if self.eval_max_steps is not None:
            _check_int(self, "eval_max_steps", 1)
            if self.eval_max_steps > MAX_TIMESTEPS:
                raise ConfigError(
                    f"eval_max_steps={self.eval_max_steps} is more than {MAX_TIMESTEPS} (2**31 - "
                    "1), the most steps the int32 step counter of an episode holds; use a "
                    "smaller bound (or null for the env's time limit)")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be true or false (a "
                                  "YAML boolean, not a string)")
        if self.sync not in SYNC_KINDS:
            raise ConfigError(
                f"sync={self.sync!r} is not one of {SYNC_KINDS}: 'gradients' all-reduces each "
                "minibatch's gradient, 'batch' all-gathers the rollout once per iteration")
        if self.num_devices is not None:
            _check_int(self, "num_devices", 1)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"seed={self.seed!r} must be an integer")
        check_seed(self.seed, "seed")
        if self.compilation_cache_dir is not None and not isinstance(
                self.compilation_cache_dir, (str, Path)):
            raise ConfigError(
                f"compilation_cache_dir={self.compilation_cache_dir!r} must be a folder path "
                "(e.g. ~/.cache/jaxppo/xla) or null to turn the compilation cache off")
        if self.total_timesteps > MAX_TIMESTEPS:
            raise ConfigError(
                f"total_timesteps={self.total_timesteps} is more than {MAX_TIMESTEPS} "
                "(2**31 - 1), the most env steps per seed the int32 step counter holds; "
                "use more seeds (num_seeds) or shorter runs")
        if self.total_timesteps < self.batch_size:
            raise ConfigError(
                f"total_timesteps={self.total_timesteps} is smaller than one iteration "
                f"(num_envs*num_steps = {self.batch_size}); raise total_timesteps to at least "
                f"{self.batch_size} or lower num_envs/num_steps"
            )
        for name in ("gamma", "gae_lambda"):
            v = getattr(self, name)
            if not _is_number(v) or not 0.0 <= v <= 1.0:
                raise ConfigError(f"{name}={v!r} must be a number in [0, 1], e.g. {name}=0.99")
        _check_schedule(self, "lr", positive=True)
        _check_schedule(self, "entropy_coeff", positive=False)
        for name in ("lr_schedule", "entropy_schedule"):
            if getattr(self, name) not in SCHEDULE_KINDS:
                raise ConfigError(
                    f"{name}={getattr(self, name)!r} is not one of {SCHEDULE_KINDS}; "
                    "for a piecewise schedule give a list of [env_step, value] points instead"
                )
        _check_positive(self, "clip_param")
        _check_positive(self, "adam_eps")
        _check_positive(self, "max_grad_norm")
        _check_positive(self, "kl_target")
        _check_nonneg(self, "vf_coeff")
        _check_nonneg(self, "kl_coeff")
        if self.vf_clip_param is not None:
            _check_positive(self, "vf_clip_param", fix="or null to turn value clipping off")
        net = self.network
        if not isinstance(net, NetworkConfig):
            raise ConfigError(f"network={_short_repr(net)} must be a NetworkConfig, e.g. "
                              "jaxppo.NetworkConfig(hidden_sizes=(64, 64)) (PPOConfig.from_dict "
                              "takes a mapping of its fields)")
        if not isinstance(net.shared_trunk, bool):
            raise ConfigError(f"network.shared_trunk={net.shared_trunk!r} must be true or false "
                              "(a YAML boolean, not a string)")
        if not isinstance(net.hidden_sizes, tuple) or not net.hidden_sizes or any(
                not _is_int(h) or h < 1 for h in net.hidden_sizes):
            raise ConfigError(
                f"network.hidden_sizes={_listed(net.hidden_sizes)} must be a non-empty list of "
                "positive layer widths, e.g. [64, 64]"
            )
        if net.activation not in ACTIVATIONS:
            raise ConfigError(
                f"network.activation={net.activation!r} is not one of {ACTIVATIONS}"
                f"{_did_you_mean(net.activation, ACTIVATIONS)}"
            )
        if net.torso not in TORSOS:
            raise ConfigError(
                f"network.torso={net.torso!r} is not one of {TORSOS}"
                f"{_did_you_mean(net.torso, TORSOS)}"
            )
        if (not isinstance(net.conv_channels, tuple) or not net.conv_channels
                or any(not _is_int(c) or c < 1 for c in net.conv_channels)
                or not _is_int(net.conv_kernel) or net.conv_kernel < 1):
            raise ConfigError(
                f"network.conv_channels={_listed(net.conv_channels)} / conv_kernel={net.conv_kernel!r} "
                "must be positive, e.g. conv_channels=[16], conv_kernel=3"
            )
        if not _is_int(net.conv_pool) or net.conv_pool < 1:
            raise ConfigError(
                f"network.conv_pool={net.conv_pool!r} must be an integer >= 1: the average-pool "
                "window after each conv layer (1 = no pooling, 2 halves each side)"
            )
        _check_std_options(net)
        v = net.recurrent_size
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(
                f"network.recurrent_size={v!r} must be an integer >= 0 (0 = feed-forward, "
                "e.g. 64 for a GRU of 64 units)")
        if not isinstance(self.transforms, (list, tuple)):
            raise ConfigError(
                f"transforms={self.transforms!r} must be a list, e.g. "
                "[{'frame_stack': {'k': 4}}, {'count_bonus': {'scale': 0.1}}]"
            )
        if not isinstance(self.env_kwargs, dict):
            raise ConfigError(f"env_kwargs={self.env_kwargs!r} must be a mapping of keyword arguments")
        _check_wandb(self.wandb)
        space.check_search(self)
        space.check_pbt(self)
        return self


# ---------------------------------------------------------------------- helpers
_INT_FIELDS = {
    "num_envs", "num_steps", "total_timesteps", "num_epochs", "num_minibatches", "seed",
    "num_seeds", "log_every", "num_devices", "checkpoint_every", "keep_checkpoints",
    "eval_every", "eval_episodes", "eval_max_steps",
}

# Names other PPO code uses for our fields (PureJaxRL, RLlib, CleanRL, SB3).
_ALIASES = {
    "learning_rate": "lr", "ent_coef": "entropy_coeff", "entropy_coef": "entropy_coeff",
    "vf_coef": "vf_coeff", "vf_loss_coeff": "vf_coeff", "clip_eps": "clip_param",
    "clip_range": "clip_param", "clip_coef": "clip_param", "lambda": "gae_lambda",
    "lambda_": "gae_lambda", "update_epochs": "num_epochs", "num_sgd_iter": "num_epochs",
    "n_epochs": "num_epochs", "n_steps": "num_steps", "rollout_fragment_length": "num_steps",
    "n_envs": "num_envs", "max_grad_norm_clip": "max_grad_norm", "grad_clip": "max_grad_norm",
    "anneal_lr": "lr_schedule", "env_name": "env", "env_id": "env", "env_config": "env_kwargs",
    "total_steps": "total_timesteps", "fcnet_hiddens": "network", "activation": "network",
}


def _yaml_loader():
    """PyYAML's SafeLoader with YAML 1.2 floats, so 3e-4 and 5e5 are numbers, not strings."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if isinstance(key, (str, int, float, bool)) and key in seen:
                    raise _DuplicateKey(
                        f"key {key!r} is given twice (lines {seen[key] + 1} and "
                        f"{key_node.start_mark.line + 1}); keep one")
                if isinstance(key, (str, int, float, bool)):
                    seen[key] = key_node.start_mark.line
            return super().construct_mapping(node, deep=deep)

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"""^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                    |[0-9][0-9_]*[eE][-+]?[0-9]+
                    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                    |\.(?:inf|Inf|INF)|[-+]\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", re.X),
        list("-+0123456789."),
    )
    return Loader


def read_config_file(path: str | Path) -> dict:
    """The mapping of field: value a YAML or JSON config file holds; ConfigError for a path
    that is not a readable file, malformed YAML/JSON, a key given twice, or a file whose
    aliases expand to more values than any config holds."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist; check the path")
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory; give the YAML or JSON "
                          "file itself (e.g. a run folder's config.yaml)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read as text: "
                          f"{getattr(e, 'strerror', None) or e}") from None
    if path.suffix == ".json":
        try:
            data = json.loads(text, object_pairs_hook=_unique_json_keys)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid JSON: {e.msg} at line "
                              f"{e.lineno}, column {e.colno}") from None
        except _DuplicateKey as e:
            raise ConfigError(f"config file {str(path)!r}: {e}") from None
        _check_size(data, f"config file {str(path)!r}")
    else:
        data = load_yaml(text, where=f"config file {str(path)!r}") or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of field: value")
    return data


# More values than any config holds: a file beyond this is refused before anything reads it
# through (aliases can make a few lines expand to billions of values).
MAX_CONFIG_VALUES = 100_000


def load_yaml(text: str, where: str = "the value"):
    """YAML (1.2 floats, safe tags only) -> Python values; ConfigError, naming `where` and
    the line, for malformed YAML, a key given twice, or an alias bomb."""
    import yaml

    try:
        data = yaml.load(text, Loader=_yaml_loader())
    except _DuplicateKey as e:
        raise ConfigError(f"{where}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where} is not valid YAML: {problem}{at}") from None
    _check_size(data, where)
    return data


def _check_size(data, where: str) -> None:
    """Count values through every alias, stopping at MAX_CONFIG_VALUES (time stays bounded)."""
    stack, seen = [data], 0
    while stack:
        v = stack.pop()
        seen += 1
        if seen > MAX_CONFIG_VALUES:
            raise ConfigError(f"{where} expands to more than {MAX_CONFIG_VALUES:,} values (YAML "
                              "aliases?); a config is a few dozen fields: write it out plainly")
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


class _DuplicateKey(Exception):
    pass


def _unique_json_keys(pairs):
    keys = [k for k, _ in pairs]
    dup = next((k for k in keys if keys.count(k) > 1), None)
    if dup is not None:
        raise _DuplicateKey(f"key {dup!r} is given twice in one JSON object; keep one")
    return dict(pairs)


def _suggest_field(key: str, names) -> str:
    alias = _ALIASES.get(str(key).lower())
    if alias is not None and alias in names:
        hint = f"; did you mean {alias!r}?"
        if alias == "network":
            hint = "; set it inside network, e.g. network.hidden_sizes=[64,64] or network.activation=tanh"
        if alias == "lr_schedule":
            hint = "; did you mean 'lr_schedule' (linear or constant)?"
        return hint
    return _did_you_mean(key, names)

def _did_you_mean(word: str, candidates, prefix: str = "") -> str:
    close = difflib.get_close_matches(str(word), list(candidates), n=3, cutoff=0.5)
    if not close:
        return ""
    return "; did you mean " + " or ".join(repr(prefix + c) for c in close) + "?"


def _check_std_options(net) -> None:
    if not isinstance(net.state_dependent_std, bool):
        raise ConfigError(
            f"network.state_dependent_std={net.state_dependent_std!r} must be true or false"
        )
    v = net.log_std_init
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if ok and net.state_dependent_std:
        ok = LOG_STD_MIN < v < LOG_STD_MAX
    if not ok:
        bounds = (f" strictly between {LOG_STD_MIN} and {LOG_STD_MAX} (the clip of a "
                  "state-dependent log std)" if net.state_dependent_std else "")
        raise ConfigError(
            f"network.log_std_init={v!r} must be a finite number{bounds}, e.g. -0.5 "
            "(initial std exp(-0.5) = 0.61)"
        )


WANDB_KEYS = ("project", "mode", "entity", "name", "dir", "group", "tags", "notes")
WANDB_MODES = ("online", "offline", "disabled")


def _check_wandb(value) -> None:
    """config.wandb: None, or a mapping of WANDB_KEYS with a project."""
    if value is None:
        return
    example = "e.g. wandb={'project': 'jaxppo', 'mode': 'offline'} (--set wandb.project=jaxppo)"
    if not isinstance(value, dict):
        raise ConfigError(f"wandb={value!r} must be a mapping of W&B settings or null, {example}")
    for key in value:
        if key not in WANDB_KEYS:
            raise ConfigError(
                f"unknown config key 'wandb.{key}'{_did_you_mean(str(key), WANDB_KEYS, 'wandb.')}; "
                f"valid keys: {', '.join('wandb.' + k for k in WANDB_KEYS)}")
    project = value.get("project")
    if not isinstance(project, str) or not project.strip():
        raise ConfigError(f"wandb.project={project!r} must be the name of a W&B project, {example}")
    mode = value.get("mode")
    if mode is not None and mode not in WANDB_MODES:
        raise ConfigError(
            f"wandb.mode={mode!r} is not one of {WANDB_MODES}{_did_you_mean(str(mode), WANDB_MODES)}"
            " (or leave it out: WANDB_MODE, else online); offline writes the run under "
            "wandb.dir for `wandb sync` later")
    for key in ("entity", "name", "dir", "group", "notes"):
        v = value.get(key)
        if v is not None and (not isinstance(v, str) or not v.strip()):
            raise ConfigError(f"wandb.{key}={v!r} must be a non-empty string (or left out)")
    tags = value.get("tags")
    if tags is not None and (not isinstance(tags, (list, tuple))
                             or not all(isinstance(t, str) and t for t in tags)):
        raise ConfigError(f"wandb.tags={tags!r} must be a list of strings, e.g. [baseline, cpu]")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def transforms_to_list(entries) -> list:
    """JSON/YAML-friendly form of a config's transforms: transform objects become their
    `to_config()` ({name: kwargs}, or their name), functions their name."""
    out = []
    for entry in entries or ():
        if hasattr(entry, "to_config"):
            out.append(entry.to_config())
        elif callable(entry) and not isinstance(entry, type):
            out.append(getattr(entry, "__name__", repr(entry)))
        elif isinstance(entry, tuple):
            out.append(list(entry))
        else:
            out.append(entry)
    return out


def require_config(value) -> "PPOConfig":
    """`value` if it is a PPOConfig; else a ConfigError saying how to make one of it."""
    if isinstance(value, PPOConfig):
        return value
    got = f"{type(value).__name__} {_short_repr(value)}"
    if isinstance(value, (str, Path)) and Path(value).suffix in (".yaml", ".yml", ".json"):
        fix = f"jaxppo.PPOConfig.from_file({str(value)!r})"
    elif isinstance(value, str):
        fix = f"jaxppo.PPOConfig(env={value!r}) (the library defaults)"
        if tuned_config_path(value) is not None:
            fix += f" or jaxppo.PPOConfig.tuned({value!r}) (the env's tuned settings)"
    elif isinstance(value, dict):
        fix = "jaxppo.PPOConfig.from_dict(values) or jaxppo.PPOConfig(**values)"
    elif value is not None and hasattr(value, "step") and hasattr(value, "reset"):
        fix = "jaxppo.PPOConfig(env=your_env, ...)"
    else:
        fix = "jaxppo.PPOConfig(env='CartPole-v1', ...) or jaxppo.PPOConfig.tuned('CartPole-v1')"
    raise ConfigError(f"the config must be a jaxppo.PPOConfig, got {got}; pass {fix}")


def _short_repr(x) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


_ENV_RECORDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def env_record(env, env_kwargs: dict | None = None) -> str | None:
    """How config.yaml can name `env` so that a new process rebuilds it: a string as given;
    for an env object, "module:Class" when Class is importable at that path (not __main__,
    not a local class) and `Class()` builds an object with the same attributes (so no
    constructor argument is lost) taking none of env_kwargs; None otherwise (then only the
    env's name can be recorded and loading the run needs env=)."""
    if isinstance(env, str):
        return env
    try:
        return _ENV_RECORDS[env]
    except (KeyError, TypeError):  # not seen yet, or not weak-referenceable
        pass
    path = _importable_path(env, env_kwargs or {})
    try:
        _ENV_RECORDS[env] = path
    except TypeError:
        pass
    return path


def _importable_path(env, env_kwargs: dict) -> str | None:
    import importlib
    import inspect

    cls = type(env)
    module, qualname = getattr(cls, "__module__", None), getattr(cls, "__qualname__", "")
    if not module or module in ("__main__", "builtins") or "<locals>" in qualname:
        return None
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        if obj is not cls:
            return None
        takes = inspect.signature(cls).parameters
        if any(k in takes for k in env_kwargs):  # rebuilding would pass them to Class()
            return None
        fresh = cls()
    except Exception:  # not importable there, or Class() needs arguments: record the name
        return None
    if not _same_attrs(getattr(env, "__dict__", {}), getattr(fresh, "__dict__", {})):
        return None
    return f"{module}:{qualname}"


def _same_attrs(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        try:
            eq = a[k] == b[k]
            if not (eq if isinstance(eq, bool) else bool(eq.all())):
                return False
        except Exception:
            return False
    return True


_NET_INT_FIELDS = ("conv_kernel", "conv_pool", "recurrent_size")
_BOOL_FIELDS = ("use_kl_loss", "normalize_advantages", "normalize_observations",
                "normalize_rewards", "eval_deterministic", "tensorboard")


def _plain(v):
    """A numpy or jax scalar (or 0-d array) as the Python number it holds; anything else as is."""
    if hasattr(v, "ndim") and hasattr(v, "item") and getattr(v, "ndim", None) == 0:
        return v.item()
    return v


def _whole(v):
    """A float with a whole value (YAML writes 5e5 as one) as an int; anything else as is."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# The largest float32: hyperparameters live in float32 inside the compiled program, where a
# larger value becomes inf (and training NaN at its first step).
FLOAT32_MAX = 3.4028234663852886e38


def _check_float32(name, v, example) -> None:
    if _is_number(v) and abs(v) > FLOAT32_MAX:
        raise ConfigError(f"{name}={v!r} is beyond the float32 range (about ±3.4e38) the "
                          f"compiled program computes in, where it would be inf; use e.g. {example}")


# Seeds become PRNG keys through a 64-bit integer.
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1


def check_seed(v, name: str) -> None:
    """ConfigError unless `v` is an integer a PRNG key can be made of (64-bit)."""
    if not isinstance(v, int) or isinstance(v, bool) or not SEED_MIN <= v <= SEED_MAX:
        raise ConfigError(f"{name}={v!r} must be an integer from -2**63 to 2**63 - 1 (it seeds "
                          "a 64-bit PRNG key), e.g. 0")


def _listed(v):
    """A list field's value for a message: as a list when it is one, else as given."""
    return list(v) if isinstance(v, (list, tuple)) else repr(v)


def _check_int(cfg, name, minimum):
    v = getattr(cfg, name)
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ConfigError(
            f"{name}={v!r} must be an integer >= {minimum}"
            + (", e.g. 4" if minimum >= 1 else "")
        )


def _check_positive(cfg, name, fix=""):
    v = getattr(cfg, name)
    _check_float32(name, v, "0.2")
    if not _is_number(v) or v <= 0:
        raise ConfigError(f"{name}={v!r} must be a positive number{(' ' + fix) if fix else ''}")


def _check_nonneg(cfg, name, float32=True):
    v = getattr(cfg, name)
    if float32:
        _check_float32(name, v, "0.5")
    if not _is_number(v) or v < 0:
        raise ConfigError(f"{name}={v!r} must be a number >= 0")


def _check_schedule(cfg, name, positive):
    v = getattr(cfg, name)
    bound = "> 0" if positive else ">= 0"
    ok = (lambda x: x > 0) if positive else (lambda x: x >= 0)
    _check_float32(name, v, f"{name}=2.5e-4")
    if _is_number(v):
        if not ok(v):
            raise ConfigError(f"{name}={v!r} must be {bound}, e.g. {name}=2.5e-4")
        return
    if isinstance(v, (list, tuple)) and v and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(_is_number(x) for x in p) for p in v
    ):
        for p in v:
            _check_float32(name, p[1], f"{name}=[[0, 3e-4], [1e6, 1e-5]]")
        steps = [p[0] for p in v]
        if steps != sorted(steps) or steps[0] < 0:
            raise ConfigError(
                f"{name}={v!r}: the env_step of each [env_step, value] point must be >= 0 "
                "and increasing"
            )
        if not all(ok(p[1]) for p in v):
            raise ConfigError(f"{name}={v!r}: every value must be {bound}")
        return
    raise ConfigError(
        f"{name}={v!r} must be a number or a piecewise schedule [[env_step, value], ...], "
        f"e.g. {name}=[[0, 3e-4], [1e6, 1e-5]]"
    )


def _refuse_unknown_fields(cls, prefix: str = "") -> None:
    """`cls(...)` and `config.replace(...)` with a keyword that is not a field: a ConfigError
    naming the nearest fields, as `from_dict` gives, instead of the dataclass's bare
    TypeError ("__init__() got an unexpected keyword argument")."""
    init = cls.__init__
    names = {f.name for f in dataclasses.fields(cls)}

    def __init__(self, *args, **kwargs):
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            key = unknown[0]
            hint = _did_you_mean(key, names, prefix) if prefix else _suggest_field(key, names)
            raise ConfigError(
                f"{cls.__name__} has no field {prefix + key!r}{hint}; fields: "
                f"{', '.join(prefix + n for n in sorted(names))}")
        init(self, *args, **kwargs)

    __init__.__doc__, __init__.__signature__ = init.__doc__, inspect.signature(init)
    __init__.__qualname__ = init.__qualname__
    cls.__init__ = __init__


_refuse_unknown_fields(PPOConfig)
_refuse_unknown_fields(NetworkConfig, "network.")
