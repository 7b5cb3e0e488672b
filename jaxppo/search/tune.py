"""Ray Tune drives jaxppo: `jaxppo.tune.trainable(base)` is a Tune function trainable, each
trial a jaxppo run in its trial directory, reporting after every chunk and checkpointing the
run folder, so a restored trial (a PBT exploit) resumes bit-exactly. Needs
`pip install 'jaxppo[tune]'`; `import jaxppo` does not import Ray.

    tuner = tune.Tuner(
        jaxppo.tune.trainable(jaxppo.PPOConfig.tuned("CartPole-v1", total_timesteps=100_000)),
        param_space={"lr": tune.loguniform(1e-4, 1e-2), "clip_param": tune.uniform(0.1, 0.3)},
        tune_config=tune.TuneConfig(metric="episode_return_mean", mode="max", num_samples=8,
                                    reuse_actors=True))
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np

from jaxppo.config import PPOConfig
from jaxppo.errors import ConfigError
from jaxppo.run.train import train

INSTALL = "pip install 'jaxppo[tune]'"
RUN_FOLDER = "jaxppo-run"  # the trial's run folder, inside its Tune trial directory


def _import_tune():
    try:
        from ray import tune
    except ImportError as e:
        raise ConfigError(f"jaxppo.tune needs Ray Tune ({type(e).__name__}: {e}): {INSTALL}") from None
    return tune


def _base_config(base) -> PPOConfig:
    if isinstance(base, PPOConfig):
        return base.validate()
    if isinstance(base, dict):
        return PPOConfig.from_dict(base).validate()
    if isinstance(base, (str, Path)):
        return PPOConfig.from_file(base).validate()
    raise ConfigError(f"jaxppo.tune.trainable(base): base is {type(base).__name__}; give a "
                      "PPOConfig, a dict of config fields or the path of a config file")


def trial_config(base: PPOConfig, params: dict) -> PPOConfig:
    """`base` with a trial's values on top.

    Args:
      base: the validated base config.
      params: config field names, "network.<field>" for the network's, nested dicts as
        they are.

    Returns:
      The trial's PPOConfig; its values are validated once, where the trial's run resolves
      it (`jaxppo.resolve`).

    Raises:
      ConfigError: an unknown name.
    """
    values: dict[str, Any] = {}
    for key, value in params.items():
        if not isinstance(key, str):
            raise ConfigError(f"a Tune param_space key must be a config field name, got {key!r}")
        if key.startswith("network."):
            values.setdefault("network", {})[key[len("network."):]] = value
        else:
            values[key] = value.item() if hasattr(value, "item") else value
    return PPOConfig.from_dict(values, base)


def _report(rows: list[dict]) -> dict:
    """One Tune report from a chunk's metric rows (every seed of every iteration)."""
    last = max(r["iteration"] for r in rows)
    returns = [r["episode_return_mean"] for r in rows if math.isfinite(r["episode_return_mean"])]
    out = {"iteration": last, "env_steps": int(rows[-1]["env_steps"]), "sps": rows[-1]["sps"],
           "episode_return_mean": float(np.mean(returns)) if returns else float("nan")}
    evals = [r["eval_return_mean"] for r in rows
             if math.isfinite(r.get("eval_return_mean", float("nan")))]
    if evals:
        out["eval_return_mean"] = float(np.mean(evals))
    return out


def trainable(base, *, checkpoint_every: int | None = None) -> Callable[[dict], None]:
    """A Tune function trainable that trains `base` with each trial's values on top.

    A trial's values are config field names ("network.x" for network fields; "num_seeds"
    trains several seeds, or a vmapped slice of a population, per trial). Each trial trains in
    a run folder inside its trial directory and reports to Tune after every chunk
    (`log_every` iterations): `episode_return_mean` (over the chunk's iterations and the
    trial's seeds), `eval_return_mean` when the chunk evaluated, `iteration`, `env_steps` and
    `sps`. Every `checkpoint_every` iterations the report carries a Tune checkpoint, the run
    folder with a complete jaxppo checkpoint; a trial Tune restores (a PBT/PB2 exploit, a
    restart) resumes it bit-exactly with the trial's current values (tunable fields only, not
    those that shape the program). `reuse_actors=True` lets a trial train in a worker process
    that already has JAX imported.

    Args:
      base: a PPOConfig, a dict of config fields, or the path of a config file.
      checkpoint_every: iterations between Tune checkpoints (default: a tenth of the run, at
        least one chunk).

    Returns:
      The trainable, `run(params: dict) -> None`.

    Raises:
      ConfigError: base or checkpoint_every is not valid.
    """
    base = _base_config(base)
    if checkpoint_every is not None and (not isinstance(checkpoint_every, int)
                                         or checkpoint_every < 1):
        raise ConfigError(f"checkpoint_every={checkpoint_every!r} must be an integer >= 1 "
                          "(iterations between Tune checkpoints), or None")

    def run(params: dict) -> None:
        tune = _import_tune()
        config = trial_config(base, params or {})
        run_dir = Path(tune.get_context().get_trial_dir()) / RUN_FOLDER
        every = checkpoint_every or max(1, config.num_iterations // 10)
        restored = tune.get_checkpoint()
        if run_dir.exists():  # a restart: start again from Tune's checkpoint, or afresh
            shutil.rmtree(run_dir)
        resume = None
        if restored is not None:
            with restored.as_directory() as d:
                shutil.copytree(d, run_dir)
            resume = run_dir
        pending: list[dict] = []

        def report_chunk(rows):
            if pending:  # the one before: the last chunk of a segment goes with its checkpoint
                tune.report(pending.pop())
            pending.append(_report(rows))

        while True:
            result = train(config, run_dir=None if resume else run_dir, resume=resume,
                           stop_after_iterations=every, callback=report_chunk, progress=False,
                           plot=False)
            # train() returned: the folder is closed, its newest checkpoint complete
            metrics = pending.pop() if pending else {  # nothing left to run: the summary's
                "iteration": result.iterations_done,
                "episode_return_mean": result.summary["final_return_mean"]}
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(str(run_dir)))
            if result.completed:
                return
            resume = run_dir

    run.__name__ = f"jaxppo_{base.env_name.replace('-', '_')}"
    return run
