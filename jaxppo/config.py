"""The one PPO configuration object: every field declared once, and the rules between fields.

Each field of `PPOConfig` and `NetworkConfig` is declared with `jaxppo.config_fields.field`:
its type, default, one-line meaning, check and role. The role says what a field is to the
compiled program:

* tunable (`TUNABLE_FIELDS`): a `HyperParams` leaf (jaxppo.core.hyperparams writes them out,
  in this order; a test holds them to these declarations), so a sweep is `jax.vmap` over a
  batch of them, a search draws them, and a resume may change them;
* shape (`LOCKED_FIELDS`): fixes shapes or the meaning of the saved state; changing one
  compiles a new program, so a resume keeps it and a search cannot vary it;
* run-time only: everything else (cadence, logging, devices, evaluation).

`validate` runs each field's declared check, then `_rules`; `jaxppo.resolve` calls it once per
run. `train --help` lists the fields' meanings from the same declarations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Sequence, Union

from jaxppo import config_fields as cf
from jaxppo.config_fields import (MAX_TIMESTEPS, SHAPE, TUNABLE, check_seed,  # noqa: F401
                                  did_you_mean, field, short_repr)
from jaxppo.config_files import (load_yaml, read_config_file, refuse_unknown_keys,
                                 refuse_unknown_keywords)
from jaxppo.envs.record import env_record, network_record
from jaxppo.errors import ConfigError, warn
from jaxppo.process import DEFAULT_CACHE_DIR
from jaxppo.search import space

# A schedule is a constant, or a piecewise-linear list of [env_step, value] points.
Schedule = Union[float, Sequence[Sequence[float]]]

ACTIVATIONS = ("tanh", "relu", "gelu", "silu", "elu")
TORSOS = ("auto", "mlp", "cnn", "nature_cnn", "impala_cnn")
SCHEDULE_KINDS = ("constant", "linear")
EXTEND_KINDS = ("new_total", "continue")
SYNC_KINDS = ("gradients", "batch")
CRITIC_INPUTS = ("local", "world_state", "joint_obs")
AGENT_PARAMS = ("shared", "per_agent", "per_group")
VECTORIZATION_MODES = ("sync", "async")
LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0  # bounds of a state-dependent log std

# Tuned configs shipped with the package: configs/<env>.yaml, named by the env's short name
# (`PPOConfig.env_name`: "Breakout-v5" for env "envpool:Breakout-v5").
TUNED_DIR = Path(__file__).resolve().parent / "configs"
# Prefixes of host-loop envs whose tuned config may be gymnax's of the same name.
_HOST_PREFIXES = ("gymnasium:", "envpool:")


def steps_in_python(env) -> bool:
    """True for an env that steps in Python, outside the compiled program (gymnasium and
    envpool: `jaxppo.run.hostloop` runs it)."""
    return isinstance(env, str) and env.startswith(_HOST_PREFIXES)


def tuned_config_path(env_name: str) -> Path | None:
    """The packaged tuned config of `env_name` (its short name, or for an envpool task or a
    JaxMARL env also "envpool:<task>", "jaxmarl:<name>"), or None when there is none."""
    path = TUNED_DIR / f"{env_name}.yaml"
    if path.is_file():
        return path
    prefix, _, task = env_name.partition(":")
    if prefix == "jaxmarl":  # "jaxmarl:overcooked:cramped_room": overcooked_cramped_room.yaml
        task = task.replace(":", "_")
    if prefix not in ("envpool", "jaxmarl") or not task or "/" in task or ":" in task:
        return None
    path = TUNED_DIR / f"{task}.yaml"
    return path if path.is_file() and read_config_file(path).get("env") == env_name else None


def tuned_env_names() -> list[str]:
    return sorted(p.stem for p in TUNED_DIR.glob("*.yaml"))


def tuned_envs() -> list[str]:
    """The envs the tuned configs are for, as `env` names them ("CartPole-v1",
    "envpool:Breakout-v5"), in the order of `tuned_env_names()`."""
    return [str(read_config_file(TUNED_DIR / f"{name}.yaml").get("env", name))
            for name in tuned_env_names()]


class TunedFamily(NamedTuple):
    """Envs that share one tuned config: a new run of any of them (from the CLI:
    jaxppo.envs.catalog.tuned_start says which envs under `prefix` belong) starts from `env`'s,
    and `PPOConfig.tuned`'s error for one of them points to it."""

    prefix: str  # the members' names start so
    env: str  # the env whose tuned config they share
    article: str
    noun: str  # what one member is: "Atari game"
    settings: str  # whose settings, for PPOConfig.tuned's error
    why: str  # why they fit, for the config line and `jaxppo envs`


TUNED_FAMILIES = (
    TunedFamily("envpool:", "envpool:Breakout-v5", "an", "Atari game",
                "CleanRL's settings for every game",
                "CleanRL's Atari settings, the same for every game"),
    TunedFamily("jaxmarl:smax:", "jaxmarl:smax:3m", "a", "SMAX map",
                "JaxMARL's IPPO settings for every map",
                "JaxMARL's IPPO settings for SMAX, the same for every map"),
)


