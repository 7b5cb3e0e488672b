"""What `jaxppo train` and `python -m jaxppo.distributed` share: the config flags, the config
and run folder they give, and the lines that close a run."""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from pathlib import Path

from jaxppo.run.checkpoints import load_run_config, newest_record
from jaxppo.config import PPOConfig
from jaxppo.config_fields import keys as config_keys
from jaxppo.config_files import read_config_file
from jaxppo.envs.catalog import lacks_env, tuned_start
from jaxppo.envs.make import (check_env_name, check_recorded_env, is_gymnax_name, make_env,
                              refuse_imports)
from jaxppo.errors import CheckpointError, ConfigError
from jaxppo.program.resolved import check_backend
from jaxppo.search.space import SEARCH_EXAMPLE
from jaxppo.run.files import name_too_long
from jaxppo.run.folder import fresh_run_dir

PRECEDENCE = ("defaults < the packaged tuned config of the env (unless --defaults) < --config "
              "file < --set pairs")


def add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--env", help="gymnax env name, e.g. CartPole-v1; another suite's env by "
                                 "prefix (brax:<name>, jumanji:<Id>, craftax:<name>, "
                                 "xminigrid:<name>, jaxmarl:<name>, gymnasium:<id>, "
                                 "envpool:<task>); or "
                                 "module:Class of your own env (overrides the file's env)")
    p.add_argument("--config", help="YAML or JSON file of PPOConfig fields")
    p.add_argument("--defaults", action="store_true",
                   help="start from the library defaults, not the env's tuned config")
    p.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[],
                   metavar="KEY=VALUE",
                   help="override config fields, e.g. --set lr=3e-4 num_envs=8 "
                        "network.hidden_sizes=[128,128]")
    p.add_argument("--seeds", type=int, help="shortcut for --set num_seeds=N")
    p.add_argument("--stop-at-return", type=float, metavar="R",
                   help="shortcut for --set stop_at_return=R: stop once the return (the eval "
                        "return with eval_every; mean over seeds) reaches R")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue RUN_DIR from its newest checkpoint, with its config.yaml; --set "
                        "may change fields such as total_timesteps (to extend the run), not shapes")
    p.add_argument("--no-imports", action="store_true",
                   help="refuse a --config file's or --resume folder's env that names a module "
                        "to import (module:Class), and use none of a --config file's paths of "
                        "this machine (compilation cache, W&B dir): for files and run folders "
                        "you did not write")
    p.add_argument("--stop-after", type=int, metavar="N",
                   help="stop after N iterations of this call (a checkpoint is written); "
                        "continue later with --resume")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress output (no bar, no line per chunk); the final lines stay. "
                        "Without a terminal, progress is a plain line per chunk")
    p.add_argument("--no-plot", action="store_true", help="skip curve.png")


def config_keys_help() -> str:
    """Every config key with its default and what it means, for `train --help`: from each
    field's declaration in jaxppo/config.py."""
    out = ["config keys (--set KEY=VALUE, or a --config YAML/JSON file; docs/configuration.md "
           "has more):"]
    for section, key, default, meaning in config_keys(PPOConfig):
        if section:
            out.append(f"  {section}:")
        out.append(f"    {key} = {_shown(default)}" + (f"  -- {meaning}" if meaning else ""))
    return "\n".join(out)


