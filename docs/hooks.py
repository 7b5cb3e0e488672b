"""MkDocs hooks of the documentation site (mkdocs.yml, `hooks:`).

* The configuration reference is generated: where a page holds the line
  `<!-- config-reference -->`, the build puts one table per section of `PPOConfig`, each row
  read from the field's declaration in jaxppo/config.py (default, meaning, role), so the
  reference cannot drift from the code. `python docs/hooks.py` prints those tables.
* The result curves stay where `make experiments` writes them (experiments/results/*.png):
  the build adds them to the site as `assets/results/<name>.png`, and a page's links to
  `../experiments/results/<name>.png` (right when the page is read on its own, in the
  repository) point there.
* Each built page is checked for what renders wrong though the build passes (a stray code
  fence, a section or paragraph cut mid-sentence, an accidental blockquote): a warning, which
  `--strict` turns into a failed build.
"""

from __future__ import annotations

import dataclasses
import logging
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- config-reference -->"
RESULTS = ROOT / "experiments" / "results"
RESULTS_LINK, RESULTS_SITE = "../experiments/results/", "assets/results/"
LOG = logging.getLogger("mkdocs.plugins.jaxppo")

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


# ---------------------------------------------------------------------- rendering checks
class _Blocks(HTMLParser):
    """A page's rendered text as blocks: (tag, text) of each heading, paragraph, list item,
    table cell and blockquote outside code, and the text outside code blocks and spans."""

    BLOCKS = {"h1", "h2", "h3", "h4", "h5", "h6", "p", "li", "td", "th", "blockquote", "pre"}

    def __init__(self):
        super().__init__()
        self.blocks: list[list] = []  # [tag, text, starts in code, ends in code]
        self.loose_text: list[str] = []  # text outside <pre> and <code>
        self._open: list[list] = []
        self._code = 0
        self._skip = 0  # a heading's permalink anchor

    def handle_starttag(self, tag, attrs):
        if tag in self.BLOCKS:
            block = [tag, "", False, False]
            self.blocks.append(block)
            self._open.append(block)
        if tag in ("pre", "code"):
            self._code += 1
        if tag == "a" and ("class", "headerlink") in attrs:
            self._skip += 1

    def handle_endtag(self, tag):
        if tag in ("pre", "code"):
            self._code -= 1
        if tag == "a" and self._skip:
            self._skip -= 1
        if tag in self.BLOCKS and self._open and self._open[-1][0] == tag:
            self._open.pop()

    def handle_data(self, data):
        if self._skip:
            return
        if self._open and data.strip():
            block = self._open[-1]
            if not block[1].strip():
                block[2] = bool(self._code)
            block[1] += data
            block[3] = bool(self._code)
        elif self._open:
            self._open[-1][1] += data
        if not self._code:
            self.loose_text.append(data)


def rendering_problems(html: str) -> list[str]:
    """What `mkdocs build --strict` lets through but a reader sees as broken: a code fence shown
    as text, a section whose first paragraph starts mid-sentence, a paragraph that stops
    mid-sentence, and a blockquote (the pages have none on purpose: a line that starts with
    `>` renders as one)."""
    parser = _Blocks()
    parser.feed(html)
    problems = []
    if any("```" in text for text in parser.loose_text):
        problems.append("a code fence (```) is shown as text: a fence without its pair")
    # Text that starts or ends in code (`jaxppo plot RUN`, `Bases: ConfigError`) is left alone.
    blocks = [(tag, " ".join(text.split()), starts, ends)
              for tag, text, starts, ends in parser.blocks]
    for (tag, text, _, _), (next_tag, next_text, starts, _) in zip(blocks, blocks[1:]):
        if (tag in ("h2", "h3", "h4") and next_tag == "p" and next_text and not starts
                and next_text[0] in "abcdefghijklmnopqrstuvwxyz(,;"):
            problems.append(f"the section {text!r} starts mid-sentence: {next_text[:60]!r}")
    for tag, text, _, ends in blocks:
        if tag == "p" and text and not ends and text[-1] not in ".:!?)":
            problems.append(f"a paragraph stops mid-sentence: ...{text[-60:]!r}")
        if tag == "blockquote":
            problems.append(f"a blockquote (a line starting with '>'?): {text[:60]!r}")
    return problems


def on_page_content(html: str, page, config, files) -> str:
    for problem in rendering_problems(html):
        LOG.warning("%s: %s", page.file.src_path, problem)  # --strict makes it an error
    return html
