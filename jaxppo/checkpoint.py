"""Saving and loading trained parameters (and the observation statistics they expect)."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np
from flax import serialization


def save_params(path: str | Path, result) -> Path:
    """Write {params, obs_stats} of every seed as msgpack, atomically (tmp file + rename)."""
    path = Path(path)
    obs_stats = result.state.obs_stats
    if getattr(result, "num_devices", 1) > 1:  # replicated over devices: keep one copy
        obs_stats = jax.tree.map(lambda x: x[0], obs_stats)
    payload = {
        "params": jax.device_get(result.params),
        "obs_stats": jax.device_get(obs_stats),
    }
    data = serialization.msgpack_serialize(serialization.to_state_dict(payload))
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_params_dict(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no params file at {path}; train with `jaxppo train` first")
    return jax.tree.map(np.asarray, serialization.msgpack_restore(path.read_bytes()))
