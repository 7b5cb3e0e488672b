"""`train_distributed`: one PPO run over several Ray hosts, with the run loop of `jaxppo.train`."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import sys

import ray

from jaxppo.run import checkpoints as ckpt
from jaxppo.search import sweep
from jaxppo.core.hyperparams import HyperParams
from jaxppo.config import PPOConfig
from jaxppo.run.loop import chunk_length, finish_run, open_folder, restore_checkpoint, run_loop
from jaxppo.run.train import prepare
from jaxppo.distributed.cluster import connect
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
):
    """Train PPO on `hosts` Ray nodes (one learner process each) as one SPMD program.

    Everything `jaxppo.train` takes means the same here (run folder, resume, stop, progress,
    callback, hparams); `config.num_envs` is the global env count, split evenly over
    hosts x their devices, and H hosts x E envs give the same numbers as one host with H*E
    envs. Only this process (the driver) writes the run folder.
    Ray: the current connection if `ray.init` was called, else `address`, else RAY_ADDRESS,
    else a new local instance (one node: hosts=1 unless strategy="PACK").
    min_hosts: when a host dies the group restarts from the last chunk's state on the nodes
    Ray has; with fewer than `hosts` nodes left it continues on fewer (the envs re-split; a
    number that divides num_envs), but not fewer than min_hosts (default: hosts).
    coordinator_port: jax.distributed's coordinator port on host 0's node (0: a free one).
    pin_cpus: per host, the CPUs to pin its process to (benchmarks).
    learner_env: environment variables for the learner processes (e.g. XLA_FLAGS).
    snapshot_every_s: how often the driver takes the state from the hosts to restart from
    after a host failure: after every chunk when 0 (the default: at most one chunk is redone),
    else after the first chunk that ends this many seconds after the previous snapshot
    (large states: fewer transfers, more iterations redone).
    Raises HostsConfigError/ConfigError for a bad config, CheckpointError for a run folder that
    cannot be resumed, ClusterUnreachableError, NotEnoughNodesError, DistributedError, and
    TrainingDivergedError on NaN/inf; nothing is started or written before the checks pass.
    """
    config, run_dir, store, step, meta = ckpt.begin_resume("train_distributed", config, run_dir, resume)
    try:
        run = prepare(config, run_dir, meta, stop_after_iterations, "python -m jaxppo.distributed")
        config = run.config
        check_hosts(run, hosts, min_hosts)
        hp, record = sweep.run_hparams(config, hparams, run_dir, resume is not None)
        restored, start_iter, wall_offset = None, 0, 0.0
        if store is not None:
            restored, start_iter, wall_offset = restore_checkpoint(store, step, run, run_dir, hp)
    finally:
        if store is not None:
            store.close()

    started = connect(address, timeout_s=connect_timeout_s)
    group = folder = None
    try:
        group = HostGroup(run, hp, hosts, chunk_len=chunk_length(config), restored=restored,
                          start_iter=start_iter, min_hosts=min_hosts, strategy=strategy,
                          gpus_per_host=gpus_per_host, placement_timeout_s=placement_timeout_s,
                          init_timeout_s=init_timeout_s, coordinator_port=coordinator_port,
                          max_restarts=max_restarts, pin_cpus=pin_cpus, learner_env=learner_env,
                          snapshot_every_s=snapshot_every_s)
        group.start()
        if progress is not False:
            for h in group.host_info:
                print(f"host {h['host_index']}: node {h['node_ip']} ({h['node_id'][:8]}), pid "
                      f"{h['pid']}, {h['backend']} devices {', '.join(h['devices'])}",
                      file=sys.stderr, flush=True)
            print(f"{hosts} learners joined at {group.host_info[0]['coordinator']} and compiled "
                  f"in {group.compile_seconds:.1f}s"
                  + (f"; resuming at iteration {start_iter}" if resume is not None else ""),
                  file=sys.stderr, flush=True)
        folder = open_folder(run_dir, config, start_iter if resume is not None else None)
        if folder is not None:
            folder.record_sweep(record)
        result = run_loop(group, config, folder=folder, start_iter=start_iter,
                          resumed=resume is not None, wall_offset=wall_offset,
                          stop_after_iterations=stop_after_iterations, progress=progress,
                          callback=callback, label=f"{config.env_name} x{hosts} hosts",
                          member_labels=None if record is None else record["labels"])
        return finish_run(result, folder, f"python -m jaxppo.distributed --hosts {hosts}", plot=plot,
                          label=f"{config.env_name} ({hosts} hosts)",
                          extra_summary={"envs_per_host": config.num_envs // group.hosts,
                                         "host_failures": result.host_failures})
    finally:
        if folder is not None:
            folder.close()
        if group is not None:
            group.close()
        if started:
            ray.shutdown()
