"""`train_distributed`: one PPO run over several Ray hosts, through `jaxppo.run.train.train_with`
(the checks, resume, run folder and loop of `jaxppo.train`), with a `HostGroup` as its runner
(an env that steps in Python: each host steps its share of the envs in its own host loop);
and `train_from_command`, the driver behind `python -m jaxppo.distributed` and `jaxppo train
--hosts`."""

from __future__ import annotations

import functools
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jax

from jaxppo.config import PPOConfig
from jaxppo.core.hyperparams import HyperParams
from jaxppo.errors import (CheckpointError, ConfigError, RunFolderError, TrainingDivergedError,
                           TrainingInterrupted)
from jaxppo.run import command
from jaxppo.run.loop import chunk_length
from jaxppo.run.result import TrainResult
from jaxppo.run.train import EntryPoint, Start, train_with
from jaxppo.distributed.cluster import (HOSTS_LOG, DistributedError, HostsOutput, connect,
                                        disconnect, quiet_library_logs)
from jaxppo.distributed.group import HostGroup, check_hosts


def train_distributed(
    config: PPOConfig | None,
    hosts: int = 2,
    run_dir: str | Path | None = None,
    progress: bool | None = None,
    *,
    hparams: HyperParams | None = None,
    callback: Callable[[list[dict]], None] | None = None,
    resume: str | Path | None = None,
    stop_after_iterations: int | None = None,
    plot: bool = True,
    min_hosts: int | None = None,
    address: str | None = None,
    strategy: str = "STRICT_SPREAD",
    gpus_per_host: float = 0,
    coordinator_port: int = 0,
    placement_timeout_s: float = 60.0,
    init_timeout_s: int = 60,
    connect_timeout_s: float = 5.0,
    max_restarts: int = 8,
    pin_cpus: list[list[int]] | None = None,
    learner_env: dict[str, str] | None = None,
    snapshot_every_s: float = 0.0,
) -> TrainResult:
    """Train PPO on `hosts` Ray nodes (one learner process each) as one SPMD program.

    Everything `jaxppo.train` takes means the same here (run folder, resume, stop, progress,
    callback, hparams); `config.num_envs` is the global env count, split evenly over
    hosts x their devices, and H hosts x E envs give the same numbers as one host with H*E
    envs. Only this process (the driver) writes the run folder. Nothing is started or written
    before the checks pass.

    Args:
        config, run_dir, progress, hparams, callback, resume, stop_after_iterations, plot:
            as `jaxppo.train` takes them.
        hosts: learner processes, one per node (with the default strategy).
        min_hosts: when a host dies the group restarts from the last snapshot on the nodes
            Ray has; with fewer than `hosts` nodes left it continues on fewer (the envs
            re-split; a number that divides num_envs), but not fewer than min_hosts
            (default: hosts).
        address: the Ray cluster: the current connection if `ray.init` was called, else
            `address`, else RAY_ADDRESS, else a cluster `ray start` (or `make ray-cluster`)
            left running on this machine, else a private cluster of `hosts` nodes started on
            this machine's loopback for this run and stopped after it (one node for
            hosts=1); "local" asks for a new instance, "auto" for a running cluster.
        strategy: Ray's placement of the learners; STRICT_SPREAD puts one on each node.
        gpus_per_host: GPUs reserved for each learner.
        coordinator_port: jax.distributed's coordinator port on host 0's node (0: a free one).
        placement_timeout_s, init_timeout_s, connect_timeout_s: how long to wait for the
            placement, for the learners to join, and for the cluster to answer.
        max_restarts: host failures survived before giving up.
        pin_cpus: per host, the CPUs to pin its process to (benchmarks).
        learner_env: environment variables for the learner processes (e.g. XLA_FLAGS).
        snapshot_every_s: how often the driver takes the state from the hosts to restart
            from after a host failure: after every chunk when 0 (the default: at most one
            chunk is redone), else after the first chunk that ends this many seconds after
            the previous snapshot (large states: fewer transfers, more iterations redone).

    Returns:
        The TrainResult, with `hosts` and `host_failures`.

    Raises:
        HostsConfigError, ConfigError: a bad config for the hosts.
        CheckpointError: a run folder that cannot be resumed.
        ClusterUnreachableError, NotEnoughNodesError, DistributedError: Ray could not place,
            start or keep the learners.
        TrainingDivergedError, TrainingInterrupted: as for `jaxppo.train`.
    """
    folder = run_dir if run_dir is not None else resume
    hosts_log = Path(folder) / HOSTS_LOG if folder is not None else None
    start_group = functools.partial(
        _start_group, hosts=hosts, address=address, connect_timeout_s=connect_timeout_s,
        progress=progress, hosts_log=hosts_log, options=dict(
            min_hosts=min_hosts, strategy=strategy, gpus_per_host=gpus_per_host,
            placement_timeout_s=placement_timeout_s, init_timeout_s=init_timeout_s,
            coordinator_port=coordinator_port, max_restarts=max_restarts, pin_cpus=pin_cpus,
            learner_env=learner_env, snapshot_every_s=snapshot_every_s))
    return train_with(start_group, _entry_point(hosts, min_hosts, hosts_log), config, hparams=hparams,
                      run_dir=run_dir, progress=progress, callback=callback, resume=resume,
                      stop_after_iterations=stop_after_iterations, plot=plot)