def tuned_config_for(env: str) -> tuple[Path, str] | None:
    """(the tuned config a new run of `env` starts from, the env it was tuned on), or None.

    The env's own; for "gymnasium:<id>" and "envpool:<id>", gymnax's <id> when jaxppo ships
    one (gymnax's classic-control envs are gymnasium's and envpool's, same dynamics and time
    limits) and it sets no transforms (a config tuned with transforms stays the gymnax env's:
    it was not measured through the host loop's forms of them)."""
    path = tuned_config_path(env)
    if path is not None:
        return path, env
    prefix = next((p for p in _HOST_PREFIXES if env.startswith(p)), None)
    if prefix is None:
        return None
    name = env[len(prefix):]
    path = tuned_config_path(name) if name and ":" not in name else None
    if path is None:
        return None
    values = read_config_file(path)
    if values.get("transforms") or values.get("env", name) != name:
        return None
    return path, name


_KIND_HINT = "; for a piecewise schedule give a list of [env_step, value] points instead"
_LAST_STEP = ("the most env steps per seed the int32 step counter holds; use more seeds "
              "(num_seeds) or shorter runs")
_LAST_EVAL_STEP = ("the most steps the int32 step counter of an episode holds; use a smaller "
                   "bound (or null for the env's time limit)")


@dataclass(frozen=True)
class NetworkConfig:
    """Actor-critic network shape (every field is a shape: a resume keeps them all)."""

    hidden_sizes: tuple[int, ...] = field(
        (64, 64), "widths of the MLP layers (of each torso)", check=cf.positive_ints("e.g. [64, 64]"))
    activation: str = field("tanh", "tanh | relu | gelu | silu | elu", check=cf.one_of(ACTIVATIONS))
    shared_trunk: bool = field(False, "one torso for actor and critic, two heads", check=cf.boolean)
    torso: str = field(
        "auto", '"mlp", "cnn" (image observations), or "auto": cnn for [H, W, C] obs; '
        '"nature_cnn" / "impala_cnn": the fixed Atari-scale CNNs (pixels / 255)',
        check=cf.one_of(TORSOS))
    # conv_channels and conv_kernel are checked together (`_network_rules`)
    conv_channels: tuple[int, ...] = field((16,), "cnn torso: channels of each conv layer")
    conv_kernel: int = field(3, "cnn torso: kernel size")
    conv_pool: int = field(
        1, "cnn torso: average-pool window (and stride) after each conv; 1 = none",
        check=cf.integer(1, ": the average-pool window after each conv layer (1 = no pooling, "
                            "2 halves each side)"))
    recurrent_size: int = field(
        0, "0 = feed-forward; > 0 = a GRU core of this size",
        check=cf.integer(0, " (0 = feed-forward, e.g. 64 for a GRU of 64 units)"))
    # Continuous actions: the Gaussian's std is a learned vector shared by all states
    # (state_dependent_std False) or a head on the actor's features (True).
    log_std_init: float = field(0.0, "continuous actions: the Gaussian's initial log std",
                                check=cf.finite("e.g. -0.5 (initial std exp(-0.5) = 0.61)"))
    state_dependent_std: bool = field(False, "continuous actions: std from the actor's features",
                                      check=cf.boolean)
    head_sizes: tuple[int, ...] = field(
        (), "widths of the layers the policy head and the value head each have of their own, "
        "after the torso (and GRU); [] = none", check=cf.positive_ints("e.g. [128]", empty=True))
    # A user's own flax module replaces the built-in network, whose fields above must then
    # keep their defaults (contract: jaxppo.core.networks.CustomNetwork, docs/configuration.md).
    module: Any = field(None, 'your own flax module: "module:Class" (an object in Python); '
                        "null = the built-in network above", check=cf.network_module)
    kwargs: dict = field(factory=dict, doc='constructor arguments of a "module:Class" module',
                         check=cf.of_type(dict, "a mapping of the module's constructor arguments"))

    def __post_init__(self):
        cf.normalize(self)

    @property
    def custom(self) -> bool:
        """True when a user's module (`module`) is the network."""
        return self.module is not None


