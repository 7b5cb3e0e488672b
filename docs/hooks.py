"""MkDocs hooks of the documentation site (mkdocs.yml, `hooks:`).

* The configuration reference is generated: where a page holds the line
  `<!-- config-reference -->`, the build puts one table per section of `PPOConfig`, each row
  read from the field's declaration in jaxppo/config.py (default, meaning, role), so the
  reference cannot drift from the code. `python docs/hooks.py` prints those tables.
* The result curves stay where `make experiments` writes them (experiments/results/*.png):
  the build adds them to the site as `assets/results/<name>.png`, and a page's links to
  `../experiments/results/<name>.png` (right when the page is read on its own, in the
  repository) point there.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- config-reference -->"
RESULTS = ROOT / "experiments" / "results"
RESULTS_LINK, RESULTS_SITE = "../experiments/results/", "assets/results/"

ROLES = {
    "tunable": "tunable",  # a HyperParams leaf
    "shape": "shape",  # locked on resume
    "run": "run-time",
}


def _shown(value) -> str:
    """A default as a config file writes it: true, null, [64, 64], {}."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, tuple):
        return str(list(value))
    return str(value)


def config_rows() -> list[tuple[str, str, str, str, str]]:
    """(section, key, default, role, meaning) of every config key, in declaration order; a
    nested config's keys (`network.*`) take the role of the field that holds them."""
    from jaxppo.config import PPOConfig
    from jaxppo.config_fields import keys, spec

    role = {f.name: spec(f).role for f in dataclasses.fields(PPOConfig)}
    rows, section = [], ""
    for opens, key, default, meaning in keys(PPOConfig):
        section = opens or section
        rows.append((section, key, _shown(default), ROLES[role[key.split(".", 1)[0]]], meaning))
    return rows


def config_reference() -> str:
    """The configuration reference in Markdown: a heading and a table per section."""
    out: list[str] = []
    current = None
    for section, key, default, role, meaning in config_rows():
        if section != current:
            out += ["", f"### {section[0].upper()}{section[1:]}", "",
                    "| key | default | role | meaning |", "|---|---|---|---|"]
            current = section
        cell = meaning.replace("|", "\\|")  # a literal | inside a table cell
        out.append(f"| `{key}` | `{default}` | {role} | {cell} |")
    return "\n".join(out[1:]) + "\n"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, config_reference())
    return markdown.replace(f"]({RESULTS_LINK}", f"]({RESULTS_SITE}")


def on_files(files, config):
    from mkdocs.structure.files import File

    for path in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, RESULTS_SITE + path.name, abs_src_path=str(path)))
    return files


if __name__ == "__main__":
    print(config_reference(), end="")
