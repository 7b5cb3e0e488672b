"""What a search (or PBT) run leaves in its folder besides what every run has: search.json
(every member's hyperparameters and final return, the settings ranked, the best, PBT's
winning lineage), search.csv (the member table), best.yaml (the best setting as a ready
config) and search.png (`jaxppo.run.plots.plot_search`). Nothing here imports JAX.
"""

from __future__ import annotations

import csv
import io
import math

import numpy as np
import yaml

from jaxppo.search.space import parse_search, settings_per_member
from jaxppo.search.sweep import short_float

SEARCH_FILE = "search.json"
TABLE_FILE = "search.csv"
BEST_FILE = "best.yaml"
PLOT_FILE = "search.png"


def _finite(x) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def lineage(metrics: dict, member: int) -> dict:
    """The ancestry of a member at the end of a PBT run.

    Args:
      metrics: arrays [members, iterations] of 'iteration', 'pbt_parent' and 'hp_<field>'.
      member: the member whose line to follow back.

    Returns:
      {"member", "iteration", "owner": per iteration, the member whose state it descends
      from, "hparams": {field: its live value along that line}, "exploits": the copies}.
    """
    parent = np.asarray(metrics["pbt_parent"])
    fields = [k[3:] for k in metrics if k.startswith("hp_")]
    n = parent.shape[1]
    owner = np.empty(n, np.int64)
    cur = member
    for j in range(n - 1, -1, -1):
        owner[j] = cur
        p = parent[cur, j]
        if math.isfinite(p) and int(p) != cur:  # after iteration j it copied member p
            cur = int(p)
    events = [{"iteration": int(metrics["iteration"][owner[j], j]), "member": int(owner[j]),
               "parent": int(parent[owner[j], j])}
              for j in range(n) if math.isfinite(parent[owner[j], j])
              and int(parent[owner[j], j]) != owner[j]]
    cols = np.arange(n)
    return {
        "member": int(member),
        "iteration": [int(x) for x in np.asarray(metrics["iteration"])[owner, cols]],
        "owner": [int(x) for x in owner],
        "hparams": {f: [short_float(x) for x in np.asarray(metrics[f"hp_{f}"])[owner, cols]]
                    for f in fields},
        "exploits": events,
    }


def report(config, info: dict, sweep: dict | None, metrics: dict) -> dict:
    """search.json's content for a finished search or PBT run.

    A member's hyperparameters are those it was drawn with (a search), or for PBT those it
    ended with (its `hp_<field>` metrics). Settings (a setting's seeds averaged) are ranked
    by the final evaluation when the run evaluates, else by the final training return.

    Args:
      config: the run's PPOConfig.
      info: its summary (summary.json).
      sweep: its sweep record (each member's drawn values), or None.
      metrics: [members, iterations] arrays of its metrics.

    Returns:
      {"metric", "searched", "members", "settings" (ranked), "best", and "pbt" for PBT}.
    """
    _, dists = parse_search(config.search)
    names = list(dists)
    members = config.num_seeds
    final = info["final_return_per_seed"]
    evals = info.get("final_eval_return_per_seed")
    pbt = config.pbt is not None
    if pbt:  # the values each member ended with
        values = [{f: short_float(np.asarray(metrics[f"hp_{f}"])[m, -1]) for f in names}
                  for m in range(members)]
    else:
        # a schedule's searched value is its first one (the config's lr_schedule gives the rest)
        values = [{f: v[0][1] if isinstance(v, list) else v
                   for f in names for v in [sweep["hparams"][m][f]]} for m in range(members)]
    per = 1 if pbt else settings_per_member(config)
    rows = []
    for m in range(members):
        row = {"member": m, "setting": m // per, **{f: values[m][f] for f in names},
               "final_return": _finite(final[m])}
        if evals is not None:
            row["final_eval_return"] = _finite(evals[m])
        rows.append(row)
    key = "final_eval_return" if evals is not None else "final_return"
    settings = []
    for k in range(members // per):
        group = rows[k * per:(k + 1) * per]
        entry = {"setting": k, "members": [r["member"] for r in group],
                 "hparams": {f: group[0][f] for f in names}}
        for col in ("final_return", "final_eval_return"):
            vals = [r[col] for r in group if r.get(col) is not None]
            if col in group[0]:
                entry[f"{col}_mean"] = float(np.mean(vals)) if vals else None
        settings.append(entry)
    ranked = sorted(settings, key=lambda e: -np.inf if e[f"{key}_mean"] is None
                    else e[f"{key}_mean"], reverse=True)
    for r, entry in enumerate(ranked, 1):
        entry["rank"] = r
    out = {"metric": key, "searched": {f: d.to_config() for f, d in dists.items()},
           "members": rows, "settings": ranked, "best": ranked[0]}
    if pbt:
        out["pbt"] = {"settings": config.pbt,
                      "lineage": lineage(metrics, ranked[0]["members"][0])}
    return out


def table_csv(rec: dict) -> str:
    """search.csv: one row per member (hyperparameters, final return, evaluation)."""
    rows = rec["members"]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: "" if v is None else v for k, v in r.items()})
    return buf.getvalue()


def best_yaml(config, rec: dict) -> str:
    """best.yaml: the config with the best setting's values, as one seed, search and pbt off."""
    best = rec["best"]
    cfg = config.replace(search=None, pbt=None, num_seeds=1, **best["hparams"])
    score = best.get(f"{rec['metric']}_mean")
    score = score if score is None else round(score, 4)
    if config.pbt is not None:
        head = (f"# The best of {len(rec['settings'])} PBT members on {config.env_name} "
                f"({rec['metric']} {score}), with the values it ended with: PBT changed them "
                "during training (search.json's lineage)\n")
    else:
        head = (f"# The best of {len(rec['settings'])} settings of a search on "
                f"{config.env_name} ({rec['metric']} {score}; every setting in search.json)\n")
    return head + yaml.safe_dump(cfg.to_dict(), sort_keys=False)
