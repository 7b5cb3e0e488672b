"""jaxppo: PPO compiled end to end with JAX.

    import jaxppo
    result = jaxppo.train(jaxppo.PPOConfig.tuned("CartPole-v1", num_seeds=8))

Single-host training never imports Ray; `jaxppo.distributed` does, on demand.

`import jaxppo` sets JAX's CPU device count for the whole process: on a CPU host, one device
per core (so `jax.devices()` lists as many for any JAX code in the process), which lets seeds
and PBT members train on every core (about 2x for 16 seeds on 2 cores). It is left alone
when JAX code ran before the import, when XLA_FLAGS or jax_num_cpu_devices set the count,
off the CPU, and with JAXPPO_CPU_DEVICES=1 (N: N devices) in the environment.
`jaxppo.cpu_devices.describe()` says what it did; a run's layout line says when it trains on
these devices.
"""

import jaxppo.cpu_devices  # noqa: F401  (first: before anything starts JAX's backend)
from jaxppo.core.algorithm import Algorithm, TrainState
from jaxppo.core.hyperparams import HyperParams
from jaxppo.config import NetworkConfig, PPOConfig, tuned_env_names
from jaxppo.errors import (ActionMaskError, CheckpointError, ConfigError, ExportError,
                           RolloutTimeoutError, RunFolderError, StopTraining,
                           TrainingDivergedError, TrainingInterrupted, VideoError)
from jaxppo.run.export import export_policy
from jaxppo.run.result import TrainResult
from jaxppo.run.policy import Policy, evaluate_policies, load_policies, load_policy
from jaxppo.program.resolved import Resolved, resolve
from jaxppo.process import __version__
from jaxppo.run.train import make_train, train

__all__ = [
    "PPOConfig",
    "NetworkConfig",
    "HyperParams",
    "TrainState",
    "TrainResult",
    "Algorithm",
    "Resolved",
    "resolve",
    "tuned_env_names",
    "ConfigError",
    "TrainingDivergedError",
    "ActionMaskError",
    "TrainingInterrupted",
    "StopTraining",
    "CheckpointError",
    "RunFolderError",
    "RolloutTimeoutError",
    "ExportError",
    "VideoError",
    "Policy",
    "load_policy",
    "load_policies",
    "evaluate_policies",
    "export_policy",
    "train",
    "make_train",
    "__version__",
]
