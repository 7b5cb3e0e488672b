"""Single-host benchmark: speed, compile time, time-to-solve and memory on this machine.

    make bench            # or: .venv/bin/python experiments/bench.py [--repeats 3]

Writes experiments/results/bench-<date>.json (bench-<date>-<HHMM>.json for a later sitting that
day) and prints it. Measures:
  * side by side with PureJaxRL (../shared/bench/side_by_side.py, which runs PureJaxRL's own
    ppo.py from ../shared/anchors/purejaxrl next to jaxppo at the same config, alternating
    fresh processes): the ratios jaxppo / PureJaxRL of steps/s, compile, whole process,
    import and peak memory, for 16 seeds (`jaxppo.train`: seeds over every core), Breakout-
    MinAtar with 64 envs (`jaxppo.train`) and PureJaxRL's CartPole config (`make_train`, one
    device); each with the layout jaxppo used and the cores each side kept busy (CPU time /
    wall time of its processes). Skipped, with a message, where ../shared/anchors is absent
    (a user's clone);
  * every core busy: a PBT population of 8 on CartPole trained with all cores (one device
    per core, members split over them) and pinned to one core (`taskset -c 0`, so one
    device): the ratio of training seconds;
  * PureJaxRL's CartPole config exactly (4 envs x 128 steps, 4 epochs x 4 minibatches,
    64-64 tanh, 5e5 steps): steps/s of the compiled run and compile seconds, cold (empty
    persistent cache) and warm, each in a fresh process, `--repeats` times;
  * env-only throughput at the same env count (random actions, same scan structure): the
    ceiling training could reach, and training steps/s as a fraction of it;
  * `make train ENV=CartPole-v1` as a user runs it: seconds from launching make to the first
    metrics row whose 10-iteration mean return is >= 475, with a cold and with a warm
    compile cache, plus the whole process's wall time and peak RSS;
  * envs that step in Python: the synchronous host loop vs the actor-learner
    (max_policy_lag 1) on gymnasium's CartPole-v1 and HalfCheetah-v5, alternating fresh
    processes (experiments/actor_learner.py, which alone writes results/actor-learner.json):
    the steps/s ratio and the cores each kept busy.
Numbers vary with machine load: run it on a quiet machine. `--only-side-by-side` runs the
first two only (`make bench BENCH_ARGS=--only-side-by-side`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
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
# (name, extra side_by_side.py arguments, rounds, target: jaxppo / PureJaxRL steps/s)
SIDE_BY_SIDE_CASES = [
    ("cartpole_16_seeds", ["--seeds", "16", "--jaxppo-api", "train"], 3, 1.8),
    ("breakout_minatar_64_envs", ["--env", "Breakout-MinAtar", "--num-envs", "64",
                                  "--total-timesteps", "4e5", "--jaxppo-api", "train"], 3, 1.6),
    ("cartpole_purejaxrl_config", [], 5, 1.0),
]

# A PBT population of 8 on CartPole (PureJaxRL's batch shape): argv[1] = env steps per member.
PBT_SNIPPET = r"""
import json, sys
import jaxppo
cfg = jaxppo.PPOConfig(
    env="CartPole-v1", num_envs=4, num_steps=128, num_epochs=4, num_minibatches=4,
    total_timesteps=int(float(sys.argv[1])), num_seeds=8, compilation_cache_dir=None,
    search={"lr": {"loguniform": [1e-4, 1e-2]}}, pbt={"interval": 10, "fraction": 0.25})
r = jaxppo.train(cfg, progress=False, plot=False)
print(json.dumps({"layout": r.layout, "num_devices": r.num_devices,
                  "compile_s": r.compile_seconds, "train_s": r.train_seconds,
                  "sps": cfg.num_iterations * cfg.batch_size * cfg.num_seeds / r.train_seconds}))
"""

# Stands in for the project's python in side_by_side.py: runs it, and for each training
# worker (`python -c WORKER MODE ...`) appends the child's wall and CPU seconds to a log.
CPU_WRAPPER = """#!{python}
import json, os, subprocess, sys, time
t0 = time.perf_counter()
child = subprocess.Popen([{python!r}, *sys.argv[1:]])
_, status, usage = os.wait4(child.pid, 0)
if len(sys.argv) > 3 and sys.argv[1] == "-c":
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"mode": sys.argv[3], "wall_s": time.perf_counter() - t0,
                             "cpu_s": usage.ru_utime + usage.ru_stime}}) + "\\n")
