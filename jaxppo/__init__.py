"""jaxppo: PPO compiled end to end with JAX.

    import jaxppo
    result = jaxppo.train(jaxppo.PPOConfig.tuned("CartPole-v1", num_seeds=8))

Single-host training never imports Ray; `jaxppo.distributed` does, on demand.
On a CPU host JAX gets one device per core, first thing (jaxppo.cpu_devices;
JAXPPO_CPU_DEVICES=1 turns that off).
"""

import jaxppo.cpu_devices  # noqa: F401  (first: before anything starts JAX's backend)
from jaxppo.core.algorithm import Algorithm, TrainState
from jaxppo.core.hyperparams import HyperParams
from jaxppo.config import NetworkConfig, PPOConfig, tuned_env_names
from jaxppo.errors import (ActionMaskError, CheckpointError, ConfigError, ExportError, RunFolderError,
                           StopTraining, TrainingDivergedError, TrainingInterrupted, VideoError)
from jaxppo.run.export import export_policy
from jaxppo.run.loop import TrainResult
from jaxppo.run.policy import Policy, load_policy
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
    "ExportError",
    "VideoError",
    "Policy",
    "load_policy",
    "export_policy",
    "train",
    "make_train",
    "__version__",
]
