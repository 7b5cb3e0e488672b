"""`python -m jaxppo.distributed --hosts H --env CartPole-v1 ...`: the entry point `ray job
submit` runs (also `make ray-submit`, `jaxppo train --hosts H`). Writes the same run folder
as `jaxppo train`, through the same run loop."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import jax

from jaxppo.run import command
from jaxppo.distributed.cluster import DistributedError, quiet_library_logs
from jaxppo.distributed.launch import train_distributed
from jaxppo.errors import (CheckpointError, ConfigError, RunFolderError, TrainingDivergedError,
                           TrainingInterrupted)


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxppo.distributed",
        description=(
            "Multi-host PPO over Ray: one learner process per node (placement group, "
            "STRICT_SPREAD), joined by jax.distributed into one SPMD program; gradients and "
            "statistics are all-reduced inside the compiled iteration. Connects to RAY_ADDRESS "
            "when set (a submitted job has it), else starts a local Ray instance. num_envs is "
            "the global env count (split evenly over hosts x devices). "
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
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else local)")
    p.add_argument("--coordinator-port", type=int, default=0,
                   help="jax.distributed coordinator port on host 0's node (0: a free port)")
    p.add_argument("--gpus-per-host", type=float, default=0.0,
                   help="GPUs reserved for each learner (Ray sets its CUDA_VISIBLE_DEVICES)")
    p.add_argument("--strategy", default="STRICT_SPREAD",
                   choices=("STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK"),
                   help="placement of the learners; STRICT_SPREAD = one per node")
    return p


def main(argv: list[str] | None = None, *, search: bool = False) -> int:
    """The driver's command line; `search`: `jaxppo search --hosts H` (the config must have a
    `search`, and the run folder is named <env>-search-rayH-<time>)."""
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    logging.getLogger("jaxppo").setLevel(logging.INFO)
    quiet_library_logs()  # a job's log: jaxppo's progress and warnings, not orbax's INFO

    # The driver runs no training step; keep it off accelerators so it never competes with a
    # learner for GPU memory on the head node (override with JAX_PLATFORMS).
    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")
    try:
        config, source, run_dir = command.start(
            args, name_tag=f"{'-search' if search else ''}-ray{args.hosts}")
        if search and not args.resume:
            config = command.searched(config)
    except (ConfigError, CheckpointError) as e:
        return command.fail(e)

    print(f"config: {source}; hosts: {args.hosts}; run folder: {run_dir.resolve()}",
          file=sys.stderr, flush=True)
    try:
        result = train_distributed(
            config, hosts=args.hosts, run_dir=None if args.resume else run_dir,
            resume=run_dir if args.resume else None, stop_after_iterations=args.stop_after,
            progress=False if args.no_progress else None, plot=not args.no_plot,
            min_hosts=args.min_hosts,
            address=args.address, strategy=args.strategy, gpus_per_host=args.gpus_per_host,
            coordinator_port=args.coordinator_port,
        )
    except (DistributedError, ConfigError, CheckpointError) as e:
        return command.fail(e)
    except TrainingInterrupted as e:
        return command.interrupted(e)
    except (TrainingDivergedError, RunFolderError) as e:
        return command.fail(e, 1)
    return command.report(result, resume_command=f"python -m jaxppo.distributed --resume {run_dir} "
                                         f"--hosts {args.hosts}")


if __name__ == "__main__":
    raise SystemExit(main())