def _entry_point(hosts: int, min_hosts: int | None, hosts_log: Path | None) -> EntryPoint:
    """What a run on hosts checks (the split over hosts), and how it names itself; its
    summary names the hosts' log (what Ray forwarded from the cluster), when it has one."""
    return EntryPoint(
        "train_distributed", f"python -m jaxppo.distributed --hosts {hosts}", layout=None,
        check=lambda resolved: check_hosts(resolved, hosts, min_hosts),
        label=f"{{env}} x{hosts} hosts", plot_label=f"{{env}} ({hosts} hosts)",
        summary=lambda result: {"envs_per_host": result.config.num_envs // result.hosts,
                                "host_failures": result.host_failures,
                                **({"hosts_log": HOSTS_LOG} if hosts_log else {})})


def _start_group(start: Start, hosts: int, address: str | None, connect_timeout_s: float,
                 progress: bool | None, options: dict, hosts_log: Path | None) -> HostGroup:
    """Connect to Ray, then place, start and compile the learners; says who joined. With
    `hosts_log`, what Ray forwards from the cluster goes there (`HostsOutput`)."""
    say = None if progress is False else (lambda line: print(line, file=sys.stderr, flush=True))
    started = connect(address, timeout_s=connect_timeout_s, announce=say, nodes=hosts)
    output = HostsOutput(hosts_log).install() if hosts_log is not None else None
    try:
        group = HostGroup(start.resolved, start.hp, hosts,
                          chunk_len=chunk_length(start.resolved.config), restored=start.restored,
                          start_iter=start.iteration, owns_ray=started, output=output,
                          **options).start()
    except BaseException:
        if output is not None:
            output.close()
        if started:
            disconnect()
        raise
    if progress is not False:
        for h in group.host_info:
            print(f"host {h['host_index']}: node {h['node_ip']} ({h['node_id'][:8]}), pid "
                  f"{h['pid']}, {h['backend']} devices {', '.join(h['devices'])}",
                  file=sys.stderr, flush=True)
        print(f"{hosts} learners joined at {group.host_info[0]['coordinator']} and compiled "
              f"in {group.compile_seconds:.1f}s"
              + (f"; resuming at iteration {start.iteration}" if start.restored is not None else ""),
              file=sys.stderr, flush=True)
    return group


@dataclass(frozen=True)
class HostOptions:
    """The multi-host flags of `python -m jaxppo.distributed` (`jaxppo train --hosts H` gives
    only `hosts`; the rest keep their defaults)."""

    hosts: int
    min_hosts: int | None = None
    address: str | None = None
    coordinator_port: int = 0
    gpus_per_host: float = 0.0
    strategy: str = "STRICT_SPREAD"


def train_from_command(args, options: HostOptions, *, search: bool = False) -> int:
    """Train on hosts from parsed command-line flags, as the driver of a Ray job.

    Args:
        args: the parsed config flags (`jaxppo.run.command.add_config_flags`) with
            `runs_dir` and `run_name`.
        options: the multi-host flags.
        search: `jaxppo search --hosts H`: the config must have a `search`, and the run
            folder is named <env>-search-rayH-<time>.

    Returns:
        The process's exit code (0 done or stopped early, 1 diverged or unwritable folder,
        2 a bad config, checkpoint or cluster, 128+N stopped by signal N).
    """
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
            args, name_tag=f"{'-search' if search else ''}-ray{options.hosts}")
        if search and not args.resume:
            config = command.searched(config)
    except (ConfigError, CheckpointError) as e:
        return command.fail(e)
    print(f"config: {source}; hosts: {options.hosts}; run folder: {run_dir.resolve()}",
          file=sys.stderr, flush=True)
    try:
        result = train_distributed(
            config, hosts=options.hosts, run_dir=None if args.resume else run_dir,
            resume=run_dir if args.resume else None, stop_after_iterations=args.stop_after,
            progress=False if args.no_progress else None, plot=not args.no_plot,
            min_hosts=options.min_hosts, address=options.address, strategy=options.strategy,
            gpus_per_host=options.gpus_per_host, coordinator_port=options.coordinator_port)
    except (DistributedError, ConfigError, CheckpointError) as e:
        return command.fail(e)
    except TrainingInterrupted as e:
        return command.interrupted(e)
    except (TrainingDivergedError, RunFolderError) as e:
        return command.fail(e, 1)
    if result.host_failures and result.run_dir is not None:
        print(f"hosts lost: {len(result.host_failures)}; the cluster's output (the learners', "
              f"Ray's) is in {Path(result.run_dir) / HOSTS_LOG}", file=sys.stderr, flush=True)
    return command.report(result, resume_command=f"python -m jaxppo.distributed --resume {run_dir} "
                                                 f"--hosts {options.hosts}")
