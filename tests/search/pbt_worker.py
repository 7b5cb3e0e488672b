"""Run in a subprocess with 4 forced host devices: a PBT population split over 1, 2 and 4
devices, and a checkpoint of the 2-device run resumed on 4 devices and on 1. With
JAXPPO_TEST_CACHE_DIR set it uses that persistent compilation cache (a resume on a device
count already run then compiles nothing).

Prints one JSON object (after "RESULT ") with what `test_pbt.py` asserts on.
"""

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402

if os.environ.get("JAXPPO_TEST_CACHE_DIR"):  # the suite's compilation cache (conftest.py)
    jax.config.update("jax_compilation_cache_dir", os.environ["JAXPPO_TEST_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
import numpy as np  # noqa: E402

import jaxppo  # noqa: E402
from test_pbt import PBT  # noqa: E402


def _diff(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.nanmax(np.abs(a - b) / (1e-6 + np.abs(b)))) if a.size else 0.0


def main():
    tmp = Path(tempfile.mkdtemp())
    runs = {nd: jaxppo.train(PBT.replace(num_devices=nd), progress=False, plot=False,
                             run_dir=tmp / f"d{nd}") for nd in (1, 2, 4)}
    split = tmp / "split"
    jaxppo.train(PBT.replace(num_devices=2), progress=False, plot=False, run_dir=split,
                 stop_after_iterations=10)
    resumed = {nd: jaxppo.train(PBT.replace(num_devices=nd), resume=split, progress=False,
                                plot=False) for nd in (4, 1)}
    base = runs[1].metrics
    out = {"devices": {nd: r.num_devices for nd, r in runs.items()}}
    for name, r in [("d2", runs[2]), ("d4", runs[4]), ("resumed4", resumed[4]),
                    ("resumed1", resumed[1])]:
        m = r.metrics
        out[name] = {
            "same_parents": bool(np.array_equal(m["pbt_parent"], base["pbt_parent"], equal_nan=True)),
            "same_episodes": bool(np.array_equal(m["episodes"], base["episodes"])),
            "same_returns": bool(np.array_equal(m["episode_return_mean"],
                                                base["episode_return_mean"], equal_nan=True)),
            "params_shape": list(np.shape(jax.tree.leaves(r.params)[0])),
            "max_rel_diff": {k: _diff(m[k], base[k]) for k in
                             ("value_loss", "grad_norm", "hp_lr", "hp_clip_param")},
            "max_param_diff": max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                                  for a, b in zip(jax.tree.leaves(jax.device_get(r.params)),
                                                  jax.tree.leaves(jax.device_get(runs[1].params)))),
        }
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
