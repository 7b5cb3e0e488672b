"""jaxppo: PPO compiled end to end with JAX.

    import jaxppo
    result = jaxppo.train(jaxppo.PPOConfig(env="CartPole-v1", num_seeds=8))

Single-host training never imports Ray; `jaxppo.distributed` does, on demand.
"""

import os as _os

# XLA's CPU runtime can wedge for good (every worker idle, the result never ready) when
# Eigen's intra-op thread pool runs large vmapped programs; we hit it with 4 vmapped seeds.
# Single-threaded Eigen avoids it and measured no slower here (the work is many small ops).
# It only takes effect if no JAX backend has started yet; JAXPPO_KEEP_XLA_FLAGS=1 opts out.
if _os.environ.get("JAXPPO_KEEP_XLA_FLAGS") != "1":
    _flags = _os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_multi_thread_eigen" not in _flags:
        _os.environ["XLA_FLAGS"] = (_flags + " --xla_cpu_multi_thread_eigen=false").strip()

from jaxppo.algorithm import HyperParams, TrainState  # noqa: E402
from jaxppo.config import ConfigError, NetworkConfig, PPOConfig  # noqa: E402
from jaxppo.checkpoint import CheckpointError
from jaxppo.policy import Policy, load_policy
from jaxppo.train import TrainingDivergedError, TrainResult, make_train, train  # noqa: E402

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