def _shown(value) -> str:
    """A default as YAML would write it: true, null, [64, 64]."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(list(value)) if isinstance(value, tuple) else str(value)


def _given(args) -> list[str]:
    """The keys --set gives (wandb.dir=... as given)."""
    return [o.split("=", 1)[0].strip() for o in _overrides(args)]


def _overrides(args) -> list[str]:
    return (list(args.overrides) + ([f"num_seeds={args.seeds}"] if args.seeds is not None else [])
            + ([f"stop_at_return={args.stop_at_return}"] if args.stop_at_return is not None
               else []))


def new_config(args) -> tuple[PPOConfig, str]:
    """(config, where it came from) of a new run: defaults < the env's tuned config < --config
    < --set, the env being --env or the --config file's."""
    if args.env is not None and not args.env.strip():
        raise ConfigError("--env '' is empty; give an env name, e.g. --env CartPole-v1 "
                          "(`jaxppo envs --names` lists them), or module:Class of your own env")
    file_values = read_config_file(args.config) if args.config else {}
    if args.no_imports and not args.env:
        refuse_imports(file_values.get("env"), args.config, (
            "Give the env yourself with --env, or, if you trust the file, leave out --no-imports"))
    if args.no_imports:
        refuse_imports(None, args.config, "Remove network.module from the file, or, if you "
                       "trust the file, leave out --no-imports", network=file_values.get("network"))
    env = args.env or file_values.get("env")
    config, sources = PPOConfig(), ["defaults"]
    tuned = tuned_start(env) if isinstance(env, str) and not args.defaults else None
    if tuned is not None:
        config = PPOConfig.from_file(tuned.path, config)
        sources.append(f"tuned {tuned.env}" + (f" ({tuned.why})" if tuned.why else ""))
    if args.config:
        config = PPOConfig.from_dict(file_values, config)
        sources.append(args.config)
        if args.no_imports:
            config = config.machine_paths_from(args.config, _given(args))
    if args.env:
        config = config.replace(env=args.env)
    overrides = _overrides(args)
    if overrides:
        config = config.with_overrides(overrides)
        sources.append("--set")
    return config, " < ".join(sources)


def resumed_config(args) -> tuple[PPOConfig, Path]:
    """The config of a run folder being resumed: its config.yaml, then --set pairs."""
    clashing = [flag for flag, given in (("--config", args.config), ("--env", args.env),
                                         ("--defaults", args.defaults), ("--run-name", args.run_name))
                if given]
    if clashing:
        raise ConfigError(
            f"{clashing[0]} cannot be combined with --resume: a resumed run keeps its folder and "
            "its config.yaml; change fields with --set (e.g. --set total_timesteps=1000000)")
    run_dir = Path(args.resume)
    if not run_dir.is_dir():
        raise CheckpointError(f"run folder {run_dir} does not exist; check the path")
    overrides = _overrides(args)
    config = load_run_config(run_dir, newest_record(run_dir), given=_given(args))
    if args.no_imports:
        refuse_imports(config.env, str(run_dir / "config.yaml"), network=config.network, fix=(
            "Resume from Python with the env: jaxppo.train(jaxppo.PPOConfig.from_file("
            f"{str(run_dir / 'config.yaml')!r}).replace(env=YourEnv()), resume={str(run_dir)!r}), "
            f"or, if you trust {run_dir}, leave out --no-imports"))
    check_recorded_env(config, run_dir, (
        "The command line cannot resume it; resume from Python with the env: jaxppo.train("
        f"jaxppo.PPOConfig.from_file({str(run_dir / 'config.yaml')!r}).replace(env=YourEnv()), "
        f"resume={str(run_dir)!r})"))
    if overrides:
        config = config.with_overrides(overrides)
    return config, run_dir


def start(args, name_tag: str = "") -> tuple[PPOConfig, str, Path]:
    """(config, its source, run folder) from the flags: --resume's folder, or a new
    runs_dir/<run-name or env[-tag]-time>. ConfigError / CheckpointError otherwise. The
    config is validated where the run resolves it (`jaxppo.resolve`), once; only a gymnax
    name that is not registered (a typo) is refused here, before the run folder is named."""
    if args.stop_after is not None and args.stop_after < 1:
        raise ConfigError(f"--stop-after {args.stop_after} must be >= 1")
    name = args.run_name
    if name is not None and (not name.strip() or name in (".", "..") or "/" in name
                             or (os.altsep is not None and os.altsep in name)):
        raise ConfigError(
            f"--run-name {name!r} must be a plain folder name (not empty, '.' or '..', no "
            "'/'): the run folder is --runs-dir/NAME, e.g. --runs-dir runs/sweep --run-name lr-3e-4")
    if args.resume:
        config, run_dir = resumed_config(args)
        return config, f"{run_dir / 'config.yaml'} (resumed)", run_dir
    config, source = new_config(args)
    if is_gymnax_name(config.env):
        check_backend()  # gymnax's import needs it, and would fail with a bare AssertionError
        check_env_name(config.env)  # a typo is told before a run folder is named
    elif lacks_env(config.env):
        make_env(config)  # so is a suite's: the suite's own error (close names, install line)
    name = args.run_name or f"{config.env_name}{name_tag}-{time.strftime('%Y%m%d-%H%M%S')}"
    too_long = name_too_long(Path(args.runs_dir) / name)
    if too_long:  # before the config's checks, which make no folder but take seconds
        raise ConfigError(f"{too_long}: choose a shorter --run-name (put the details in the "
                          "config, or in --runs-dir folders)")
    return config, source, fresh_run_dir(args.runs_dir, name)



