"""The code blocks of the README and of every page of the documentation site (docs/*.md), and
their `python -m jaxppo train ...` commands read as the CLI reads them, so that a test can
train exactly what the documentation tells a newcomer to run."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# A python block right after this line is compiled by the tests, not run (it says why).
COMPILE_ONLY = "<!-- docs-test: compile-only ("
_BLOCK = re.compile(r"^(<!-- docs-test: compile-only \((.*?)\) -->\n)?```(\w*)[^\n]*\n(.*?)^```",
                    flags=re.DOTALL | re.MULTILINE)


def doc_pages() -> list[Path]:
    """README.md and every Markdown page of the site, in a fixed order."""
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def code_blocks(page: Path) -> list[tuple[str, str, str | None]]:
    """(language, code, why it is only compiled or None) of each fenced block of `page`."""
    return [(lang, code, why or None) for _, why, lang, code in _BLOCK.findall(page.read_text())]


def train_commands(text: str) -> list[list[str]]:
    """Every `python -m jaxppo train` command in the bash blocks of `text`, as argv lists
    (after `python -m jaxppo`), with backslash continuations joined."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith("python -m jaxppo train"):
                commands.append(shlex.split(line)[3:])
    return commands


def readme_train_commands() -> list[list[str]]:
    """Every `python -m jaxppo train` command of the README and the docs pages, each once."""
    commands = []
    for page in doc_pages():
        commands += [c for c in train_commands(page.read_text()) if c not in commands]
    return commands


def readme_train_config(env: str, **fields):
    """The config the documentation's train command for `env` builds (defaults < tuned <
    --set), exactly as `jaxppo train` would. With `fields` (e.g. `env_kwargs={}`), the one
    command whose config has those values, where the docs train `env` several ways. The test
    fails when the docs have no such command, or several."""
    from jaxppo.cli import _build_parser
    from jaxppo.run.command import new_config

    matches = [new_config(_build_parser().parse_args(argv))[0]
               for argv in readme_train_commands()
               if "--env" in argv and argv[argv.index("--env") + 1] == env]
    chosen = [c for c in matches if all(getattr(c, k) == v for k, v in fields.items())]
    assert len(chosen) == 1, (f"the docs have {len(chosen)} `python -m jaxppo train --env {env}` "
                              f"commands with {fields or 'any config'} ({len(matches)} in all)")
    return chosen[0]
