"""Run in a subprocess with 4 forced host devices: a PBT population split over 2 and 4
devices, and a checkpoint of the 2-device run (after 10 iterations) resumed on 4 devices.
It uses the suite's persistent compilation cache (JAX_COMPILATION_CACHE_DIR, set by
conftest.py): a resume on a device count already run compiles nothing.

`python pbt_worker.py OUT` writes OUT/<run>.npz (the devices it trained on, its metrics and
its params' leaves) for the runs d2, d4 and resumed4, and leaves OUT/stopped, the 2-device
run's folder as it was after 10 iterations. `test_pbt.py` resumes that one on 1 device in its
own process (of one device, whose compiled one-device program it shares) and compares every
run with its own one-device run.
"""

import os
import shutil
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxppo  # noqa: E402
from test_pbt import COMPARED, PBT  # noqa: E402


def save(path: Path, result) -> None:
    """What test_pbt.py compares of a run: its devices, metrics and params."""
    leaves = jax.tree.leaves(jax.device_get(result.params))
    np.savez(path, devices=result.num_devices,
             **{f"metric:{k}": np.asarray(result.metrics[k]) for k in COMPARED},
             **{f"param:{i}": np.asarray(x) for i, x in enumerate(leaves)})


def main(out: Path) -> None:
    for nd in (2, 4):
        save(out / f"d{nd}.npz", jaxppo.train(PBT.replace(num_devices=nd), progress=False,
                                             plot=False, run_dir=out / f"d{nd}"))
    split = out / "split"
    jaxppo.train(PBT.replace(num_devices=2), progress=False, plot=False, run_dir=split,
                 stop_after_iterations=10)
    shutil.copytree(split, out / "stopped")
    save(out / "resumed4.npz", jaxppo.train(PBT.replace(num_devices=4), resume=split,
                                            progress=False, plot=False))


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
