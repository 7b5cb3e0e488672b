"""The README's `python -m jaxppo train ...` commands, read as the CLI reads them, so that a
test can train exactly what the README tells a newcomer to run."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_train_commands() -> list[list[str]]:
    """Every `python -m jaxppo train` command in the README's bash blocks, as argv lists
    (after `python -m jaxppo`), with backslash continuations joined."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", README.read_text(), flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith("python -m jaxppo train"):
                commands.append(shlex.split(line)[3:])
    return commands


def readme_train_config(env: str):
    """The config the README's train command for `env` builds (defaults < tuned < --set),
    exactly as `jaxppo train` would; the test fails when the README has no such command."""
    from jaxppo.cli import _build_parser
    from jaxppo.run.command import new_config

    matches = [argv for argv in readme_train_commands()
               if "--env" in argv and argv[argv.index("--env") + 1] == env]
    assert len(matches) == 1, f"README has {len(matches)} `python -m jaxppo train --env {env}` commands"
    config, _ = new_config(_build_parser().parse_args(matches[0]))
    return config
