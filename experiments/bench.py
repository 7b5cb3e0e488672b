"""Single-host benchmark: speed, compile time, time-to-solve and memory on this machine.

    make bench            # or: .venv/bin/python experiments/bench.py [--repeats 3]

Writes experiments/results/bench-<date>.json and prints it. Measures:
  * side by side with PureJaxRL (../shared/bench/side_by_side.py, which runs PureJaxRL's own
    ppo.py from ../shared/anchors/purejaxrl next to `jaxppo.make_train` at the same config,
    alternating fresh processes): the ratios jaxppo / PureJaxRL of steps/s, compile, whole
    process, import and peak memory, at PureJaxRL's CartPole config and at Breakout-MinAtar
    with 64 envs. Skipped, with a message, where ../shared/anchors is absent (a user's clone);
  * PureJaxRL's CartPole config exactly (4 envs x 128 steps, 4 epochs x 4 minibatches,
    64-64 tanh, 5e5 steps): steps/s of the compiled run and compile seconds, cold (empty
    persistent cache) and warm, each in a fresh process, `--repeats` times;
  * env-only throughput at the same env count (random actions, same scan structure): the
    ceiling training could reach, and training steps/s as a fraction of it;
  * `make train ENV=CartPole-v1` as a user runs it: seconds from launching make to the first
    metrics row whose 10-iteration mean return is >= 475, with a cold and with a warm
    compile cache, plus the whole process's wall time and peak RSS.
Numbers vary with machine load: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
RESULTS = ROOT / "experiments" / "results"

PUREJAXRL_CARTPOLE = [
    "num_envs=4", "num_steps=128", "num_epochs=4", "num_minibatches=4", "total_timesteps=500000",
    "lr=2.5e-4", "lr_schedule=linear", "gamma=0.99", "gae_lambda=0.95", "clip_param=0.2",
    "entropy_coeff=0.01", "vf_coeff=0.5", "max_grad_norm=0.5", "network.hidden_sizes=[64,64]",
    "network.activation=tanh",
]


def _rolling_first(rows: list[dict], threshold: float = 475.0, window: int = 10):
    """Index of the first row whose mean over the last `window` finite returns >= threshold."""
    recent: list[float] = []
    for i, row in enumerate(rows):
        r = row.get("episode_return_mean")
        if r is not None:
            recent.append(r)
        tail = [x for x in recent[-window:]]
        if len(tail) >= 1 and sum(tail) / len(tail) >= threshold and len(recent) >= window:
            return i
    return None


def _train_process(args: list[str], cache_dir: str, runs_dir: str, via_make: bool = False):
    """Run a training process; watch metrics.jsonl as it grows. Returns measurements."""
    name = f"bench-{time.time_ns()}"
    if via_make:
        extra = " ".join([f"--runs-dir {runs_dir}", f"--run-name {name}", "--no-progress",
                          f"--set compilation_cache_dir={cache_dir}"] + args)
        cmd = ["make", "--no-print-directory", "-C", str(ROOT), "train", "ENV=CartPole-v1",
               f"ARGS={extra}"]
    else:
        cmd = [PY, "-m", "jaxppo", "train", "--env", "CartPole-v1", "--runs-dir", runs_dir,
               "--run-name", name, "--no-progress", "--set", f"compilation_cache_dir={cache_dir}",
               *args]
    metrics = Path(runs_dir) / name / "metrics.jsonl"
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    solved_at = None
    seen = 0
    rows: list[dict] = []
    rusage = None
    while rusage is None:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            rusage, proc.returncode = usage, os.waitstatus_to_exitcode(status)
            break
        if solved_at is None and metrics.exists():
            lines = metrics.read_text().splitlines()
            if len(lines) > seen:
                rows = [json.loads(x) for x in lines if x.strip()]
                seen = len(lines)
                idx = _rolling_first(rows)
                if idx is not None:
                    solved_at = time.perf_counter() - t0
        time.sleep(0.01)
    total = time.perf_counter() - t0
    out = proc.stdout.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out[-3000:]}")
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    idx = _rolling_first(rows)
    summary = json.loads((metrics.parent / "summary.json").read_text())
    return {
        "seconds_to_return_475": solved_at,
        "env_steps_to_return_475": rows[idx]["env_steps"] if idx is not None else None,
        "process_wall_seconds": total,
        "compile_seconds": summary["compile_seconds"],
        "train_seconds": summary["train_seconds"],
        "sps": summary["sps"],
        "final_return": summary["final_return_mean"],
        # ru_maxrss of make covers the python it waited for (Linux reports the largest).
        "peak_rss_mb": rusage.ru_maxrss / 1024.0,
    }


ENV_ONLY_SNIPPET = r"""
import json, sys, time
import jax, jax.numpy as jnp
from jaxppo.config import PPOConfig
from jaxppo.envs.make import make_env
cfg = PPOConfig(num_envs=int(sys.argv[1]), num_steps=128)
spec = make_env(cfg)
env, params = spec.env, spec.env_params
n_iter = 500000 // (cfg.num_envs * cfg.num_steps)