def searched(config: PPOConfig) -> PPOConfig:
    """`jaxppo search`'s config, which must have a `search` (validated with the rest of the
    config when the run resolves it)."""
    if config.search is None:
        raise ConfigError("jaxppo search needs a `search` in the config (a file's `search:` "
                          "or --set 'search={...}'): " + SEARCH_EXAMPLE)
    return config


def fail(err: Exception, code: int = 2) -> int:
    """Print the error (with its notes: what the run folder keeps) and return `code`."""
    print(f"error: {err}", file=sys.stderr)
    for note in getattr(err, "__notes__", ()):
        print(note, file=sys.stderr)
    return code


def interrupted(err) -> int:
    """A run stopped by a signal: what was saved and how to continue; the shell's exit code
    for that signal (130 for SIGINT, 143 for SIGTERM)."""
    print(str(err), file=sys.stderr)
    return 128 + int(getattr(signal, err.signal_name, signal.SIGINT))


def report(result, resume_command: str) -> int:
    """The last lines of a run: stopped early, nothing to do, or done with its summary."""
    config, run_dir, summary = result.config, result.run_dir, result.summary
    if not result.completed:
        why = f": {result.stopped}" if getattr(result, "stopped", None) else ""
        print(f"stopped after iteration {result.iterations_done} of {config.num_iterations}{why} "
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
        f"done: {_final_return(summary)}; "
        + (f"final eval return {ev:.1f}; " if ev is not None and math.isfinite(ev) else "")
        + _steps(summary, result) + f" + {summary['compile_seconds']:.1f}s compile{where}"
        f"{failures}{_run_total(summary, result)}; run folder {run_dir}",
        file=sys.stderr,
    )
    return 0


def _final_return(summary: dict) -> str:
    """'final return 12.3 ± 1.0 (last 10 iterations, 4 seeds)', saying which seeds ended no
    episode in those iterations; one seed's return has no ± (a spread over seeds)."""
    per_seed = summary["final_return_per_seed"]
    ended = sum(math.isfinite(v) for v in per_seed)
    if not ended:
        return "final return n/a (no episode ended in the last 10 iterations)"
    spread = f" ± {summary['final_return_std']:.1f}" if ended > 1 else ""
    seeds = ("" if len(per_seed) == 1 else f", {ended} seeds" if ended == len(per_seed)
             else f", {ended} of {len(per_seed)} seeds; no episode ended on the others")
    return (f"final return {summary['final_return_mean']:.1f}{spread}"
            f" (last 10 iterations{seeds})")


def _steps(summary: dict, result) -> str:
    """This call's env steps, time and speed (all seeds): '4 seeds × 8,192 env steps =
    32,768 in 2.0s (16,384 steps/s in all)', after 'this call: iterations 11-20, ' for a
    resumed run."""
    seeds = summary["num_seeds"]
    steps = _count(seeds, summary["env_steps_this_call"] // seeds)
    speed = (f"in {summary['train_seconds']:.1f}s ({summary['sps']:,.0f} steps/s"
             f"{' in all' if seeds > 1 else ''})")
    if result.resumed_from is None:
        return f"{steps} {speed}"
    return (f"this call: iterations {result.resumed_from + 1}-{result.iterations_done}, "
            f"{steps} {speed}")


def _run_total(summary: dict, result) -> str:
    """'; the run: 4 seeds × 16,384 env steps = 65,536 in 20 iterations' for a resumed run."""
    if result.resumed_from is None:
        return ""
    return (f"; the run: {_count(summary['num_seeds'], summary['env_steps'])} in "
            f"{result.iterations_done} iterations")


def _count(seeds: int, steps_per_seed: int) -> str:
    if seeds == 1:
        return f"{steps_per_seed:,} env steps"
    return f"{seeds} seeds × {steps_per_seed:,} env steps = {steps_per_seed * seeds:,}"
