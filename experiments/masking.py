"""Invalid-action masking: the same PPO with and without the env's action mask, on two envs
where an illegal action ends the episode, curves and final returns side by side.

    .venv/bin/python experiments/masking.py                  # both envs, 2 seeds
    .venv/bin/python experiments/masking.py --seeds 4 --steps-scale 2

* PickLegal (jaxppo.examples.envs): 3 of 8 actions legal each step, each paying U[0, 1);
  an illegal one pays -1 and ends the episode; 16 steps; optimum 12 (the best legal action
  every step), uniform over the legal actions 8.
* Minesweeper (jumanji:Minesweeper-v0) on a 5x5 board with 3 mines: revealing an open
  square is illegal (Jumanji's penalty and the end of the episode), as is a mine; 22 (every
  safe square) bounds the return from above (some boards need a guess).

Writes experiments/results/masking.json (per env and variant: the return curve per seed, the
final return (mean of the last 10 iterations), env steps, wall seconds — not a speed figure:
the variants run one after the other, not side by side) and masking.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import numpy as np

import jaxppo

RESULTS = Path(__file__).resolve().parent / "results"


def minesweeper_config(steps: float, seeds: int) -> jaxppo.PPOConfig:
    from jumanji.environments.logic.minesweeper.generator import UniformSamplingGenerator

    return jaxppo.PPOConfig(
        env="jumanji:Minesweeper-v0",
        env_kwargs={"generator": UniformSamplingGenerator(num_rows=5, num_cols=5, num_mines=3)},
        num_envs=64, num_steps=32, total_timesteps=int(steps), lr=1e-3, gamma=0.9,
        num_seeds=seeds, network=jaxppo.NetworkConfig((128, 128)), compilation_cache_dir=None)


def pick_legal_config(steps: float, seeds: int) -> jaxppo.PPOConfig:
    return jaxppo.PPOConfig(env="jaxppo.examples.envs:PickLegal", num_envs=16, num_steps=32,
                            total_timesteps=int(steps), lr=1e-3, gamma=0.5, num_seeds=seeds,
                            compilation_cache_dir=None)


ENVS = {"PickLegal": (pick_legal_config, 1e5, 12.0),
        "Minesweeper-5x5-3mines": (minesweeper_config, 1e6, 22.0)}
BOUND_LABEL = {"PickLegal": "optimum", "Minesweeper-5x5-3mines": "every safe square (bound)"}


def run(name: str, seeds: int, scale: float) -> dict:
    make, steps, optimum = ENVS[name]
    out = {"optimum": optimum}
    for masked in (True, False):
        cfg = make(steps * scale, seeds).replace(mask_actions=masked)
        t0 = time.perf_counter()
        result = jaxppo.train(cfg, progress=False, plot=False)
        wall = time.perf_counter() - t0
        returns = np.asarray(result.metrics["episode_return_mean"]).reshape(seeds, -1)
        steps_axis = np.asarray(result.metrics["env_steps"]).reshape(seeds, -1)[0]
        finals = [float(np.nanmean(r[-10:])) for r in returns]
        out["masked" if masked else "unmasked"] = {
            "env_steps": steps_axis.tolist(), "returns": np.round(returns, 3).tolist(),
            "final_return_mean": float(np.mean(finals)), "final_return_std": float(np.std(finals)),
            "wall_seconds": round(wall, 1), "config": cfg.to_dict() if name == "PickLegal" else
            {k: v for k, v in cfg.to_dict().items() if k != "env_kwargs"},
        }
        print(f"{name} {'masked' if masked else 'unmasked'}: final return "
              f"{np.mean(finals):.2f} ± {np.std(finals):.2f} over {seeds} seeds "
              f"(optimum {optimum}), {wall:.0f} s", flush=True)
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4))
    for ax, (name, res) in zip(np.atleast_1d(axes), results.items()):
        for variant, color in (("masked", "tab:blue"), ("unmasked", "tab:red")):
            x = np.asarray(res[variant]["env_steps"])
            y = np.asarray(res[variant]["returns"], float)
            ax.plot(x, np.nanmean(y, axis=0), color=color, label=f"{variant} (mean of {len(y)} seeds)")
            ax.fill_between(x, np.nanmin(y, axis=0), np.nanmax(y, axis=0), color=color, alpha=0.2)
        ax.axhline(res["optimum"], color="gray", ls="--", label=BOUND_LABEL.get(name, "optimum"))
        ax.set_title(name)
        ax.set_xlabel("env steps")
        ax.set_ylabel("episode return")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps-scale", type=float, default=1.0)
    ap.add_argument("--env", nargs="*", default=list(ENVS), choices=list(ENVS))
    ap.add_argument("--plot-only", action="store_true", help="redraw masking.png from masking.json")
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads((RESULTS / "masking.json").read_text())["envs"], RESULTS / "masking.png")
        return
    results = {name: run(name, args.seeds, args.steps_scale) for name in args.env}
    cpu = subprocess.run(["sh", "-c", "lscpu | grep 'Model name'"], capture_output=True,
                         text=True).stdout.split(":")[-1].strip()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "masking.json").write_text(json.dumps(
        {"machine": {"cpu": cpu, "python": platform.python_version()}, "envs": results}, indent=1))
    plot(results, RESULTS / "masking.png")
    print(f"wrote {RESULTS / 'masking.json'} and {RESULTS / 'masking.png'}")


if __name__ == "__main__":
    main()
