"""jaxppo: PPO compiled end to end with JAX.

    import jaxppo
    result = jaxppo.train(jaxppo.PPOConfig(env="CartPole-v1", num_seeds=8))

Single-host training never imports Ray; `jaxppo.distributed` does, on demand.
"""

from jaxppo.algorithm import HyperParams, TrainState
from jaxppo.config import ConfigError, NetworkConfig, PPOConfig
from jaxppo.checkpoint import CheckpointError
from jaxppo.policy import Policy, load_policy
from jaxppo.train import TrainingDivergedError, TrainResult, make_train, train

__all__ = [
    "PPOConfig",
    "NetworkConfig",
    "HyperParams",
    "TrainState",
    "TrainResult",
    "ConfigError",
    "TrainingDivergedError",
    "CheckpointError",
    "Policy",
    "load_policy",
    "train",
    "make_train",
]
__version__ = "0.1.0"
