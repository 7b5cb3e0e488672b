"""Editing a run folder's checkpoint records in tests: the record each checkpoint keeps of
the run's config (checkpoints/<step>/meta/metadata, JSON), as a hand edit would."""

import json
from pathlib import Path


def edit_records(run: Path, edit, step: int | None = None) -> None:
    """Apply `edit(record)` to the record of checkpoint `step` (default: every checkpoint)."""
    pattern = f"{step if step is not None else '*'}/meta/metadata"
    metas = list((Path(run) / "checkpoints").glob(pattern))
    assert metas, f"no checkpoint record matches {pattern} in {run}"
    for meta in metas:
        record = json.loads(meta.read_text())
        edit(record)
        meta.write_text(json.dumps(record))
