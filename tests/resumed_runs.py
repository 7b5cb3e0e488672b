"""A run stopped after one iteration and resumed, against the same run uninterrupted, in
tests (one compile for the three runs: the config's compilation cache)."""

from pathlib import Path

import jax
import numpy as np

import jaxppo


def check_resume_continues_exactly(cfg, tmp_path: Path):
    """Trains `cfg` whole into tmp_path/"full", and stopped after one iteration into
    tmp_path/"part" then resumed; asserts the two final states are equal, bit for bit.
    Returns the whole run's result."""
    full = jaxppo.train(cfg, run_dir=tmp_path / "full", progress=False, plot=False)
    jaxppo.train(cfg, run_dir=tmp_path / "part", progress=False, stop_after_iterations=1,
                 plot=False)
    resumed = jaxppo.train(cfg, resume=tmp_path / "part", progress=False, plot=False)
    for a, b in zip(jax.tree.leaves(full.state), jax.tree.leaves(resumed.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return full
