"""`python -m jaxppo.distributed --hosts H --env CartPole-v1 ...`: the entry point `ray job
submit` runs (also `make ray-submit`). Writes the same run folder as `jaxppo train`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxppo.distributed",
        description=(
            "Multi-host PPO over Ray: one learner actor per node (placement group, "
            "STRICT_SPREAD); the driver averages the hosts' gradients and applies the "
            "optimiser. Connects to RAY_ADDRESS when set (a submitted job has it), else starts "
            "a local Ray instance. num_envs is the global env count (split evenly over hosts). "
            "Config precedence as in `jaxppo train`: defaults < experiments/configs/<env>.yaml "
            "< --config < --set."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--hosts", type=int, default=2, help="learner actors, one per node")
    p.add_argument("--env", help="gymnax env name, e.g. CartPole-v1 (overrides the file's env)")
    p.add_argument("--config", help="YAML or JSON file of PPOConfig fields")
    p.add_argument("--defaults", action="store_true",
                   help="ignore the tuned config in experiments/configs/ and start from defaults")
    p.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[],
                   metavar="KEY=VALUE", help="override config fields, e.g. --set num_envs=8")
    p.add_argument("--runs-dir", default="runs",
                   help="folder that receives the run folder (give an absolute path under "
                        "`ray job submit --working-dir`, whose cwd is a temporary copy)")
    p.add_argument("--run-name", help="run folder name (default <env>-ray<H>-<YYYYmmdd-HHMMSS>)")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else local)")
    p.add_argument("--gpus-per-host", type=float, default=0.0,
                   help="GPUs reserved for each learner (Ray sets its CUDA_VISIBLE_DEVICES)")
    p.add_argument("--strategy", default="STRICT_SPREAD",
                   choices=("STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK"),
                   help="placement of the learners; STRICT_SPREAD = one per node")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue RUN_DIR from its newest checkpoint, with its config.yaml; --set "
                        "may change fields such as total_timesteps (to extend the run), not "
                        "shapes; --hosts may change if it divides num_envs")
    p.add_argument("--stop-after", type=int, metavar="N",
                   help="stop after N iterations of this call (a checkpoint is written); "
                        "continue later with --resume")
    p.add_argument("--no-progress", action="store_true", help="no progress lines")
    p.add_argument("--no-plot", action="store_true", help="skip curve.png")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    args.seeds = None  # resolve_config reads it; one seed per multi-host job
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    logging.getLogger("jaxppo").setLevel(logging.INFO)

    import jax

    # The driver only applies the optimiser; keep it off accelerators so it never competes
    # with a learner for GPU memory on the head node (override with JAX_PLATFORMS).
    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")

    from jaxppo.checkpoint import CheckpointError
    from jaxppo.cli import config_for, fresh_run_dir
    from jaxppo.config import ConfigError
    from jaxppo.distributed.ray_trainer import (DistributedError, check_hosts,
                                                train_distributed)
    from jaxppo.train import TrainingDivergedError

    if args.stop_after is not None and args.stop_after < 1:
        print(f"error: --stop-after {args.stop_after} must be >= 1", file=sys.stderr)
        return 2
    try:
        config, source, run_dir = config_for(args)
        check_hosts(config, args.hosts)
        if not args.resume:
            run_dir = fresh_run_dir(args.runs_dir, args.run_name or
                                    f"{config.env_name}-ray{args.hosts}-{time.strftime('%Y%m%d-%H%M%S')}")
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import yaml

    print(f"config: {source}; hosts: {args.hosts}; run folder: {run_dir.resolve()}",
          file=sys.stderr, flush=True)
    t_start = time.perf_counter()
    if not args.resume:
        _write_config(run_dir, config, yaml)
    try:
        result = train_distributed(
            config, hosts=args.hosts, run_dir=None if args.resume else run_dir,
            resume=run_dir if args.resume else None, stop_after_iterations=args.stop_after,
            progress=not args.no_progress, address=args.address, strategy=args.strategy,
            gpus_per_host=args.gpus_per_host,
        )
    except (DistributedError, ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        if not args.resume:
            _drop_if_unused(run_dir)
        return 2
    except TrainingDivergedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    from jaxppo.checkpoint import save_params

    save_params(run_dir / "params.msgpack", result)
    info = summary(result, hosts=args.hosts, wall_seconds=time.perf_counter() - t_start)
    (run_dir / "summary.json").write_text(json.dumps(info, indent=2))
    if not args.no_plot:
        from jaxppo.plotting import plot_runs

        plot_runs([run_dir], run_dir / "curve.png", labels=[f"{config.env_name} ({args.hosts} hosts)"],
                  title=f"{config.env_name}: return vs env steps ({args.hosts} hosts)")
    if not result.completed:
        print(f"stopped after iteration {result.iterations_done} of {config.num_iterations} "
              "(checkpoint written); continue with: python -m jaxppo.distributed --resume "
              f"{run_dir} --hosts {args.hosts}", file=sys.stderr)
        return 0
    if result.resumed_from is not None and result.resumed_from == result.iterations_done:
        print(f"nothing to do: {run_dir} is already complete at iteration "
              f"{result.iterations_done}; extend it with --set total_timesteps=N", file=sys.stderr)
        return 0
    print(
        f"done: final return {info['final_return_mean']:.1f} (last 10 iterations) ; "
        f"{info['env_steps']:,} env steps in {info['train_seconds']:.1f}s "
        f"({info['sps']:,.0f} steps/s) + {info['compile_seconds']:.1f}s setup/compile on "
        f"{args.hosts} hosts; host failures: {len(info['host_failures'])}; run folder {run_dir}",
        file=sys.stderr,
    )
    return 0


def summary(result, hosts: int, wall_seconds: float) -> dict:
    """summary.json: the keys `jaxppo train` writes, plus the multi-host ones."""
    import numpy as np

    from jaxppo.train import process_uptime

    r = np.asarray(result.metrics["episode_return_mean"], float)[-10:]
    r = r[np.isfinite(r)]
    tail = float(r.mean()) if len(r) else float("nan")
    cfg = result.config
    done = int(getattr(result, "iterations_done", cfg.num_iterations))
    steps = done * cfg.batch_size
    steps_now = (done - (getattr(result, "resumed_from", None) or 0)) * cfg.batch_size
    return {
        "env": cfg.env_name,
        "num_seeds": 1,
        "hosts": hosts,
        "envs_per_host": cfg.num_envs // hosts,
        "env_steps": steps,
        "iterations": done,
        "completed": bool(getattr(result, "completed", True)),
        "final_return_mean": tail,
        "final_return_std": 0.0,
        "final_return_per_seed": [tail],
        "compile_seconds": result.compile_seconds,
        "train_seconds": result.train_seconds,
        "sps": steps_now / max(result.train_seconds, 1e-9),
        "wall_seconds": wall_seconds,
        "process_seconds": process_uptime(),
        "host_failures": getattr(result, "host_failures", []),
    }


def _write_config(run_dir: Path, config, yaml) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))


def _drop_if_unused(run_dir: Path) -> None:
    """Remove a run folder that holds nothing but its config (the run never started)."""
    try:
        metrics = run_dir / "metrics.jsonl"
        names = {p.name for p in run_dir.iterdir()}
        if names <= {"config.yaml", "metrics.jsonl"} and (
                not metrics.exists() or metrics.stat().st_size == 0):
            for n in names:
                (run_dir / n).unlink()
            run_dir.rmdir()
    except OSError:
        pass


if __name__ == "__main__":
    raise SystemExit(main())
