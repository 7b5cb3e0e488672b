"""Command line: `python -m jaxppo train|search|eval|export|plot|envs ...` (also installed as `jaxppo`)."""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np

from jaxppo.run import command
from jaxppo.search import sweep
from jaxppo.config import MAX_TIMESTEPS, check_seed, tuned_envs
from jaxppo.envs.catalog import SUITE_CATALOG, gymnax_table, suite_table, suites_table
from jaxppo.envs.make import registered_env_names
from jaxppo.errors import (CheckpointError, ConfigError, ExportError, RolloutTimeoutError,
                           RunFolderError, TrainingDivergedError, TrainingInterrupted, VideoError)
from jaxppo.run.plots import plot_runs, unplottable
from jaxppo.run.policy import evaluate_policies, load_policies, load_policy
from jaxppo.run.folder import output_problem
from jaxppo.run.logs import order_problem, read_metrics
from jaxppo.run.signals import StopSignals
from jaxppo.run.train import train


class _DefaultsKeepEpilog(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Flag defaults shown, and the epilog (the config keys, one per line) kept as written."""


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxppo",
        description="PPO with JAX: an env written in JAX (gymnax, Brax, Jumanji, Craftax, "
                    "xminigrid, JaxMARL) trains as one XLA program per device; gymnasium "
                    "and envpool envs step on the host (synchronously, or actor and learner "
                    "overlapping).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_training_commands(sub)
    _add_run_folder_commands(sub)
    return parser


def _add_training_commands(sub) -> None:
    """`train` and `search`."""
    t = sub.add_parser(
        "train",
        help="train a policy and write a run folder",
        description=textwrap.fill(
            f"Train PPO. Config precedence: {command.PRECEDENCE}. Tuned configs ship for "
            f"{', '.join(tuned_envs())}. The run folder runs/<env>-<time>/ gets "
            "config.yaml, metrics.jsonl, checkpoints/, params.msgpack, summary.json and curve.png.",
            width=88, break_on_hyphens=False),
        epilog=command.config_keys_help(),
        formatter_class=_DefaultsKeepEpilog,
    )
    command.add_config_flags(t)
    t.add_argument("--runs-dir", default="runs", help="folder that receives the run folder")
    t.add_argument("--run-name", help="run folder name (default <env>-<YYYYmmdd-HHMMSS>)")
    t.add_argument("--hosts", type=int, metavar="H",
                   help="train across H hosts of a Ray cluster (--address, else RAY_ADDRESS, "
                        "else one running on this machine, else a private H-node loopback "
                        "cluster for the run); same as `python "
                        "-m jaxppo.distributed --hosts H ...`, which has the multi-host options")
    t.add_argument("--address", metavar="HOST:PORT",
                   help="with --hosts: the Ray cluster's GCS address (as RAY_ADDRESS)")

    s = sub.add_parser(
        "search",
        help="train a population with drawn hyperparameters (config `search`, and `pbt`)",
        description=textwrap.fill(
            "Hyperparameter search in one vmapped program: the config's `search` gives a "
            "distribution per tunable field (and `population`), e.g. --set "
            "'search={population: 8, lr: {loguniform: [1e-4, 1e-2]}}'; with `pbt` (e.g. --set "
            "'pbt={interval: 10}') the population is trained population-based. Besides a "
            "run's files the folder gets search.json (every member and setting, ranked), "
            "search.csv, search.png and best.yaml (the best setting as a config).",
            width=88, break_on_hyphens=False),
        epilog=command.config_keys_help(),
        formatter_class=_DefaultsKeepEpilog,
    )
    command.add_config_flags(s)
    s.add_argument("--population", type=int, metavar="N",
                   help="settings to draw (search.population); num_seeds follows it")
    s.add_argument("--hosts", type=int, metavar="H",
                   help="split the population over H hosts of a Ray cluster (each trains "
                        "population/H whole members; hosts exchange only fitness and the copied "
                        "learner states at PBT steps), as `jaxppo train --hosts H`")
    s.add_argument("--address", metavar="HOST:PORT",
                   help="with --hosts: the Ray cluster's GCS address (as RAY_ADDRESS)")
    s.add_argument("--runs-dir", default="runs", help="folder that receives the run folder")
    s.add_argument("--run-name", help="run folder name (default <env>-search-<YYYYmmdd-HHMMSS>)")



NO_IMPORTS_HELP = ("refuse a config.yaml whose env names a module to import (module:Class): "
                   "for run folders you did not write (--env stays allowed)")


def _add_run_folder_commands(sub) -> None:
    """`eval`, `export` and `plot` of run folders, and `envs`."""
    e = sub.add_parser("eval", help="evaluate the trained policy of a run folder",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    e.add_argument("run", help="run folder")
    e.add_argument("--episodes", type=int,
                   help="episodes (one per parallel env); default 10, or 1 with --video")
    e.add_argument("--stochastic", action="store_true",
                   help="sample actions instead of taking the most likely one")
    e.add_argument("--seed", type=int, default=0, help="seed of the eval envs (and sampling)")
    e.add_argument("--max-steps", type=int, help="bound on an episode (default: the env's limit)")
    e.add_argument("--seed-index", type=int,
                   help="evaluate only this seed of a multi-seed run (member of a sweep); "
                        "default: every seed, each and mean ± std over seeds")
    e.add_argument("--env", metavar="MODULE:CLASS",
                   help="the env, for a run of a custom env that config.yaml names only by name")
    e.add_argument("--no-imports", action="store_true", help=NO_IMPORTS_HELP)
    e.add_argument("--best", action="store_true",
                   help="the best-evaluated params (RUN_DIR/best/, kept when the run has "
                        "eval_every) instead of the newest")
    e.add_argument("--json", action="store_true",
                   help="print the result as JSON (a multi-seed run: per_seed and aggregate)")
    e.add_argument("--video", metavar="OUT.gif|OUT.mp4",
                   help="instead, play --episodes episodes one after the other and write them as "
                        "a video (classic-control, MinAtar, and JaxMARL's MPE and Overcooked "
                        "envs; .mp4 needs ffmpeg)")

    x = sub.add_parser("export", help="write the trained policy as a jax.export function or ONNX")
    x.add_argument("run", help="run folder")
    x.add_argument("--format", required=True, choices=("jax", "onnx"),
                   help="jax: serialized jax.export (needs only jax to run); onnx: needs "
                        "pip install 'jaxppo[export]'")
    x.add_argument("-o", "--output", help="file to write (default RUN_DIR/<run folder name>"
                                          ".jaxexport or .onnx); a JSON description goes to "
                                          "<file>.json")
    x.add_argument("--seed-index", type=int, default=0,
                   help="which seed of a multi-seed run (default 0)")
    x.add_argument("--stochastic", action="store_true",
                   help="also write the sampling variant, to <stem>.sample<suffix>")
    x.add_argument("--env", metavar="MODULE:CLASS",
                   help="the env, for a run of a custom env that config.yaml names only by name")
    x.add_argument("--no-imports", action="store_true", help=NO_IMPORTS_HELP)

    p = sub.add_parser("plot", help="plot return curves of one or more run folders")
    p.add_argument("runs", nargs="+", help="run folders (or metrics.jsonl files)")
    p.add_argument("-o", "--output",
                   help="image file to write (default: RUN_DIR/curves.png for one run folder, "
                        "else curves.png in the current folder)")
    p.add_argument("--smooth", type=int, default=1, metavar="N",
                   help="a moving average of the last N iterations of each seed's training "
                        "return (default 1: none)")

    v = sub.add_parser(
        "envs", help="list the environments: gymnax's with their spaces, the other suites, "
        "tuned configs",
        description="Without --suite: every gymnax env (observation and action space, whether "
                    "a tuned config ships), then the other suites (how each is named and "
                    "trains, whether it is installed, else its install line) and their tuned "
                    "configs. With --suite: every env name of that suite.")
    v.add_argument("--suite", choices=[s.prefix for s in SUITE_CATALOG],
                   help="list this suite's env names, as an env names them (imports the suite)")
    v.add_argument("--names", action="store_true",
                   help="only the names, one per line (gymnax's, or --suite's)")


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C outside a run (which answers signals itself)
        print("\nstopped (Ctrl-C)", file=sys.stderr)
        return 130


_COLOUR_CODE = re.compile(r"\x1b\[[0-9;]*m")


def _note(message, *_args, **_kwargs) -> str:
    """A library's warning (e.g. a total_timesteps that is not a whole number of batches) as a
    one-line note, not Python's file:line form, without a terminal's colour codes (gymnasium
    colours its own)."""
    return "note: " + _COLOUR_CODE.sub("", str(message)) + "\n"


def _main(argv: list[str] | None) -> int:
    args = _build_parser().parse_args(argv)
    warnings.formatwarning = _note
    if args.command == "envs":
        return _envs(args)
    if args.command == "plot":
        missing = [r for r in args.runs if not Path(r).exists()]
        if missing:
            print(f"error: run folder {missing[0]!r} does not exist", file=sys.stderr)
            return 2
        no_metrics = [r for r in args.runs
                      if Path(r).is_dir() and not (Path(r) / "metrics.jsonl").exists()]
        if no_metrics:
            print(f"error: {no_metrics[0]} has no metrics.jsonl; is it a run folder?", file=sys.stderr)
            return 2
        for r in args.runs:
            try:
                rows = read_metrics(r)
            except (ValueError, UnicodeDecodeError, OSError) as e:
                print(f"error: {r} is not a jaxppo metrics file ({str(e)[:120]})", file=sys.stderr)
                return 2
            try:
                sweep.read_record(r)
            except CheckpointError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            if not any(isinstance(row, dict) and "env_steps" in row for row in rows):
                print(f"error: {r} holds no metric rows (an empty or foreign file; a run "
                      "writes one row per iteration)", file=sys.stderr)
                return 2
            problem = unplottable(rows)
            if problem:
                print(f"error: {r} is not a jaxppo metrics file: {problem}", file=sys.stderr)
                return 2
            problem = order_problem(r)
            if problem:
                print(f"error: {problem}. Nothing was drawn.", file=sys.stderr)
                return 2
        if args.smooth < 1:
            print(f"error: --smooth {args.smooth} must be >= 1 (iterations averaged; 1 = no "
                  "smoothing)", file=sys.stderr)
            return 2
        given = args.output is not None
        if not given:  # one run folder: into it; several: the current folder
            one = Path(args.runs[0])
            args.output = str((one if one.is_dir() else one.parent) / "curves.png"
                              if len(args.runs) == 1 else "curves.png")
        problem = next(filter(None, (
            output_problem(Path(r) if Path(r).is_dir() else Path(r).parent, args.output)
            for r in args.runs)), None) or _output_problem(Path(args.output))
        if problem:
            flag = f"-o {args.output}" if given else f"the default output {args.output} (-o PATH)"
            print(f"error: {flag}: {problem}", file=sys.stderr)
            return 2
        try:
            out = plot_runs(args.runs, args.output, smooth=args.smooth)
        except OSError as e:
            print(f"error: could not write {args.output}: {e.strerror or e}", file=sys.stderr)
            return 1
        print(f"wrote {out.resolve()}")
        return 0
    if args.command == "eval":
        if args.video:
            return _video(args)
        if args.episodes is None:
            args.episodes = 10
        return _eval(args)
    if args.command == "export":
        return _export(args)
    return _train(args)


def _envs(args) -> int:
    if args.suite:
        try:
            print(suite_table(args.suite, names_only=args.names))
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    elif args.names:
        print("\n".join(registered_env_names()))
    else:
        print(f"{gymnax_table()}\n\n{suites_table()}")
    return 0


def _output_problem(out: Path) -> str | None:
    """Why the figure cannot be written to `out` (checked before anything is drawn)."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if out.is_dir():
        return f"is a folder; give a file name, e.g. -o {out / 'curves.png'}"
    if not out.parent.is_dir():
        return f"the folder {out.parent} does not exist; create it or choose another path"
    if out.suffix.lower().lstrip(".") not in formats:
        return (f"{out.suffix or 'no extension'} is not an image format matplotlib writes; use "
                f"one of {', '.join('.' + f for f in sorted(formats))}, e.g. -o curves.png")
    return None


def _eval_flag_problem(args) -> str | None:
    """A flag of `jaxppo eval` that no run can take (checked before the run is loaded)."""
    if args.episodes < 1:
        return f"--episodes {args.episodes} must be >= 1"
    if args.max_steps is not None and not 1 <= args.max_steps <= MAX_TIMESTEPS:
        return (f"--max-steps {args.max_steps}: max_steps={args.max_steps} must be an integer "
                f">= 1 and at most {MAX_TIMESTEPS} (2**31 - 1); leave --max-steps out for the "
                "env's time limit")
    if args.seed_index is not None and args.seed_index < 0:
        return f"--seed-index {args.seed_index} must be >= 0 (0 is the first seed)"
    try:
        check_seed(args.seed, "--seed")
    except ConfigError as e:
        return str(e).replace("--seed=", "--seed ", 1)
    return None


def _eval(args) -> int:
    """Evaluates every seed of the run (each, and mean ± std over seeds), or --seed-index's."""
    problem = _eval_flag_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        if args.seed_index is None:
            policies = load_policies(args.run, env=args.env, trust_config=not args.no_imports,
                                     best=args.best)
        else:
            policies = [load_policy(args.run, seed_index=args.seed_index, env=args.env,
                                    trust_config=not args.no_imports, best=args.best)]
        record = sweep.read_record(args.run)
        results = evaluate_policies(policies, episodes=args.episodes, seed=args.seed,
                                    deterministic=not args.stochastic, max_steps=args.max_steps)
    except (CheckpointError, ConfigError, ValueError) as e:
        # The library names its arguments; say which flag set them.
        flag = next((f"{flag} {value}: " for name, flag, value in (
            ("seed_index=", "--seed-index", args.seed_index), ("episodes=", "--episodes", args.episodes))
            if str(e).startswith(name)), "")
        print(f"error: {flag}{e}", file=sys.stderr)
        return 2
    policy = policies[0]
    indices = range(len(policies)) if args.seed_index is None else [args.seed_index]
    per_seed = [_eval_seed(out, i, record) for i, out in zip(indices, results)]
    run = {"run": str(args.run), "env": policy.config.env_name, "iteration": policy.iteration,
           "deterministic": not args.stochastic, "seed": args.seed}
    where = f"checkpoint iteration {policy.iteration}" if policy.iteration is not None else "params.msgpack"
    if args.best:
        where = f"best evaluation, iteration {policy.iteration} (best/)"
    how = f"{'stochastic' if args.stochastic else 'deterministic'} policy, seed {args.seed}"
    if len(per_seed) > 1:
        aggregate = _over_seeds(per_seed)
        if args.json:
            print(json.dumps({**run, "episodes": args.episodes, "seeds": len(per_seed),
                              "aggregate": aggregate, "per_seed": per_seed}))
            return 0
        print(f"{run['env']} ({args.run}, {where}): {len(per_seed)} seeds, {args.episodes} "
              f"episodes each ({how})")
        for out in per_seed:
            print(f"  seed {out['seed_index']}{_member(out)}: " + _figures(out))
        print(f"  over the {len(per_seed)} seeds (mean ± std of their means): "
              + _figures(aggregate))
        return 0
    out = {**per_seed[0], **run, "seed_index": per_seed[0]["seed_index"]}
    for key in ("member", "hparams"):  # after the run's fields, as before
        if key in out:
            out[key] = out.pop(key)
    if args.json:
        print(json.dumps(out))
        return 0
    if policy.config.num_seeds > 1:
        where = f"seed index {out['seed_index']}, {where}"
    print(f"{out['env']}{_member(out)} ({args.run}, {where}): {_figures(out)} over "
          f"{out['episodes']} episodes ({how})")
    return 0


def _eval_seed(out: dict, seed_index: int, record: dict | None) -> dict:
    """One seed's evaluation, with its index and, for a sweep's member, its label and
    hyperparameters."""
    out = {"seed_index": seed_index, **out}
    if record is not None and seed_index < len(record["labels"]):
        out.update(member=record["labels"][seed_index], hparams=record["hparams"][seed_index])
    return out


def _over_seeds(per_seed: list[dict]) -> dict:
    """Mean and std over seeds of the seeds' mean return and length."""
    agg = {"seeds": len(per_seed)}
    for name in ("return", "length"):
        means = np.array([out[f"{name}_mean"] for out in per_seed], np.float64)
        agg[f"{name}_mean"], agg[f"{name}_std"] = float(means.mean()), float(means.std())
    return agg


def _member(out: dict) -> str:
    return f" [{out['member']}]" if "member" in out else ""


def _figures(out: dict) -> str:
    """The evaluation in words; a multi-agent run's return is the team's, then each agent's
    mean return, the win rate where the env reports wins and the env's episode values
    (Overcooked's sparse return and dishes)."""
    team = "team " if "agent_return_mean" in out else ""
    text = (f"{team}return {out['return_mean']:.2f} ± {out['return_std']:.2f}, length "
            f"{out['length_mean']:.1f} ± {out['length_std']:.1f}")
    if team:
        text += " (" + ", ".join(f"{a} {v:.2f}" for a, v in out["agent_return_mean"].items()) + ")"
    if "win_rate" in out:
        text += f", win rate {out['win_rate']:.2f}"
    for name, v in out.get("episode_value_mean", {}).items():
        text += f", {name.replace('_', ' ')} {v:.2f}"
    return text


def _video(args) -> int:
    from jaxppo.run.video import write_video

    try:
        policy = load_policy(args.run, seed_index=args.seed_index or 0, env=args.env,
                             trust_config=not args.no_imports, best=args.best)
        episodes = 1 if args.episodes is None else args.episodes
        out = write_video(policy, args.video, episodes=episodes, seed=args.seed,
                          deterministic=not args.stochastic, max_steps=args.max_steps)
    except (CheckpointError, ConfigError, VideoError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out))
    else:
        print(f"wrote {out['path']}: {out['frames']} frames, {out['episodes']} episode(s), returns "
              f"{', '.join(f'{r:.1f}' for r in out['returns'])}")
    return 0


