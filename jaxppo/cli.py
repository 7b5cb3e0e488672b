"""Command line: `python -m jaxppo train|eval|plot|envs ...` (also installed as `jaxppo`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

TUNED_CONFIG_DIR = Path(__file__).resolve().parent.parent / "experiments" / "configs"


def tuned_config_path(env: str) -> Path | None:
    """experiments/configs/<env>.yaml when the source tree ships one for this env."""
    path = TUNED_CONFIG_DIR / f"{env}.yaml"
    return path if path.exists() else None


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxppo",
        description="PPO compiled end to end with JAX (gymnax envs, one XLA program per device).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser(
        "train",
        help="train a policy and write a run folder",
        description=(
            "Train PPO. Config precedence: defaults < tuned config for the env "
            "(experiments/configs/<env>.yaml, unless --config or --defaults) < --config file "
            "< --set pairs. The run folder runs/<env>-<time>/ gets config.yaml, metrics.jsonl, "
            "params.msgpack, summary.json and curve.png."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    t.add_argument("--env", help="gymnax env name, e.g. CartPole-v1 (overrides the file's env)")
    t.add_argument("--config", help="YAML or JSON file of PPOConfig fields")
    t.add_argument("--defaults", action="store_true",
                   help="ignore the tuned config in experiments/configs/ and start from defaults")
    t.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[],
                   metavar="KEY=VALUE",
                   help="override config fields, e.g. --set lr=3e-4 num_envs=8 network.hidden_sizes=[128,128]")
    t.add_argument("--seeds", type=int, help="shortcut for --set num_seeds=N")
    t.add_argument("--runs-dir", default="runs", help="folder that receives the run folder")
    t.add_argument("--run-name", help="run folder name (default <env>-<YYYYmmdd-HHMMSS>)")
    t.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    t.add_argument("--no-plot", action="store_true", help="skip curve.png")
    t.add_argument("--resume", metavar="RUN_DIR",
                   help="continue RUN_DIR from its newest checkpoint, with its config.yaml; --set "
                        "may change fields such as total_timesteps (to extend the run), not shapes")
    t.add_argument("--stop-after", type=int, metavar="N",
                   help="stop after N iterations of this call (a checkpoint is written); "
                        "continue later with --resume")
    t.add_argument("--hosts", type=int, metavar="H",
                   help="train across H hosts of a Ray cluster (RAY_ADDRESS, else a local Ray); "
                        "same as `python -m jaxppo.distributed --hosts H ...`, which has the "
                        "multi-host options")

    e = sub.add_parser("eval", help="evaluate the trained policy of a run folder",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    e.add_argument("run", help="run folder")
    e.add_argument("--episodes", type=int, default=10, help="episodes (one per parallel env)")
    e.add_argument("--stochastic", action="store_true",
                   help="sample actions instead of taking the most likely one")
    e.add_argument("--seed", type=int, default=0, help="seed of the eval envs (and sampling)")
    e.add_argument("--max-steps", type=int, help="bound on an episode (default: the env's limit)")
    e.add_argument("--seed-index", type=int, default=0, help="which seed of a multi-seed run")
    e.add_argument("--json", action="store_true", help="print the result as JSON")

    p = sub.add_parser("plot", help="plot return curves of one or more run folders")
    p.add_argument("runs", nargs="+", help="run folders (or metrics.jsonl files)")
    p.add_argument("-o", "--output", default="curves.png", help="PNG file to write")

    sub.add_parser("envs", help="list the registered gymnax environments")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "envs":
        from jaxppo.envs import registered_env_names

        print("\n".join(registered_env_names()))
        return 0
    if args.command == "plot":
        from jaxppo.plotting import plot_runs

        missing = [r for r in args.runs if not Path(r).exists()]
        if missing:
            print(f"error: run folder {missing[0]!r} does not exist", file=sys.stderr)
            return 2
        no_metrics = [r for r in args.runs
                      if Path(r).is_dir() and not (Path(r) / "metrics.jsonl").exists()]
        if no_metrics:
            print(f"error: {no_metrics[0]} has no metrics.jsonl; is it a run folder?", file=sys.stderr)
            return 2
        print(plot_runs(args.runs, args.output))
        return 0
    if args.command == "eval":
        return _eval(args)
    return _train(args)


def _eval(args) -> int:
    from jaxppo.checkpoint import CheckpointError
    from jaxppo.config import ConfigError

    if args.episodes < 1:
        print(f"error: --episodes {args.episodes} must be >= 1", file=sys.stderr)
        return 2
    try:
        from jaxppo.policy import load_policy

        policy = load_policy(args.run, seed_index=args.seed_index)
        out = policy.evaluate(episodes=args.episodes, seed=args.seed,
                              deterministic=not args.stochastic, max_steps=args.max_steps)
    except (CheckpointError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.update(run=str(args.run), env=policy.config.env_name, iteration=policy.iteration,
               deterministic=not args.stochastic, seed=args.seed)
    if args.json:
        print(json.dumps(out))
        return 0
    where = f"checkpoint iteration {policy.iteration}" if policy.iteration is not None else "params.msgpack"
    print(f"{out['env']} ({args.run}, {where}): return {out['return_mean']:.2f} ± "
          f"{out['return_std']:.2f}, length {out['length_mean']:.1f} ± {out['length_std']:.1f} over "
          f"{out['episodes']} episodes ({'stochastic' if args.stochastic else 'deterministic'} "
          f"policy, seed {args.seed})")
    return 0


def resolve_config(args):
    from jaxppo.config import PPOConfig

    config = PPOConfig()
    source = "defaults"
    if args.config:
        config = PPOConfig.from_file(args.config, config)
        source = args.config
    elif args.env and not args.defaults:
        tuned = tuned_config_path(args.env)
        if tuned is not None:
            config = PPOConfig.from_file(tuned, config)
            source = str(tuned)
    if args.env:
        config = config.replace(env=args.env)
    overrides = list(args.overrides)
    if args.seeds is not None:
        overrides.append(f"num_seeds={args.seeds}")
    if overrides:
        config = config.with_overrides(overrides)
    return config.validate(), source


def _resume_config(args):
    """The config of a run folder being resumed: its config.yaml, then --set pairs."""
    from jaxppo.checkpoint import CheckpointError, load_run_config

    clashing = [flag for flag, given in (("--config", args.config), ("--env", args.env),
                                         ("--defaults", args.defaults), ("--run-name", args.run_name))
                if given]
    if clashing:
        from jaxppo.config import ConfigError

        raise ConfigError(
            f"{clashing[0]} cannot be combined with --resume: a resumed run keeps its folder and "
            "its config.yaml; change fields with --set (e.g. --set total_timesteps=1000000)"
        )
    run_dir = Path(args.resume)
    if not run_dir.is_dir():
        raise CheckpointError(f"run folder {run_dir} does not exist; check the path")
    config = load_run_config(run_dir)
    overrides = list(args.overrides)
    if args.seeds is not None:
        overrides.append(f"num_seeds={args.seeds}")
    if overrides:
        config = config.with_overrides(overrides)
    return config.validate(), run_dir


def config_for(args):
    """(config, source, resumed run folder or None) from --resume, else --env/--config/--set."""
    if args.resume:
        config, run_dir = _resume_config(args)
        return config, f"{run_dir / 'config.yaml'} (resumed)", run_dir
    config, source = resolve_config(args)
    return config, source, None


def _train_on_hosts(args) -> int:
    """`train --hosts H`: hand over to the Ray driver (imported only here)."""
    argv = ["--hosts", str(args.hosts), "--runs-dir", args.runs_dir]
    if args.seeds is not None:
        argv += ["--seeds", str(args.seeds)]
    if args.resume:
        argv += ["--resume", args.resume]
    if args.stop_after is not None:
        argv += ["--stop-after", str(args.stop_after)]
    for flag, value in (("--env", args.env), ("--config", args.config), ("--run-name", args.run_name)):
        if value:
            argv += [flag, value]
    if args.defaults:
        argv.append("--defaults")
    if args.no_progress:
        argv.append("--no-progress")
    if args.no_plot:
        argv.append("--no-plot")
    if args.overrides:
        argv += ["--set", *args.overrides]
    from jaxppo.distributed.__main__ import main as distributed_main

    return distributed_main(argv)


def _train(args) -> int:
    from jaxppo.checkpoint import CheckpointError
    from jaxppo.config import ConfigError

    if args.hosts is not None:
        return _train_on_hosts(args)

    if args.stop_after is not None and args.stop_after < 1:
        print(f"error: --stop-after {args.stop_after} must be >= 1", file=sys.stderr)
        return 2
    from jaxppo.rundir import fresh_run_dir

    try:
        config, source, run_dir = config_for(args)
        if not args.resume:
            run_dir = fresh_run_dir(
                args.runs_dir, args.run_name or f"{config.env_name}-{time.strftime('%Y%m%d-%H%M%S')}")
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from jaxppo.train import TrainingDivergedError, train

    print(f"config: {source}; run folder: {run_dir}", file=sys.stderr)
    print("compiling the training program (a few seconds; cached for the next run) ...",
          file=sys.stderr, flush=True)
    try:
        result = train(config, run_dir=None if args.resume else run_dir,
                       resume=run_dir if args.resume else None,
                       progress=False if args.no_progress else None,
                       stop_after_iterations=args.stop_after, plot=not args.no_plot)
    except TrainingDivergedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return report(result, resume_command=f"jaxppo train --resume {run_dir}")


def report(result, resume_command: str) -> int:
    """The last lines of a run: stopped early, nothing to do, or done with its summary."""
    config, run_dir, summary = result.config, result.run_dir, result.summary
    if not result.completed:
        print(f"stopped after iteration {result.iterations_done} of {config.num_iterations} "
              f"(checkpoint written); continue with: {resume_command}", file=sys.stderr)
        return 0
    if result.resumed_from is not None and result.resumed_from == result.iterations_done:
        print(f"nothing to do: {run_dir} is already complete at iteration {result.iterations_done}; "
              "extend it with --set total_timesteps=N", file=sys.stderr)
        return 0
    ev = summary.get("final_eval_return_mean")
    where = f" on {result.hosts} hosts" if result.hosts > 1 else ""
    failures = (f"; host failures: {len(result.host_failures)}" if result.hosts > 1
                or result.host_failures else "")
    print(
        f"done: final return {summary['final_return_mean']:.1f} ± {summary['final_return_std']:.1f} "
        f"(last 10 iterations, {config.num_seeds} seed(s)); "
        + (f"final eval return {ev:.1f}; " if ev is not None else "")
        + f"{summary['env_steps']:,} env steps in "
        f"{summary['train_seconds']:.1f}s ({summary['sps']:,.0f} steps/s) + "
        f"{summary['compile_seconds']:.1f}s compile{where}{failures}; run folder {run_dir}",
        file=sys.stderr,
    )
    return 0
