"""`TrainResult.save`: a run trained without a run folder, written to one afterwards.

The folder is the one `train(config, run_dir=...)` would have left: config.yaml,
metrics.jsonl, the checkpoint of the last iteration (so that `--resume` continues the run),
params.msgpack, summary.json and curve.png, and sweep.json for a sweep.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from jaxppo.errors import ConfigError
from jaxppo.run.folder import RunFolder, check_run_dir
from jaxppo.run.loop import checkpoint_meta, metric_keys, metric_rows


def save_result(result, run_dir: str | Path, plot: bool, *, snapshot: Callable[[], Any],
                record: dict, sweep_record: dict | None, label: str | None,
                extra_summary: Callable[[Any], dict] | None) -> Path:
    """Write `result`'s run folder at `run_dir` (new, or an empty folder); returns its path.

    Args:
        result: the TrainResult.
        run_dir: the folder to write.
        plot: draw curve.png.
        snapshot: the run's final state, unsharded, as checkpoints hold it.
        record: the schedules the run trained with (the checkpoint's record).
        sweep_record: sweep.json's record of a sweep's members, or None.
        label, extra_summary: the run's name in curve.png, and more entries for summary.json.

    Raises:
        ConfigError: run_dir exists and is not empty, or no folder can be made there.
    """
    path = Path(run_dir)
    check_run_dir(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConfigError(f"TrainResult.save({str(run_dir)!r}): {path} already exists and is not "
                          "empty; save to a new or empty folder (a run folder is never written "
                          "over)")
    config, it = result.config, result.iterations_done
    folder = RunFolder(path, config)
    try:
        folder.record_sweep(sweep_record)
        folder.write_rows(metric_rows(result.metrics, metric_keys(config, result._algorithm),
                                       config.num_seeds))
        wall = float(result.metrics["wall_time"][0, -1])
        folder.save_checkpoint(it, snapshot(), checkpoint_meta(
            config, it, wall, result.num_devices, result.hosts, record))
        folder.finish(result, plot=plot, label=label,
                      extra_summary=extra_summary(result) if extra_summary else None)
    finally:
        folder.close()
    return path