def _export(args) -> int:
    from jaxppo.run.export import export_policy

    try:
        out = export_policy(args.run, args.format, args.output, stochastic=args.stochastic,
                            seed_index=args.seed_index, env=args.env,
                            trust_config=not args.no_imports)
    except (CheckpointError, ConfigError, ExportError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    written = [out.path] + ([out.sample_path] if out.sample_path else []) + [out.metadata_path]
    print("wrote " + ", ".join(map(str, written)))
    return 0


def _train_on_hosts(args) -> int:
    """`train --hosts H` (and `search --hosts H`): the multi-host driver, on these flags."""
    # Imported here only: the multi-host entry point loads Ray, which nothing else needs.
    from jaxppo.distributed.launch import HostOptions, train_from_command

    return train_from_command(args, HostOptions(hosts=args.hosts, address=args.address),
                              search=args.command == "search")


def _train(args) -> int:
    searching = args.command == "search"
    if searching and args.population is not None:  # --population N: search.population=N
        args.overrides = [*(args.overrides or []), f"search.population={args.population}"]
    if args.hosts is not None:
        return _train_on_hosts(args)
    if args.address is not None:
        return command.fail(ConfigError(
            f"--address {args.address} names a Ray cluster to train on, which only --hosts H "
            "does: add --hosts H (the number of nodes), or leave --address out"))
    try:
        config, source, run_dir = command.start(args, "-search" if searching else "")
        if searching and not args.resume:
            config = command.searched(config)
    except (ConfigError, CheckpointError) as e:
        return command.fail(e)
    print(f"config: {source}; run folder: {run_dir}", file=sys.stderr)
    # SIGINT/SIGTERM: the first stops after the running chunk, a second at once (exit 130/143).
    with StopSignals(exit_at_once=True, command=f"jaxppo {args.command}"):
        try:
            result = train(config, run_dir=None if args.resume else run_dir,
                           resume=run_dir if args.resume else None,
                           progress=False if args.no_progress else None,
                           stop_after_iterations=args.stop_after, plot=not args.no_plot)
        except TrainingInterrupted as e:
            return command.interrupted(e)
        except (TrainingDivergedError, RunFolderError, RolloutTimeoutError) as e:
            return command.fail(e, 1)
        except (ConfigError, CheckpointError) as e:
            return command.fail(e)
    code = command.report(result, resume_command=f"jaxppo {args.command} --resume {run_dir}")
    if result.completed and result.config.search is not None:
        rec = json.loads((run_dir / "search.json").read_text())
        best = rec["best"]
        values = ", ".join(f"{k}={v:.4g}" for k, v in best["hparams"].items())
        score = best.get(f"{rec['metric']}_mean")
        print(f"best of {len(rec['settings'])} settings: {values} ({rec['metric']} "
              f"{'n/a' if score is None else f'{score:.1f}'}); as a config: "
              f"{run_dir / 'best.yaml'}", file=sys.stderr)
    return code
