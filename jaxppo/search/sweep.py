"""The record of a vmapped sweep: which hyperparameters each member (seed index) trained with.

`jaxppo.train(config.replace(num_seeds=N), hparams=HyperParams.stack([...]))` trains member
i with the i-th hyperparameters. RUN_DIR/sweep.json records them, so that plots, progress,
summary.json, `jaxppo eval` and resume name members by what differs between them
("lr=0.0003") instead of treating them as N seeds of one setting:

    {"members": N,
     "differing": {"lr": [0.0001, 0.0003, 0.001]},   # fields that differ, one value per member
     "labels": ["lr=0.0001", "lr=0.0003", "lr=0.001"],   # "lr=0.001→0" for linear anneals
     "hparams": [{"lr": 0.0001, "entropy_coeff": 0.01, "clip_param": 0.2, ...}, ...]}

Values use the config's field names: `lr`/`entropy_coeff` are a number for a constant
schedule, else its [[env_step, value], ...] points; `vf_clip_param` is null when off,
`critic_lr` null when the critic steps with lr (a record written before critic_lr existed
has none: null).
Members with equal hyperparameters share a label: they are seeds of one setting.
No file is written when every member has the same hyperparameters (a multi-seed run).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxppo.config import HYPERPARAM_LEAVES, SCHEDULES, SWEPT_FIELDS
from jaxppo.core.hyperparams import HyperParams, follows_lr, is_follows_lr
from jaxppo.errors import CheckpointError
from jaxppo.search.space import draw_settings

SWEEP_FILE = "sweep.json"

_CONFIG_NAME = HYPERPARAM_LEAVES  # HyperParams field -> the config field it comes from
_POINTS = set(SCHEDULES)

# Config fields a sweep's hyperparameters override: a sweep folder's config.yaml values of
# these are not what its members trained with.
SWEPT_CONFIG_FIELDS = SWEPT_FIELDS


def short_float(x) -> float:
    # The shortest decimal that is the same float32: 3e-4 reads "0.0003", not 0.000300000014.
    return float(str(np.float32(x)))


def _value(name: str, arr: np.ndarray):
    if name == "critic_lr" and is_follows_lr(arr):
        return None  # null: the critic steps with lr
    if name in _POINTS:
        if arr.shape[0] == 1:  # a one-point schedule is a constant
            return short_float(arr[0, 1])
        return [[short_float(x), short_float(v)] for x, v in arr]
    if name == "vf_clip_param" and float(arr) == 0.0:
        return None
    return short_float(arr)


def member_hparams(hp, num_seeds: int) -> list[dict] | None:
    """Per member, {config field: value} of a HyperParams batched over `num_seeds` members;
    None when `hp` is one setting for every seed."""
    import dataclasses

    if num_seeds < 2 or np.shape(hp.clip_param) != (num_seeds,):
        return None  # one setting (or a shape jaxppo.program rejects with a ConfigError)
    out = [{} for _ in range(num_seeds)]
    for f in dataclasses.fields(hp):
        name = _CONFIG_NAME.get(f.name, f.name)
        arr = np.asarray(getattr(hp, f.name), np.float32)
        for i in range(num_seeds):
            out[i][name] = _value(name, arr[i])
    return out


def fmt_value(v) -> str:
    """A hyperparameter as a label shows it: 0.0003, 1e-05, [[0,0.001],[100000,0]]."""
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, list):
        return "[" + ",".join(fmt_value(x) for x in v) + "]"
    return str(v)


def _label_value(name: str, v, members: list[dict]) -> str:
    """A schedule whose env steps are the same in every member shows only its values
    ("0.001→0" for a linear anneal); anything else as `fmt_value`."""
    if isinstance(v, list) and all(isinstance(m[name], list) for m in members) and len(
            {json.dumps([x for x, _ in m[name]]) for m in members}) == 1:
        return "→".join(fmt_value(y) for _, y in v)
    return fmt_value(v)


def make_record(hp, num_seeds: int) -> dict | None:
    """sweep.json's content for `hp` (see the module docstring); None unless at least one
    hyperparameter differs between members."""
    members = member_hparams(hp, num_seeds)
    if members is None:
        return None
    differing = [k for k in members[0] if len({json.dumps(m[k]) for m in members}) > 1]
    if not differing:
        return None
    labels = [", ".join(f"{k}={_label_value(k, m[k], members)}" for k in differing)
              for m in members]
    return {"members": num_seeds, "differing": {k: [m[k] for m in members] for k in differing},
            "labels": labels, "hparams": members}


def read_record(run_dir: str | Path) -> dict | None:
    """The sweep.json of a run folder (or of the folder of a metrics.jsonl), None if it has none."""
    p = Path(run_dir)
    if p.is_file():
        p = p.parent
    path = p / SWEEP_FILE
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or not {"labels", "differing", "hparams"} <= record.keys():
            raise ValueError("not a sweep record")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{path} cannot be read ({str(e)[:120]}): restore it, or delete it to treat the "
            "members as seeds of the config's hyperparameters. Nothing was changed.") from None
    return record


def hparams_from_record(record: dict):
    """The batched HyperParams a sweep.json describes (what a resumed sweep trains with)."""
    def leaf(config_name, value, member):
        if config_name == "critic_lr" and value is None:  # null, or a record from before it
            return np.asarray(follows_lr(leaf("lr", member["lr"], member)))
        if config_name in _POINTS:
            pts = [[0.0, value]] if not isinstance(value, list) else value
            return np.asarray(pts, np.float32)
        return np.float32(0.0 if value is None else value)

    members = record["hparams"]
    fields = {}
    for f in HyperParams.__dataclass_fields__:
        name = _CONFIG_NAME.get(f, f)
        fields[f] = jnp.asarray(np.stack([leaf(name, m.get(name), m) for m in members]))
    return HyperParams(**fields)


def run_hparams(config, hparams, run_dir, resumed: bool):
    """(HyperParams, sweep record or None) a run trains with: `hparams` if given, else on a
    resume the folder's recorded sweep (the checkpoint holds the state, not the
    hyperparameters), else a search's draw (`config.search`), else the config's. The same for one host and for several."""
    if hparams is None and resumed:
        record = read_record(run_dir)
        hparams = hparams_from_record(record) if record is not None else None
    if hparams is None and config.search is not None:  # a search's first population
        hparams = sample_hparams(config)
    hp = hparams if hparams is not None else HyperParams.from_config(config)
    return hp, make_record(hp, config.num_seeds)


def sample_hparams(config):
    """The batched HyperParams of a search's first population: each member's values drawn
    from `config.search` (jaxppo.search.space.draw_settings) on top of the config."""
    base = config.replace(search=None, pbt=None, num_seeds=1)
    return HyperParams.stack([HyperParams.from_config(base.replace(**values))
                              for values in draw_settings(config)])