sys.exit(os.waitstatus_to_exitcode(status))
"""


def cpu_model() -> str:
    """lscpu's model name (with its CPU count), else /proc/cpuinfo's."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        name = info.get("Model name", "").strip()
        if name:
            return f"{name}, {info.get('CPU(s)', '?').strip()} CPU(s)"
    except (OSError, subprocess.CalledProcessError, ValueError):
        pass
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def timed(cmd: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run `cmd` to its end: (the process, wall seconds, CPU seconds of it and its children)."""
    with tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, **kwargs)
        out = proc.stdout.read()  # to EOF; the child is not reaped yet
        proc.stdout.close()
        _, status, usage = os.wait4(proc.pid, 0)  # reaps it, with its CPU time
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        done = subprocess.CompletedProcess(cmd, proc.returncode, out, err.read())
    return done, wall, usage.ru_utime + usage.ru_stime


def jaxppo_layout(extra: list[str]) -> str:
    """The layout jaxppo picks for a side-by-side case (num_devices="auto" with one CPU
    device per core of this process), or make_train's single device."""
    import jaxppo
    from jaxppo.cpu_devices import wanted
    from jaxppo.program.layout import auto_layout, describe_layout

    args = dict(zip(extra[::2], extra[1::2]))
    seeds = int(args.get("--seeds", 1))
    if args.get("--jaxppo-api", "make_train") != "train":
        return ("jax.jit(make_train)" + (f", vmapped over {seeds} seeds" if seeds > 1 else "")
                + ", one CPU device")
    cfg = jaxppo.PPOConfig(env=args.get("--env", "CartPole-v1"),
                           num_envs=int(args.get("--num-envs", 4)), num_seeds=seeds)
    return describe_layout(cfg, auto_layout(cfg.num_seeds, cfg.num_envs, wanted()), "cpu")


def side_by_side(work: Path, rounds_scale: float = 1.0) -> dict:
    """jaxppo / PureJaxRL ratios from ../shared/bench/side_by_side.py, or why it was skipped."""
    if not (SIDE_BY_SIDE.exists() and ANCHOR.is_dir()):
        msg = (f"skipped: the PureJaxRL reference ({ANCHOR}) and its side-by-side script "
               f"({SIDE_BY_SIDE}) are not on this machine; they come with the project's "
               "development setup, not with a clone of the repository")
        print(f"side by side: {msg}", file=sys.stderr)
        return {"skipped": msg}
    out = {}
    for name, extra, rounds, target in SIDE_BY_SIDE_CASES:
        rounds = max(1, round(rounds * rounds_scale))
        path, log = work / f"{name}.json", work / f"{name}-cpu.jsonl"
        wrapper = work / f"python-{name}"
        wrapper.write_text(CPU_WRAPPER.format(python=PY, log=str(log)))
        wrapper.chmod(0o755)
        print(f"side by side: {name}, {rounds} rounds ...", file=sys.stderr, flush=True)
        done, wall, cpu = timed([PY, str(SIDE_BY_SIDE), "--python", str(wrapper), "--rounds",
                                 str(rounds), "--out", str(path), *extra], cwd=ROOT)
        print(done.stdout, end="", file=sys.stderr)
        if done.returncode != 0:
            raise RuntimeError(f"side by side {name} failed:\n{done.stderr[-3000:]}")
        res = json.loads(path.read_text())
        ours = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
        ours_wall, ours_cpu = sum(r["wall_s"] for r in ours), sum(r["cpu_s"] for r in ours)
        ratio = res["ratio_jaxppo_over_purejaxrl"]
        # Each round's jaxppo run against the PureJaxRL run just before it: on a shared machine
        # whose speed drifts between rounds, these pairs are steadier than ratios of medians.
        paired = [j["sps"] / p["sps"] for p, j in zip(res["rounds"]["purejaxrl"],
                                                       res["rounds"]["jaxppo"])]
        busy = {"jaxppo": ours_cpu / max(ours_wall, 1e-9),
                # the rest of the script's time: PureJaxRL's runs and ~1 s of version queries
                "purejaxrl_approx": (cpu - ours_cpu) / max(wall - ours_wall, 1e-9)}
        out[name] = {"rounds": rounds, "args": extra, "config": res["config"],
                     "jaxppo_layout": jaxppo_layout(extra), "cores_busy": busy,
                     "target_sps_ratio": target, "meets_target": ratio["sps"] >= target,
                     "medians": res["medians"], "ratio_jaxppo_over_purejaxrl": ratio,
                     "sps_ratio_per_round": paired,
                     "sps_ratio_paired_median": statistics.median(paired),
                     "per_round": res["rounds"]}
        print(f"side by side: {name}: steps/s ratio {ratio['sps']:.2f} (target >= {target}; "
              f"round by round {', '.join(f'{x:.2f}' for x in paired)}); "
              f"jaxppo: {out[name]['jaxppo_layout']}; cores busy: jaxppo {busy['jaxppo']:.2f}, "
              f"PureJaxRL {busy['purejaxrl_approx']:.2f}", file=sys.stderr, flush=True)
    return out


def all_cores(steps: float = 2e5, rounds: int = 1) -> dict:
    """A PBT population of 8 on CartPole with every core (jaxppo's default: one CPU device per
    core, members split over them) and pinned to one core (`taskset -c`: one device): the
    ratio of training seconds (target <= 0.6 on 2 cores), and the cores each kept busy."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or not shutil.which("taskset"):
        return {"skipped": f"needs 2 or more cores and taskset (this process may use {cores})"}
    env = {k: v for k, v in os.environ.items() if k not in ("JAXPPO_CPU_DEVICES", "XLA_FLAGS")}
    runs: dict[str, list] = {"all_cores": [], "one_core": []}
    for _ in range(rounds):
        for name, pin in (("all_cores", []), ("one_core", ["taskset", "-c", str(cores[0])])):
            print(f"all cores: a PBT population of 8, {name} ...", file=sys.stderr, flush=True)
            done, wall, cpu = timed([*pin, PY, "-c", PBT_SNIPPET, str(steps)], cwd=ROOT, env=env)
            if done.returncode != 0:
                raise RuntimeError(f"PBT run ({name}) failed:\n{done.stderr[-3000:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            runs[name].append({**row, "process_s": wall, "cores_busy": cpu / wall})

    def med(name: str, key: str) -> float:
        xs = sorted(r[key] for r in runs[name])
        return xs[len(xs) // 2]

    ratio = med("all_cores", "train_s") / med("one_core", "train_s")
    print(f"all cores: PBT training seconds, all cores / one core = {ratio:.2f} (target <= 0.6); "
          f"{runs['all_cores'][0]['layout']} vs {runs['one_core'][0]['layout']}",
          file=sys.stderr, flush=True)
    return {"cores": len(cores), "steps_per_member": steps, "runs": runs,
            "train_seconds_ratio_all_over_one_core": ratio, "target": 0.6,
            "meets_target": ratio <= 0.6}


RATIO = "sps_ratio_lag1_over_sync_paired_median"  # experiments/actor_learner.py's headline


def actor_learner(rounds: int) -> dict:
    """The synchronous host loop vs the actor-learner (max_policy_lag 1) on gymnasium's
    CartPole-v1 and HalfCheetah-v5 (experiments/actor_learner.py), `rounds` rounds each."""
    from actor_learner import side_by_side as host_loop_vs_actor_learner

    return host_loop_vs_actor_learner(rounds, ["cartpole", "halfcheetah"])


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-make", action="store_true", help="skip the make train timings")
    parser.add_argument("--skip-actor-learner", action="store_true",
                        help="skip the host loop vs actor-learner comparison")
    parser.add_argument("--only-side-by-side", action="store_true",
                        help="run only the side-by-side comparison with PureJaxRL")
    parser.add_argument("--side-by-side-rounds", type=float, default=1.0, metavar="SCALE",
                        help="scale the side-by-side rounds (5 CartPole, 3 MinAtar)")
    return parser.parse_args()


def main() -> int:
    args = _arguments()
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

    # 0. Side by side with PureJaxRL: ratios, the only speed claims that carry across machines;
    # then every core busy (PBT over all cores vs one).
    out["side_by_side"] = side_by_side(work, args.side_by_side_rounds)
    out["all_cores"] = all_cores(rounds=max(1, round(args.side_by_side_rounds)))
    headline = {name: {"sps_ratio": case["ratio_jaxppo_over_purejaxrl"]["sps"],
                       "sps_ratio_paired_median": case["sps_ratio_paired_median"],
                       "target": case["target_sps_ratio"], "layout": case["jaxppo_layout"],
                       "cores_busy": case["cores_busy"]}
                for name, case in out["side_by_side"].items()
                if "ratio_jaxppo_over_purejaxrl" in case}
    if "train_seconds_ratio_all_over_one_core" in out["all_cores"]:
        headline["pbt_all_cores_over_one_core_train_seconds"] = (
            out["all_cores"]["train_seconds_ratio_all_over_one_core"])
    if args.only_side_by_side:
        return _write(out, work, headline)

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

    if not args.skip_actor_learner:  # 4. envs stepped in Python: host loop vs actor-learner
        out["actor_learner"] = actor_learner(args.repeats)

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
    out["summary"].update({f"actor_learner_{name}_sps_ratio": case[RATIO]
                           for name, case in out.get("actor_learner", {}).items() if RATIO in case})
    out["summary"]["side_by_side_headline"] = headline
    return _write(out, work, out["summary"])


def _write(out: dict, work: Path, summary: dict) -> int:
    out["summary"] = summary
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"bench-{time.strftime('%Y-%m-%d')}.json"
    if path.exists():  # a second sitting that day keeps the first
        path = RESULTS / f"bench-{time.strftime('%Y-%m-%d-%H%M')}.json"
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
