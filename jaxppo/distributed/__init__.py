"""Multi-host PPO over Ray: one learner actor per node, the driver owns the optimiser.

    from jaxppo.distributed import train_distributed
    result = train_distributed(PPOConfig(env="CartPole-v1", num_envs=8), hosts=2)

or, on a running cluster, `ray job submit ... -- python -m jaxppo.distributed --hosts 2 ...`.

This subpackage is the only place that imports Ray, and it does so on first use: importing
`jaxppo` (or single-host training) never loads it.
"""

from __future__ import annotations

__all__ = [
    "train_distributed",
    "RayTrainer",
    "DistributedError",
    "ClusterUnreachableError",
    "NotEnoughNodesError",
    "HostsConfigError",
]


def __getattr__(name):
    if name in __all__:
        try:
            from jaxppo.distributed import ray_trainer
        except ModuleNotFoundError as e:  # pragma: no cover - depends on the install
            if e.name == "ray" or (e.name or "").startswith("ray."):
                raise ModuleNotFoundError(
                    "jaxppo.distributed needs Ray: pip install 'jaxppo[ray]' "
                    "(ray[default]==2.60.0) on every node"
                ) from e
            raise
        return getattr(ray_trainer, name)
    raise AttributeError(f"module 'jaxppo.distributed' has no attribute {name!r}")
