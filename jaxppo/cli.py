"""Command line: `python -m jaxppo train|plot|envs ...` (also installed as `jaxppo`)."""

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
        print(plot_runs(args.runs, args.output))
        return 0
    return _train(args)


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


def _train(args) -> int:
    from jaxppo.config import ConfigError

    try:
        config, source = resolve_config(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import yaml

    from jaxppo.train import TrainingDivergedError, train

    name = args.run_name or f"{config.env_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(args.runs_dir) / name
    if run_dir.exists() and any(run_dir.iterdir()):
        print(f"error: run folder {run_dir} already exists and is not empty; "
              "choose another --run-name", file=sys.stderr)
        return 2
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    print(f"config: {source}; run folder: {run_dir}", file=sys.stderr)
    try:
        result = train(config, run_dir=run_dir, progress=False if args.no_progress else None)
    except TrainingDivergedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from jaxppo.checkpoint import save_params

    save_params(run_dir / "params.msgpack", result)
    summary = _summary(result)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if not args.no_plot:
        from jaxppo.plotting import plot_runs

        plot_runs([run_dir], run_dir / "curve.png", labels=[config.env_name],
                  title=f"{config.env_name}: return vs env steps")
    print(
        f"done: final return {summary['final_return_mean']:.1f} ± {summary['final_return_std']:.1f} "
        f"(last 10 iterations, {config.num_seeds} seed(s)); {summary['env_steps']:,} env steps in "
        f"{summary['train_seconds']:.1f}s ({summary['sps']:,.0f} steps/s) + "
        f"{summary['compile_seconds']:.1f}s compile; run folder {run_dir}",
        file=sys.stderr,
    )
    return 0


def _summary(result) -> dict:
    import numpy as np

    from jaxppo.train import process_uptime

    r = np.atleast_2d(result.metrics["episode_return_mean"])
    tail = []
    for seed_curve in r:
        vals = seed_curve[-10:]
        vals = vals[np.isfinite(vals)]
        tail.append(float(vals.mean()) if len(vals) else float("nan"))
    cfg = result.config
    steps = int(cfg.num_iterations * cfg.batch_size)
    return {
        "env": cfg.env_name,
        "num_seeds": cfg.num_seeds,
        "env_steps": steps,
        "final_return_mean": float(np.mean(tail)),
        "final_return_std": float(np.std(tail)),
        "final_return_per_seed": tail,
        "compile_seconds": result.compile_seconds,
        "train_seconds": result.train_seconds,
        "sps": steps * cfg.num_seeds / max(result.train_seconds, 1e-9),
        "process_seconds": process_uptime(),
    }
