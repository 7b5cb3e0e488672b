"""Multi-host PPO over Ray: one learner process per node, all running one SPMD program.

    from jaxppo.distributed import train_distributed
    result = train_distributed(PPOConfig(env="CartPole-v1", num_envs=8), hosts=2)

or, on a running cluster, `ray job submit ... -- python -m jaxppo.distributed --hosts 2 ...`.
Ray places the learners (a STRICT_SPREAD placement group), hands them host 0's coordinator
address for `jax.distributed.initialize`, watches them and restarts the group from the last
chunk's state when one dies; XLA all-reduces gradients and statistics inside the compiled
iteration, exactly as `pmap` does over one host's devices. An env that steps in Python
(gymnasium, envpool) runs in each host's own host loop on that host's share of the envs, the
update all-reduced over every host's devices.

This subpackage is the only place that imports Ray, and it does so on first use: importing
`jaxppo` (or single-host training) never loads it.
"""

from __future__ import annotations

_EXPORTS = {
    "train_distributed": "launch",
    "HostGroup": "group",
    "check_hosts": "group",
    "DistributedError": "cluster",
    "ClusterUnreachableError": "cluster",
    "NotEnoughNodesError": "cluster",
    "HostsConfigError": "cluster",
    "connect": "cluster",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        try:
            module = importlib.import_module(f"jaxppo.distributed.{_EXPORTS[name]}")
        except ModuleNotFoundError as e:  # pragma: no cover - depends on the install
            if e.name == "ray" or (e.name or "").startswith("ray."):
                raise ModuleNotFoundError(
                    "jaxppo.distributed needs Ray: pip install 'jaxppo[ray]' "
                    "(ray[default]==2.60.0) on every node"
                ) from e
            raise
        return getattr(module, name)
    raise AttributeError(f"module 'jaxppo.distributed' has no attribute {name!r}")
