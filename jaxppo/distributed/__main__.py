"""`python -m jaxppo.distributed --hosts H --env CartPole-v1 ...`: the entry point `ray job
submit` runs (also `make ray-submit`). Writes the same run folder as `jaxppo train`, through
the same run loop (`jaxppo.distributed.launch.train_from_command`, which `jaxppo train
--hosts H` calls too)."""

from __future__ import annotations

import argparse

if __name__ == "__main__":  # imports as for `jaxppo` (jaxppo.envs.imports): not from the cwd
    from jaxppo.envs.imports import leave_out_cwd

    leave_out_cwd()

from jaxppo.run import command  # noqa: E402
from jaxppo.distributed.launch import HostOptions, train_from_command  # noqa: E402


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxppo.distributed",
        description=(
            "Multi-host PPO over Ray: one learner process per node (placement group, "
            "STRICT_SPREAD), joined by jax.distributed into one SPMD program; gradients and "
            "statistics are all-reduced inside the compiled iteration. Connects to --address, else "
            "RAY_ADDRESS (a submitted job has it), else a cluster running on this machine "
            "(`make ray-cluster`, `ray start`), else starts a private loopback cluster of "
            "--hosts nodes for the run. num_envs is the global env count (split evenly over "
            "hosts x devices). An env that steps in Python (gymnasium:<id>, envpool:<task>) "
            "steps each host's share of the envs in that host's own host loop (or actor "
            "threads, max_policy_lag >= 1); the update is all-reduced over the hosts. "
            f"Config precedence as in `jaxppo train`: {command.PRECEDENCE}."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--hosts", type=int, default=2, help="learner processes, one per node")
    p.add_argument("--min-hosts", type=int, metavar="M",
                   help="after a host is lost, continue on fewer hosts (down to M; the envs are "
                        "re-split) when no node can replace it (default: --hosts, i.e. wait for "
                        "a node or stop)")
    command.add_config_flags(p)
    p.add_argument("--runs-dir", default="runs",
                   help="folder that receives the run folder (give an absolute path under "
                        "`ray job submit --working-dir`, whose cwd is a temporary copy)")
    p.add_argument("--run-name", help="run folder name (default <env>-ray<H>-<YYYYmmdd-HHMMSS>)")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a cluster "
                                     "`ray start` left running on this machine, else a private "
                                     "cluster of --hosts nodes on this machine's loopback, "
                                     "stopped after the run; 'local': a new one)")
    p.add_argument("--coordinator-port", type=int, default=0,
                   help="jax.distributed coordinator port on host 0's node (0: a free port)")
    p.add_argument("--gpus-per-host", type=float, default=0.0,
                   help="GPUs reserved for each learner (Ray sets its CUDA_VISIBLE_DEVICES)")
    p.add_argument("--strategy", default="STRICT_SPREAD",
                   choices=("STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK"),
                   help="placement of the learners; STRICT_SPREAD = one per node")
    return p


def main(argv: list[str] | None = None) -> int:
    """The driver's command line: parse the flags and train (see `train_from_command`)."""
    args = _build_parser().parse_args(argv)
    options = HostOptions(hosts=args.hosts, min_hosts=args.min_hosts, address=args.address,
                          coordinator_port=args.coordinator_port,
                          gpus_per_host=args.gpus_per_host, strategy=args.strategy)
    return train_from_command(args, options)


if __name__ == "__main__":
    raise SystemExit(main())