def run(key):
    obs, st = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(key, cfg.num_envs), params)
    def step(carry, _):
        st, key = carry
        key, ka, ks = jax.random.split(key, 3)
        a = jax.random.randint(ka, (cfg.num_envs,), 0, spec.action_dim)
        obs, st, r, te, tr, info = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
            jax.random.split(ks, cfg.num_envs), st, a, params)
        return (st, key), r.sum()
    def it(carry, _):
        carry, r = jax.lax.scan(step, carry, None, length=cfg.num_steps)
        return carry, r.sum()
    return jax.lax.scan(it, (st, key), None, length=n_iter)[1]

f = jax.jit(run).lower(jax.random.PRNGKey(0)).compile()
jax.block_until_ready(f(jax.random.PRNGKey(1)))
t = time.perf_counter(); jax.block_until_ready(f(jax.random.PRNGKey(2))); dt = time.perf_counter() - t
print(json.dumps({"env_only_sps": n_iter * cfg.num_envs * cfg.num_steps / dt}))
"""


SIDE_BY_SIDE = ROOT.parent / "shared" / "bench" / "side_by_side.py"
ANCHOR = ROOT.parent / "shared" / "anchors" / "purejaxrl"
# (name, extra side_by_side.py arguments, rounds)
SIDE_BY_SIDE_CASES = [
    ("cartpole_purejaxrl_config", [], 5),
    ("breakout_minatar_64_envs", ["--env", "Breakout-MinAtar", "--num-envs", "64"], 3),
]


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def side_by_side(work: Path, rounds_scale: float = 1.0) -> dict:
    """jaxppo / PureJaxRL ratios from ../shared/bench/side_by_side.py, or why it was skipped."""
    if not (SIDE_BY_SIDE.exists() and ANCHOR.is_dir()):
        msg = (f"skipped: the PureJaxRL reference ({ANCHOR}) and its side-by-side script "
               f"({SIDE_BY_SIDE}) are not on this machine; they come with the project's "
               "development setup, not with a clone of the repository")
        print(f"side by side: {msg}", file=sys.stderr)
        return {"skipped": msg}
    out = {}
    for name, extra, rounds in SIDE_BY_SIDE_CASES:
        rounds = max(1, round(rounds * rounds_scale))
        path = work / f"{name}.json"
        print(f"side by side: {name}, {rounds} rounds ...", file=sys.stderr, flush=True)
        subprocess.run([PY, str(SIDE_BY_SIDE), "--python", PY, "--rounds", str(rounds),
                        "--out", str(path), *extra], cwd=ROOT, check=True)
        res = json.loads(path.read_text())
        out[name] = {"rounds": rounds, "config": res["config"], "medians": res["medians"],
                     "ratio_jaxppo_over_purejaxrl": res["ratio_jaxppo_over_purejaxrl"],
                     "per_round": res["rounds"]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-make", action="store_true", help="skip the make train timings")
    parser.add_argument("--only-side-by-side", action="store_true",
                        help="run only the side-by-side comparison with PureJaxRL")
    parser.add_argument("--side-by-side-rounds", type=float, default=1.0, metavar="SCALE",
                        help="scale the side-by-side rounds (5 CartPole, 3 MinAtar)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="jaxppo-bench-"))
    runs_dir = str(work / "runs")
    out: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(),
                    "load_avg_at_start": os.getloadavg()},
    }
    import jax

    out["machine"]["jax"] = jax.__version__
    out["machine"]["backend"] = jax.default_backend()

    # 0. Side by side with PureJaxRL: ratios, the only speed claims that carry across machines.
    out["side_by_side"] = side_by_side(work, args.side_by_side_rounds)
    if args.only_side_by_side:
        return _write(out, work, {name: case["ratio_jaxppo_over_purejaxrl"]
                                  for name, case in out["side_by_side"].items()
                                  if isinstance(case, dict)})

    # 1. PureJaxRL's config, cold and warm persistent cache, fresh processes.
    cold, warm = [], []
    for _ in range(args.repeats):
        cache = str(work / f"cache-{time.time_ns()}")
        cold.append(_train_process(["--defaults", "--set", *PUREJAXRL_CARTPOLE], cache, runs_dir))
        warm.append(_train_process(["--defaults", "--set", *PUREJAXRL_CARTPOLE], cache, runs_dir))
    out["purejaxrl_config"] = {"cold_cache": cold, "warm_cache": warm}

    # 2. Env-only ceiling at the same env count.
    env_only = []
    for _ in range(args.repeats):
        p = subprocess.run([PY, "-c", ENV_ONLY_SNIPPET, "4"], capture_output=True, text=True,
                           cwd=ROOT, check=True)
        env_only.append(json.loads(p.stdout.strip().splitlines()[-1])["env_only_sps"])
    best_train = max(r["sps"] for r in cold + warm)
    out["env_only"] = {"num_envs": 4, "sps": env_only,
                       "training_sps_over_env_only": best_train / max(env_only)}

    # 3. `make train ENV=CartPole-v1` (tuned config if shipped), cold and warm cache.
    if not args.skip_make:
        make_runs = {"cold_cache": [], "warm_cache": []}
        for _ in range(args.repeats):
            cache = str(work / f"cache-make-{time.time_ns()}")
            make_runs["cold_cache"].append(_train_process([], cache, runs_dir, via_make=True))
            make_runs["warm_cache"].append(_train_process([], cache, runs_dir, via_make=True))
        out["make_train_cartpole"] = make_runs

    def med(xs):
        xs = sorted(x for x in xs if x is not None)
        return xs[len(xs) // 2] if xs else None

    out["summary"] = {
        "purejaxrl_config_sps_median": med([r["sps"] for r in cold + warm]),
        "purejaxrl_config_compile_cold_median_s": med([r["compile_seconds"] for r in cold]),
        "purejaxrl_config_compile_warm_median_s": med([r["compile_seconds"] for r in warm]),
        "purejaxrl_config_seconds_to_475_cold_median": med([r["seconds_to_return_475"] for r in cold]),
        "purejaxrl_config_seconds_to_475_warm_median": med([r["seconds_to_return_475"] for r in warm]),
        "env_only_sps_median": med(env_only),
        "peak_rss_mb_purejaxrl_config_median": med([r["peak_rss_mb"] for r in cold + warm]),
    }
    if "make_train_cartpole" in out:
        mk = out["make_train_cartpole"]
        out["summary"].update({
            "make_train_seconds_to_475_cold_median": med([r["seconds_to_return_475"] for r in mk["cold_cache"]]),
            "make_train_seconds_to_475_warm_median": med([r["seconds_to_return_475"] for r in mk["warm_cache"]]),
            "make_train_process_seconds_cold_median": med([r["process_wall_seconds"] for r in mk["cold_cache"]]),
            "make_train_peak_rss_mb_median": med([r["peak_rss_mb"] for r in mk["cold_cache"] + mk["warm_cache"]]),
        })
    for name, case in out["side_by_side"].items():
        if isinstance(case, dict):
            out["summary"][f"side_by_side_{name}_ratio"] = case["ratio_jaxppo_over_purejaxrl"]
    return _write(out, work, out["summary"])


def _write(out: dict, work: Path, summary: dict) -> int:
    out["summary"] = summary
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"bench-{time.strftime('%Y-%m-%d')}.json"
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