@dataclass(frozen=True)
class PPOConfig:
    """Everything a PPO run needs. Defaults are PureJaxRL's CartPole settings.

    Units: `total_timesteps`, schedule points and `env_steps` metrics count single env
    transitions summed over all envs (and seeds count separately: each seed gets the budget).
    The tunable fields are `HyperParams`' leaves in their order here, which checkpoints and
    sweep.json labels keep: add a tunable field after the others.
    """

    env: Any = field("CartPole-v1", "a gymnax-registered name, or an env object with the gymnax API",
                     role=SHAPE, section="environment")
    env_kwargs: dict = field(factory=dict, doc="env constructor args and env params", role=SHAPE,
                             check=cf.of_type(dict, "a mapping of keyword arguments"))
    env_params: Any = field(None, "gymnax EnvParams override; null = the env's defaults", role=SHAPE)
    # Invalid-action masking (discrete actions): an env that defines
    # `action_mask(state, params) -> bool [num_actions]` (Jumanji's envs with an `action_mask`
    # observation do) has its illegal actions' probabilities set to zero in the rollout, the
    # loss (log-prob, entropy, KL), evaluation, saved policies and exports.
    mask_actions: bool | None = field(
        None, "use the env's action mask: null = when the env has one, true = require one, "
        "false = ignore it", role=SHAPE, check=cf.optional(cf.boolean))
    num_envs: int = field(4, "parallel envs (global: split over devices and hosts)", role=SHAPE,
                          check=cf.integer(1), section="batch shape")
    num_steps: int = field(128, "rollout length per env per iteration", role=SHAPE,
                           check=cf.integer(1))
    total_timesteps: int = field(500_000, "env steps per seed (rounded down to whole batches)",
                                 check=cf.integer(1, most=(MAX_TIMESTEPS, _LAST_STEP)))
    num_epochs: int = field(4, "passes over each batch", check=cf.integer(1))
    num_minibatches: int = field(4, "minibatches per epoch", check=cf.integer(1))
    # The other way to size minibatches (SB3's batch_size, RLlib's minibatch_size): resolve()
    # turns it into num_minibatches, which the rest of the package reads.
    minibatch_size: int | None = field(
        None, "transitions per minibatch, instead of num_minibatches; null = use num_minibatches",
        check=cf.optional(cf.integer(1, ", e.g. 256 (or null to use num_minibatches)")))
    lr: Schedule = field(2.5e-4, "a number, or [[env_step, value], ...] (piecewise linear)",
                         role=TUNABLE, leaf="lr_points", kind="lr_schedule",
                         check=cf.schedule(positive=True), section="schedules (of the env-step count)")
    lr_schedule: str = field('linear', '"constant" | "linear" (anneal to 0); ignored for a list',
                             check=cf.one_of(SCHEDULE_KINDS, _KIND_HINT))
    entropy_coeff: Schedule = field(0.01, "a number or a schedule, as lr", role=TUNABLE,
                                    leaf="entropy_points", kind="entropy_schedule",
                                    check=cf.schedule(positive=False))
    entropy_schedule: str = field("constant", '"constant" | "linear"; ignored for a list',
                                  check=cf.one_of(SCHEDULE_KINDS, _KIND_HINT))
    # What a resume that changes total_timesteps does to the schedules (jaxppo.run.schedules).
    schedule_on_extend: str = field(
        "new_total", 'a resume that changes total_timesteps: "new_total" = a linear schedule '
        'anneals over the new total, as in a run started with it; "continue" = from its value '
        "at the checkpoint",
        check=cf.one_of(EXTEND_KINDS, ": 'new_total' anneals over the new total as a run "
                        "started with it would, 'continue' goes on from the checkpoint's values"))
    clip_param: float = field(0.2, "PPO's ratio clip epsilon", role=TUNABLE, check=cf.positive(),
                              section="loss")
    # Value-loss clipping around the acting value, as PureJaxRL (CLIP_EPS) and RLlib do;
    # None = unclipped. At PureJaxRL's CartPole config it keeps late training stable.
    vf_clip_param: float | None = field(
        0.2, "clip of the value change; null = unclipped", role=TUNABLE,
        check=cf.optional(cf.positive("or null to turn value clipping off")))
    vf_coeff: float = field(0.5, "weight of the value loss", role=TUNABLE, check=cf.nonnegative())
    use_kl_loss: bool = field(False, "add an adaptive KL(old||new) penalty (RLlib's)",
                              check=cf.boolean)
    # the initial value: the adapted one lives in TrainState
    kl_coeff: float = field(0.2, "initial coefficient of the KL penalty", role=TUNABLE,
                            check=cf.nonnegative())
    kl_target: float = field(0.01, "the KL the coefficient adapts towards", role=TUNABLE,
                             check=cf.positive())
    # Early stopping of an iteration's updates on the KL, as CleanRL's and SB3's target_kl.
    kl_early_stop: float | None = field(
        None, "end the iteration's gradient steps at the first minibatch whose approx KL "
        "(old || current policy) exceeds this (CleanRL's and SB3's target_kl); null = never",
        check=cf.optional(cf.positive("or null for every epoch's every step")))
    normalize_advantages: bool = field(True, "standardise advantages (over normalize_advantages_over)",
                                       check=cf.boolean)
    normalize_advantages_over: str = field(
        "batch", '"batch": one mean and std over the iteration\'s whole batch; "minibatch": each '
        "minibatch's own, as CleanRL, PureJaxRL, SB3 and JaxMARL standardise them",
        check=cf.one_of(("batch", "minibatch")))
    bootstrap_truncation: bool = field(
        True, "an episode cut by a time limit (truncated) bootstraps from the value of the "
        "state it reached; false: every end is terminal (no bootstrap), as PureJaxRL, CleanRL "
        "and JaxMARL's baselines treat them", check=cf.boolean)
    adam_eps: float = field(1e-5, "Adam epsilon", check=cf.positive(), section="optimiser")
    max_grad_norm: float = field(0.5, "global-norm gradient clipping", role=TUNABLE,
                                 check=cf.positive())
    max_grad_norm_over: str = field(
        "all", '"all": one global norm over every parameter; "each_network": the actor\'s and '
        "the critic's parameters each clipped by a global norm of their own, as separate "
        "optimisers for actor and critic do (JaxMARL's MAPPO, Stoix); for built-in networks "
        "whose actor and critic share no layer",
        check=cf.one_of(("all", "each_network")))
    # The critic's own step size, as separate optimisers for actor and critic have (Stoix,
    # Mava, MAPPO; RLlib's old _lr_vf). Its HyperParams leaf holds null as lr's points with
    # the value -1: a negative value means "lr" (jaxppo.core.ppo.critic_lr_at).
    critic_lr: Schedule | None = field(
        None, "the critic's learning rate: a number (its schedule lr_schedule's form) or "
        "[[env_step, value], ...] points; null = lr. For built-in networks whose actor and "
        "critic share no layer", role=TUNABLE, leaf="critic_lr_points", kind="lr_schedule",
        check=cf.optional(cf.schedule(positive=True)))
    gamma: float = field(0.99, "discount", role=TUNABLE, check=cf.unit_interval, section="returns")
    gae_lambda: float = field(0.95, "GAE lambda", role=TUNABLE, check=cf.unit_interval)
    normalize_observations: bool = field(False, "running mean/std of observations",
                                         check=cf.boolean, section="normalisation")
    normalize_rewards: bool = field(False, "scale rewards by the std of the discounted return",
                                    check=cf.boolean)
    network: NetworkConfig = field(
        factory=NetworkConfig, doc="the actor-critic network (network.* keys)", role=SHAPE,
        check=cf.of_type(NetworkConfig, "a NetworkConfig, e.g. jaxppo.NetworkConfig(hidden_sizes="
                         "(64, 64)) (PPOConfig.from_dict takes a mapping of its fields)"))
    # User transforms (jaxppo.envs.transforms), e.g.
    # [{"frame_stack": {"k": 4}}, {"count_bonus": {"scale": 0.1}}]
    transforms: tuple = field(
        (), "observation wrappers and reward hooks, in order", role=SHAPE, section="user transforms",
        check=cf.of_type((list, tuple), "a list, e.g. [{'frame_stack': {'k': 4}}, "
                         "{'count_bonus': {'scale': 0.1}}]"))
    # Multi-agent envs (JaxMARL): what the critic sees. "local" is IPPO (each agent's own
    # observation); "world_state" and "joint_obs" are MAPPO's centralised critic, the actor
    # still acting on the agent's own observation (docs/environments.md, Multi-agent).
    critic_input: str = field(
        "local", 'multi-agent envs: the critic\'s input; "local" = the agent\'s own observation '
        '(IPPO), "world_state" = the env\'s global state (MAPPO), "joint_obs" = every agent\'s '
        "observation, concatenated (MAPPO)", role=SHAPE, section="multi-agent envs",
        check=cf.one_of(CRITIC_INPUTS, ": 'local' is IPPO's critic, 'world_state' and "
                        "'joint_obs' MAPPO's centralised one"))
    agent_id: bool = field(
        False, "multi-agent envs: append a one-hot of the agent's index to its observation "
        "(the actor's and a local critic's input)", role=SHAPE, check=cf.boolean)
    critic_agent_id: bool = field(
        False, "multi-agent envs with a centralised critic (critic_input world_state or "
        "joint_obs): append a one-hot of the agent's index to the critic's input, as "
        "JaxMARL's MAPPO does to its world state", role=SHAPE, check=cf.boolean)
    agent_params: str | dict = field(
        "shared", 'multi-agent envs: "shared" = one network for every agent (IPPO\'s parameter '
        'sharing), "per_agent" = a network of its own for each agent (params with a leading '
        'agent axis, one optimizer over all), "per_group" = one for each group of agents whose '
        "names differ only in their trailing _<index> (MPE's adversary_* and agent_*), or "
        "{group: [agent, ...]} = one for each group named, every agent in one",
        role=SHAPE, check=lambda name, v: _check_agent_params(name, v))
    num_devices: int | str | None = field(
        "auto", '"auto" = seeds, PBT members or many envs over every device (a CPU: one per '
        'core), as pays; N = the envs (PBT: members) over N devices',
        check=lambda name, v: _check_devices(name, v), section="devices")
    # How shards (devices, hosts) combine: "gradients" all-reduces every minibatch's gradient
    # (the update's compute is split); "batch" all-gathers the rollout once per iteration and
    # every shard runs the whole update (one collective per iteration instead of one per
    # minibatch: for small networks where collectives are slow, e.g. CPU hosts).
    sync: str = field("gradients", '"gradients" (per minibatch) | "batch" (per iteration)',
                      check=cf.one_of(SYNC_KINDS, ": 'gradients' all-reduces each minibatch's "
                                      "gradient, 'batch' all-gathers the rollout once per iteration"))
    # Envs that step in Python (env="gymnasium:<id>"): act then learn in one thread (the host
    # loop, jaxppo.run.hostloop), or actor threads acting while the learner learns
    # (jaxppo.run.actorlearner), with params at most max_policy_lag updates old.
    max_policy_lag: int = field(
        0, "envs stepped in Python: updates the acting params may trail the learning ones; 0 = "
        "act, then learn (the host loop); >= 1 = actor threads act while the learner learns",
        check=cf.integer(0, " (0 = the synchronous host loop, e.g. 1 = actors at most one "
                         "update behind)"), section="envs stepped in Python")
    actor_threads: int | None = field(
        None, "max_policy_lag >= 1: actor threads (on each host), each stepping num_envs / "
        "(hosts x actor_threads) envs; null = from the machine's cores (one left to the learner)",
        check=cf.optional(cf.integer(1, ", e.g. 2 (or null: chosen from the cores)")))
    rollout_timeout: float | None = field(
        None, "max_policy_lag >= 1: seconds the learner waits for an actor's rollout before "
        "stopping with an error; null = 60 s or 10x the slowest rollout so far",
        check=cf.optional(cf.positive("(seconds), e.g. 120, or null")))
    gymnasium_vectorization: str = field(
        "sync", 'a gymnasium env\'s vector env: "sync" (its envs step one after another in this '
        'process) | "async" (a subprocess per env)',
        check=cf.one_of(VECTORIZATION_MODES, ": 'sync' steps the envs in this process, 'async' "
                        "each in a subprocess of its own"))
    seed: int = field(0, "seed of the run (seed i of num_seeds derives from it)", role=SHAPE,
                      check=cf.seed, section="run")
    num_seeds: int = field(1, "seeds trained together in one vmapped program", role=SHAPE,
                           check=cf.integer(1))
    log_every: int = field(0, "iterations per compiled chunk between progress updates; 0 = auto "
                           "(about 40 chunks per run; every iteration for an env that steps in "
                           "Python)", check=cf.integer(0))
    compilation_cache_dir: str | None = field(DEFAULT_CACHE_DIR, "null disables the cache; the "
                                              "default gives way to JAX_COMPILATION_CACHE_DIR",
                                              check=cf.folder_or_null, machine_path=True)
    checkpoint_every: int = field(
        0, "iterations between checkpoints in RUN_DIR/checkpoints; 0 = none by count",
        check=cf.integer(0), section="run lifecycle")
    # Minutes of training between checkpoints (at the end of the chunk that passes the mark),
    # so a long run keeps recent state whatever checkpoint_every says. A run always
    # checkpoints at its end and when stopped by SIGINT/SIGTERM.
    checkpoint_minutes: float = field(5.0, "minutes between checkpoints; 0 = none by time",
                                      check=cf.nonnegative(float32=False))
    keep_checkpoints: int = field(3, "newest checkpoints kept; older ones are deleted after a save",
                                  check=cf.integer(1))
    eval_every: int = field(
        0, "iterations between evaluations (and at the last one); 0 = no evaluation",
        check=cf.integer(0))
    eval_episodes: int = field(8, "eval envs, each runs one full episode per evaluation",
                               check=cf.integer(1))
    eval_deterministic: bool = field(True, "act with the policy's mode rather than sampling",
                                     check=cf.boolean)
    eval_max_steps: int | None = field(
        None, "bound on an eval episode; null = env's max_steps_in_episode",
        check=cf.optional(cf.integer(1, most=(MAX_TIMESTEPS, _LAST_EVAL_STEP))))
    # Early stopping, decided between chunks (the mean over seeds; see docs/runs.md). A run
    # with eval_every keeps its best-evaluated params in RUN_DIR/best/ either way.
    stop_at_return: float | None = field(
        None, "stop once the return reaches this (the eval return with eval_every, else the "
        "training return; mean over seeds); null = never",
        check=cf.optional(cf.finite("e.g. 475 (or null to never stop on the return)")))
    stop_after_no_improvement: int = field(
        0, "stop after this many evaluations without a better eval return; 0 = never",
        check=cf.integer(0, " (evaluations without a better eval return; 0 = never stop on it)"))
    tensorboard: bool = field(False, "also write TensorBoard event files to RUN_DIR/tensorboard",
                              check=cf.boolean)
    # Weights & Biases: {project: ..., mode: online|offline|disabled, entity, name, dir, group,
    # tags, notes} (only project is needed; mode defaults to WANDB_MODE, else online). Logging
    # only: it changes neither the compiled program nor what a resume may change.
    wandb: dict | None = field(None, "W&B logging, e.g. {project: jaxppo, mode: offline}; null = off",
                               check=cf.wandb_settings, machine_path="dir")
    # Distributions over tunable fields, drawn once per member of the vmapped population, e.g.
    # {population: 8, lr: {loguniform: [1e-4, 1e-2]}, gamma: {choice: [0.99, 0.995]}};
    # population = settings (num_seeds follows it when left at 1), each num_seeds/population
    # seeds (jaxppo.search.space).
    search: dict | None = field(None, "hyperparameter search over the members; null = off",
                                section="hyperparameter search and population-based training")
    # Population-based training inside the compiled program: every `interval` iterations the
    # worst `fraction` of members copy a best member's learner state and perturb (x `perturb`)
    # or redraw (`resample_probability`) the searched fields; ranked by `fitness` ("return" |
    # "eval"). Needs `search`.
    pbt: dict | None = field(None, "e.g. {interval: 10, fraction: 0.25}; null = off")

    def __post_init__(self):
        if cf.is_flax_module(self.network):  # PPOConfig(network=MyActorCritic(...))
            object.__setattr__(self, "network", NetworkConfig(module=self.network))
        cf.normalize(self)
        # A search that names its population trains that many members unless num_seeds
        # says more (seeds of each setting).
        settings = self.search.get("population") if isinstance(self.search, dict) else None
        if self.num_seeds == 1 and cf.is_int(settings) and settings > 1:
            object.__setattr__(self, "num_seeds", settings)

    # ------------------------------------------------------------------ derived sizes
    @property
    def batch_size(self) -> int:
        """Transitions per iteration (one seed): num_envs * num_steps."""
        return self.num_envs * self.num_steps

    @property
    def num_iterations(self) -> int:
        return self.total_timesteps // self.batch_size

    @property
    def env_name(self) -> str:
        """A short readable name of the env (run folder names, labels): the registered name,
        "brax-<name>" for "brax:<name>" (no ':' in folder names), an envpool task's or a
        gymnasium id's namespace joined by '-' ("ALE-Pong-v5" for "gymnasium:ALE/Pong-v5": no
        nested folder), "<suite>_<name>" for "jaxmarl:<suite>:<name>"
        ("overcooked_cramped_room"), the class of a "module:Class" env, or an env object's
        `name` (else its class name)."""
        if isinstance(self.env, str):
            if self.env.startswith("brax:"):  # "brax-halfcheetah": the suite stays in the name
                return "brax-" + self.env[len("brax:"):]
            if self.env.startswith("envpool:"):
                return self.env[len("envpool:"):].replace("/", "-") or self.env
            if self.env.startswith("jaxmarl:") and self.env.count(":") > 1:
                return self.env[len("jaxmarl:"):].replace(":", "_")  # "smax_3m"
            if self.env.startswith("gymnasium:"):  # its module:id form names the id last
                return self.env.rpartition(":")[2].replace("/", "-") or self.env
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
                f"{type(values).__name__} {short_repr(values)}; e.g. "
                "PPOConfig.from_dict({'env': 'CartPole-v1', 'lr': 3e-4}) (a file: "
                "PPOConfig.from_file(path); key=value strings: config.with_overrides([...]))")
        if base is not None and not isinstance(base, PPOConfig):
            raise ConfigError(f"base={short_repr(base)} must be a PPOConfig (or None for the "
                              "defaults)")
        base = base if base is not None else cls()
        values = dict(values)
        refuse_unknown_keys(values, cls)
        _one_minibatch_setting(values)
        if "network" in values:
            net = values["network"]
            if isinstance(net, dict):
                refuse_unknown_keys(net, NetworkConfig, "network.")
                # a module replaces the built-in network: the base's shape of it is not kept
                start = NetworkConfig() if net.get("module") is not None else base.network
                values["network"] = dataclasses.replace(start, **net)
            elif not isinstance(net, NetworkConfig) and not cf.is_flax_module(net):
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
                              f"{type(path).__name__} {short_repr(path)}")
        return cls.from_dict(read_config_file(path), base)

    @classmethod
    def tuned(cls, env: str, **overrides) -> "PPOConfig":
        """The packaged tuned config of `env` (see `tuned_env_names()`), with `overrides`
        (field=value; `network` takes a mapping of its fields) on top."""
        path = tuned_config_path(env) if isinstance(env, str) else None
        if path is None:
            names = tuned_env_names()
            family = next((f for f in TUNED_FAMILIES if isinstance(env, str)
                           and env.startswith(f.prefix)), None)
            hint = (f"; for {family.article} {family.noun}, {family.settings}: PPOConfig.tuned("
                    f"{family.env!r}).replace(env={env!r})" if family else "")
            raise ConfigError(
                f"no tuned config for env={env!r}{did_you_mean(str(env), names)}; tuned "
                f"configs exist for {', '.join(names)}. For another env start from "
                f"PPOConfig(env={env!r}, ...){hint}")
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

    def machine_paths_from(self, source: str, given: Sequence[str] = (),
                           say: bool = True) -> "PPOConfig":
        """This config (read from `source`: a run folder's config.yaml, a file you did not
        write) with the paths it names on this machine (fields declared `machine_path`: the
        compilation cache, W&B's dir) back at their defaults (null, which turns one off, is
        kept), each with a warning; JAX would
        also load compiled code from the cache. Keys in `given` (set by the user: --set)
        are kept; `say=False`: no warning (a policy's load, which uses neither)."""
        default = PPOConfig()
        changes = {}
        for f in dataclasses.fields(self):
            where, value = cf.spec(f).machine_path, getattr(self, f.name)
            if not where or f.name in given:
                continue
            if where is True and value is not None and value != getattr(default, f.name):
                changes[f.name] = getattr(default, f.name)
                what = f"{f.name}={value!r}"
            elif isinstance(where, str) and isinstance(value, dict) and where in value \
                    and f"{f.name}.{where}" not in given:
                changes[f.name] = {k: v for k, v in value.items() if k != where}
                what = f"{f.name}.{where}={value[where]!r}"
            else:
                continue
            if say:
                warn(f"{source} sets {what}, a path of this machine, which a config from a run "
                     "folder (or a file under --no-imports) does not choose: not used (the "
                     f"default instead); to use it, give it with --set {what.split('=')[0]}=... "
                     "(from Python: pass the config)")
        return self.replace(**changes) if changes else self

    def to_dict(self) -> dict:
        """A JSON-friendly dict that `from_dict` reads back. An env object becomes
        "module:Class" when that rebuilds it (`env_record`), else its name."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "network":
                v = {n.name: list(x) if isinstance(x, tuple) else x
                     for n in dataclasses.fields(v) for x in [getattr(v, n.name)]}
                if v["module"] is not None and not isinstance(v["module"], str):
                    v["module"], v["kwargs"] = network_record(v["module"])
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

    def validate(self) -> "PPOConfig":
        """Raise ConfigError for the first impossible value; return self so calls chain.

        Each field's declared check, then the rules between fields (`_rules`). What needs the
        env, the transforms or the devices (the env name, the network's torso, minibatches
        over the envs of each device, an evaluation bound) is checked by
        `jaxppo.resolve(config)`, which calls this once per run.
        """
        cf.check_declared(self)
        _rules(self)
        return self


# ---------------------------------------------------------------------- derived from the fields
TUNABLE_FIELDS = cf.names_with(PPOConfig, TUNABLE)  # HyperParams' leaves, in this order
LOCKED_FIELDS = cf.names_with(PPOConfig, SHAPE)  # a resumed run keeps these
_SPECS = {f.name: cf.spec(f) for f in dataclasses.fields(PPOConfig)}
# HyperParams leaf -> the tunable field it holds ("lr_points" -> "lr")
HYPERPARAM_LEAVES = {_SPECS[n].leaf or n: n for n in TUNABLE_FIELDS}
# schedule field -> the field giving its form ("lr" -> "lr_schedule"); a sweep sets both
SCHEDULES = {n: _SPECS[n].kind for n in TUNABLE_FIELDS if _SPECS[n].kind}
# What a sweep's hyperparameters override: a sweep folder's config.yaml values of these are
# not what its members trained with.
SWEPT_FIELDS = frozenset(TUNABLE_FIELDS) | frozenset(SCHEDULES.values())


def own_critic_lr(config) -> bool:
    """Whether the critic steps with a learning rate of its own: `critic_lr` set, or searched
    (each member's value then comes from the search)."""
    return config.critic_lr is not None or "critic_lr" in (config.search or {})


def is_auto_devices(value) -> bool:
    """num_devices "auto" (null, as run folders written before "auto" existed hold, means
    the same)."""
    return value is None or value == "auto"


def _check_agent_params(name: str, v) -> None:
    """One of AGENT_PARAMS, or groups of agents by name: {group: [agent, ...]} (checked
    against the env's agents when the run is resolved)."""
    if isinstance(v, Mapping):
        bad = [g for g, members in v.items()
               if not isinstance(g, str) or not isinstance(members, (list, tuple)) or not members
               or not all(isinstance(m, str) for m in members)]
        if not v or bad:
            raise ConfigError(
                f"{name}={v!r}: groups of agents are a mapping of group names to non-empty "
                "lists of agent names, e.g. {predators: [adversary_0, adversary_1], prey: "
                f"[agent_0]}}{f' ({bad[0]!r} is not)' if bad else ''}")
        return
    cf.one_of(AGENT_PARAMS, ": 'shared' is one network for every agent, 'per_agent' one "
              "network each, 'per_group' one for each group of agents named alike, or a "
              "mapping {group: [agent, ...]}")(name, v)


def _check_devices(name: str, v) -> None:
    if is_auto_devices(v):
        return
    if isinstance(v, str):
        raise ConfigError(f"{name}={v!r} must be \"auto\" (jaxppo picks the layout) or an "
                          "integer >= 1, e.g. 2 (the envs split over 2 devices)")
    cf.integer(1, ", e.g. 2, or \"auto\"")(name, v)


def check_fields(config: PPOConfig, names) -> None:
    """The declared checks of `names` only (what a caller reads, e.g. HyperParams.from_config),
    not the whole config's validation."""
    cf.check_declared(config, names=frozenset(names))


def _rules(config: PPOConfig) -> None:
    """The rules between fields (each field's own bounds are in its declaration)."""
    if config.total_timesteps < config.batch_size:
        raise ConfigError(
            f"total_timesteps={config.total_timesteps} is smaller than one iteration "
            f"(num_envs*num_steps = {config.batch_size}); raise total_timesteps to at least "
            f"{config.batch_size} or lower num_envs/num_steps")
    if config.stop_after_no_improvement and not config.eval_every:
        raise ConfigError(
            f"stop_after_no_improvement={config.stop_after_no_improvement} counts evaluations, "
            "but eval_every=0 (no evaluation); set eval_every (e.g. eval_every=10) or "
            "stop_after_no_improvement=0")
    _minibatch_rules(config)
    _network_rules(config.network)
    space.check_search(config, {n: _SPECS[n].check for n in TUNABLE_FIELDS})
    space.check_pbt(config)


NUM_MINIBATCHES_DEFAULT = PPOConfig.__dataclass_fields__["num_minibatches"].default


def _one_minibatch_setting(values: dict) -> None:
    """Layered values (a file, --set pairs on a config) size minibatches one way: a
    minibatch_size given alone replaces the base's num_minibatches, a num_minibatches given
    alone the base's minibatch_size; both in one mapping are refused, unless num_minibatches
    is its default (as `to_dict` writes a config sized by minibatch_size)."""
    if values.get("minibatch_size") is not None:
        if values.get("num_minibatches", NUM_MINIBATCHES_DEFAULT) != NUM_MINIBATCHES_DEFAULT:
            raise ConfigError(
                f"minibatch_size={values['minibatch_size']!r} and num_minibatches="
                f"{values['num_minibatches']!r} are both given; they are two ways to size the "
                "same minibatches: keep one (num_minibatches = num_envs*num_steps / "
                "minibatch_size)")
        values["num_minibatches"] = NUM_MINIBATCHES_DEFAULT
    elif "num_minibatches" in values:
        values.setdefault("minibatch_size", None)


def _minibatch_rules(config: PPOConfig) -> None:
    """A minibatch_size replaces num_minibatches (left at its default) and cuts the batch of
    num_envs*num_steps transitions into whole minibatches, as num_minibatches would: of
    whole rollout steps (num_steps / minibatches), or of whole env sequences for a recurrent
    network (num_envs / minibatches)."""
    size = config.minibatch_size
    if size is None:
        return
    if config.num_minibatches != NUM_MINIBATCHES_DEFAULT:
        raise ConfigError(
            f"minibatch_size={size} and num_minibatches={config.num_minibatches} are both set; "
            "they are two ways to size the same minibatches: keep one (minibatch_size=None, or "
            f"num_minibatches at its default {NUM_MINIBATCHES_DEFAULT}, which minibatch_size "
            "then replaces)")
    batch = config.batch_size
    recurrent = bool(config.network.recurrent_size)
    cut = config.num_envs if recurrent else config.num_steps
    if batch % size == 0 and cut % (batch // size) == 0:
        return
    sizes = sorted(batch // d for d in divisors(cut))
    near = sorted(sorted(sizes, key=lambda m: abs(m - size))[:5])
    what = "whole env sequences (num_envs" if recurrent else "whole rollout steps (num_steps"
    batch_text = (f"the batch of num_envs*num_steps = {config.num_envs}*{config.num_steps} = "
                  f"{batch} transitions")
    problem = (f"is larger than {batch_text}" if size > batch else
               f"does not cut {batch_text} into minibatches of {what}={cut} must be a "
               "multiple of the number of minibatches)")
    raise ConfigError(f"minibatch_size={size} {problem}; choose one of {near} or change "
                      "num_envs/num_steps")


def _network_rules(net: NetworkConfig) -> None:
    """The CNN's channels and kernel (one message names both), a user's module given alone
    (no built-in field changed, kwargs only for "module:Class"), and a state-dependent log
    std's start inside the clip the network applies."""
    if (not isinstance(net.conv_channels, tuple) or not net.conv_channels
            or any(not cf.is_int(c) or c < 1 for c in net.conv_channels)
            or not cf.is_int(net.conv_kernel) or net.conv_kernel < 1):
        raise ConfigError(
            f"network.conv_channels={cf.listed(net.conv_channels)} / conv_kernel="
            f"{net.conv_kernel!r} must be positive, e.g. conv_channels=[16], conv_kernel=3")
    if net.custom:
        default = NetworkConfig()
        given = [f"network.{f.name}={cf.listed(getattr(net, f.name))}"
                 for f in dataclasses.fields(net) if f.name not in ("module", "kwargs")
                 and getattr(net, f.name) != getattr(default, f.name)]
        if given:
            raise ConfigError(
                f"{', '.join(given)} {'shape' if len(given) > 1 else 'shapes'} the built-in "
                f"network, but network.module={cf.short_repr(net.module)} replaces it; remove "
                f"{'them' if len(given) > 1 else 'it'} (your module's own arguments go in "
                "network.kwargs)")
    if net.kwargs and not isinstance(net.module, str):
        raise ConfigError(
            f"network.kwargs={cf.short_repr(net.kwargs)} are constructor arguments of a "
            '"module:Class" network.module, but network.module is '
            f"{cf.short_repr(net.module)}; build the module object with them yourself, or name "
            'its class as network.module="my_pkg.nets:ActorCritic"')
    v = net.log_std_init
    if net.state_dependent_std and not LOG_STD_MIN < v < LOG_STD_MAX:
        raise ConfigError(
            f"network.log_std_init={v!r} must be a finite number strictly between {LOG_STD_MIN} "
            f"and {LOG_STD_MAX} (the clip of a state-dependent log std), e.g. -0.5 (initial std "
            "exp(-0.5) = 0.61)")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# How config.yaml records a reward hook given as a Python function (by its name only).
FUNCTION_HOOK = "reward_hook_function"


def is_function_hook(entry) -> bool:
    """Whether a transforms entry is config.yaml's record of a reward hook given as a function."""
    return isinstance(entry, dict) and set(entry) == {FUNCTION_HOOK}


def function_hooks(entries) -> list[str]:
    """The names of the reward hooks in a config's transforms that are Python functions."""
    return [e[FUNCTION_HOOK] for e in transforms_to_list(entries) if is_function_hook(e)]


def transforms_to_list(entries) -> list:
    """JSON/YAML-friendly form of a config's transforms: transform objects become their
    `to_config()` ({name: kwargs}, or their name), a reward hook written as a function
    {FUNCTION_HOOK: its name} (a record of it that no file can turn back into code)."""
    out = []
    for entry in entries or ():
        if hasattr(entry, "to_config"):
            out.append(entry.to_config())
        elif callable(entry) and not isinstance(entry, type):
            out.append({FUNCTION_HOOK: getattr(entry, "__name__", repr(entry))})
        elif isinstance(entry, tuple):
            out.append(list(entry))
        else:
            out.append(entry)
    return out


def require_config(value) -> "PPOConfig":
    """`value` if it is a PPOConfig; else a ConfigError saying how to make one of it."""
    if isinstance(value, PPOConfig):
        return value
    got = f"{type(value).__name__} {short_repr(value)}"
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


refuse_unknown_keywords(PPOConfig)
refuse_unknown_keywords(NetworkConfig, "network.")
