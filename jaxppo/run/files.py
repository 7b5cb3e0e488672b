"""Writing a run folder's files without following symbolic links.

A run folder may come from someone else (a colleague's results, a downloaded checkpoint). A
link planted in it (`summary.json.tmp -> ~/.bashrc`) must not make a run write outside the
folder, so every file jaxppo writes there is created with O_NOFOLLOW (and, for a temporary
file, O_EXCL after removing whatever stood at its name), and replaced by a rename, which
replaces a link rather than writing through it. A folder that holds links is refused before
anything in it is changed (`refuse_links`); the run folder's own path may be a link (a
`runs/` on another disk), only what is inside it may not.
"""

from __future__ import annotations

import os
from pathlib import Path

from jaxppo.errors import CheckpointError

# W&B's own folder (run_dir/wandb by default) holds W&B's links (latest-run); W&B writes it.
OTHERS_FOLDERS = ("wandb",)


def refuse_links(run_dir: str | Path, doing: str = "resume") -> None:
    """CheckpointError naming the first symbolic link inside `run_dir` (W&B's folder aside).

    Args:
        run_dir: the run folder.
        doing: what was about to happen, for the message ("resume", ...).
    """
    run_dir = Path(run_dir)
    for root, dirs, files in os.walk(run_dir):
        if Path(root) == run_dir:
            dirs[:] = [d for d in dirs if d not in OTHERS_FOLDERS]
        for name in sorted(dirs + files):
            path = Path(root) / name
            if path.is_symlink():
                raise CheckpointError(
                    f"cannot {doing} {run_dir}: {path} is a symbolic link (to "
                    f"{os.readlink(path)}), and jaxppo does not write through links in a run "
                    "folder, so a folder from elsewhere cannot make it write outside itself. "
                    "Replace the link by the file it points to (or remove it) if you trust "
                    "the folder. Nothing was changed.")


def create_new(path: Path, mode: int = 0o644) -> int:
    """A file descriptor of `path` created anew (O_EXCL, O_NOFOLLOW): whatever stood at that
    name (a stale temporary file, or a link) is removed first, never written through."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)


def write_atomic(path: str | Path, data: str | bytes, sync: bool = False) -> None:
    """Replace `path` by a file holding `data`: written to PATH.tmp, then renamed over it, so
    a reader sees the old file or the new one, and a link at either name is replaced, not
    followed."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    fd = create_new(tmp)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def open_append(path: str | Path):
    """`path` opened for appending text; a link there is an OSError (ELOOP), not followed."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    return os.fdopen(fd, "a")


def name_too_long(path: str | Path) -> str | None:
    """What is wrong when a name in `path` is longer than its file system allows (a limit in
    bytes: 255 on most, so 127 characters such as 'ü' that take two bytes each); None if none is."""
    path = Path(path).absolute()
    existing = path.parent
    while existing != existing.parent and not os.path.isdir(existing):  # False on any OSError
        existing = existing.parent
    try:
        limit = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    for name in path.parts:
        size = len(os.fsencode(name))
        if size > limit:
            return (f"the folder name {name[:24]}... is {size} bytes long ({len(name)} "
                    f"characters), more than the {limit} bytes the file system under "
                    f"{existing} allows in a name")
    return None
