"""Every code block of the README and of the documentation site (docs/*.md) is checked, so the
first thing a newcomer copies works:

* python blocks run as written, in order, sharing one namespace per page, in a scratch folder
  (slow: they train); a block marked compile-only (it needs a Ray cluster) is compiled;
* every `python -m jaxppo train` command of a bash block builds a valid config as the CLI
  would (the env suites' tests train them: tests/envs/);
* every yaml block is a valid config (or config fragment);
* every block names its language, so none is skipped by accident.
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import yaml
from readme_commands import ROOT, code_blocks, doc_pages, readme_train_commands

# The pages whose snippets train long enough that their run time outweighs their compile run
# as a reader's would, with XLA's full optimisation (README's quickstart is getting-started's:
# both, whichever runs first); the other pages' snippets train for seconds, and compile with it
# off (tests/conftest.py), in less CPU time (measured in a cold suite: 2.5 against 9 CPU
# seconds for configuration.md, 7.6 against 28 for environments.md, 18 against 31 for runs.md,
# which alone timed about even; README's 37 against 62 the other way).
LONG_TRAINING_PAGES = {"README.md", "getting-started.md", "search.md"}

# What the checked blocks are written in; `text` blocks (usage listings) are not code.
LANGUAGES = {"python", "bash", "yaml", "text"}


def python_snippets(page) -> list[str]:
    return [code for lang, code, why in code_blocks(page) if lang == "python" and why is None]


def pages_with_python() -> list:
    return [p for p in doc_pages() if python_snippets(p)]


def test_every_code_block_is_selected():
    blocks = {p.name: code_blocks(p) for p in doc_pages()}
    unlabelled = {name: langs for name, b in blocks.items()
                  if (langs := [lang for lang, _, _ in b if lang not in LANGUAGES])}
    assert not unlabelled, f"blocks without a checked language: {unlabelled}"
    runs = {p.name: len(python_snippets(p)) for p in pages_with_python()}
    # the quickstart, the sweeps and PBT, a run's policy, export and video
    assert runs["README.md"] >= 1 and runs["getting-started.md"] >= 1
    assert runs["search.md"] >= 2 and runs["runs.md"] >= 3
    assert all(code.strip() for b in blocks.values() for _, code, _ in b)


def test_every_python_block_compiles():
    for page in doc_pages():
        for i, (lang, code, why) in enumerate(code_blocks(page)):
            if lang == "python":
                compile(code, f"{page.name} block {i + 1}", "exec")


def test_every_train_command_builds_a_valid_config():
    from jaxppo.cli import _build_parser
    from jaxppo.run.command import new_config

    commands = readme_train_commands()
    assert {argv[argv.index("--env") + 1].split(":")[0] for argv in commands} >= {
        "brax", "xminigrid", "jumanji", "craftax"}
    for argv in commands:
        config, _ = new_config(_build_parser().parse_args(argv))
        config.validate()


def test_every_yaml_block_is_a_valid_config():
    from jaxppo import PPOConfig

    checked = 0
    for page in doc_pages():
        for lang, code, _ in code_blocks(page):
            if lang == "yaml":
                PPOConfig.from_dict(yaml.safe_load(code)).validate()
                checked += 1
    assert checked >= 3


def test_the_config_reference_names_every_field():
    """docs/configuration.md holds the generated reference; its table of meanings and other
    libraries' names lists only fields that exist."""
    import re

    hooks = _docs_hooks()
    from jaxppo import PPOConfig
    from jaxppo.config_fields import keys

    page = (ROOT / "docs" / "configuration.md").read_text()
    assert hooks.MARKER in page
    reference = hooks.config_reference()
    every = [key for _, key, _, _ in keys(PPOConfig)]
    assert [row.split("`")[1] for row in reference.splitlines() if row.startswith("| `")] == every
    assert "| `network.hidden_sizes` | `[64, 64]` | shape |" in reference
    assert "| `lr` | `0.00025` | tunable |" in reference
    named = re.findall(r"^\| `([\w.]+)` \|", page, flags=re.MULTILINE)
    assert len(named) > 40 and not set(named) - set(every)


def _docs_hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks


def test_the_rendering_check_finds_each_kind_of_broken_page():
    """The check every docs build runs on each page (`make docs`, strict) finds what renders
    wrong although the build passes, each kind once, and lets a clean page through."""
    check = _docs_hooks().rendering_problems
    clean = ("<h2>Metrics<a class='headerlink' href='#m'>¶</a></h2><p>Per iteration: "
             "<code>kl</code> and <code>lr</code>.</p><pre><code>```yaml\nlr: 1\n```</code></pre>"
             "<h2>Export</h2><p><code>jaxppo export RUN</code> writes a file:</p>"
             "<p>Bases: <code>ConfigError</code></p>")
    assert check(clean) == []
    stray_fence = "<pre><code>jaxppo envs</code></pre><p>```</p><p>Next.</p>"
    mid_start = "<h2>Metrics</h2><p>(of episodes that ended in the iteration).</p>"
    mid_stop = "<p>because on a CPU a 256x256 MLP trains</p><h3>Recurrent policies</h3>"
    quote = "<p>give the lr as points (every value</p><blockquote><p>0), as it says.</p></blockquote>"
    for html, kind in [(stray_fence, "code fence"), (mid_start, "starts mid-sentence"),
                       (mid_stop, "stops mid-sentence"), (quote, "blockquote")]:
        problems = check(html)
        assert any(kind in p for p in problems), (kind, problems)


def _check_getting_started(namespace, tmp_path):
    # What the quickstart claims: 8 seeds of the tuned CartPole learn.
    returns = namespace["result"].metrics["episode_return_mean"]
    assert returns.shape[0] == 8 and np.nanmean(returns[:, -5:]) > 400
    summary = json.loads((tmp_path / "runs" / "quickstart" / "summary.json").read_text())
    assert summary["num_seeds"] == 8 and summary["completed"]


def _check_runs(namespace, tmp_path):
    # The run folder the snippets wrote, a policy that acts, its export and video.
    assert (tmp_path / "runs" / "cartpole-api" / "config.yaml").exists()
    assert namespace["act"].evaluate(episodes=4)["return_mean"] > 400
    assert (tmp_path / "cartpole.jaxexport").exists() and (tmp_path / "cartpole.gif").exists()
    assert namespace["actions"].shape == (3,)


def _check_search(namespace, tmp_path):
    assert namespace["metrics"]["episode_return_mean"].shape[0] == 3  # 3 lrs in one program
    assert namespace["population"].metrics["hp_lr"].shape[0] == 4
    assert (tmp_path / "runs" / "cartpole-pbt" / "search.json").exists()


CHECKS = {"README.md": _check_getting_started, "getting-started.md": _check_getting_started,
          "runs.md": _check_runs, "search.md": _check_search}


# The namespace and folder of each page's snippets once they ran, by their code: a page whose
# snippets are another's, word for word (README's quickstart is getting-started's), has its
# checks made on that run (the same code, seeds and numbers) instead of training it again.
_RAN: dict[tuple[str, ...], tuple[dict, object]] = {}


@pytest.mark.slow
@pytest.mark.parametrize("page", [
    pytest.param(p, marks=[pytest.mark.full_optimization] if p.name in LONG_TRAINING_PAGES else [])
    for p in pages_with_python()], ids=lambda p: p.name)
def test_every_python_snippet_of_the_page_runs_as_written(page, tmp_path, monkeypatch):
    snippets = tuple(python_snippets(page))
    if snippets not in _RAN:
        monkeypatch.chdir(tmp_path)
        namespace: dict = {}
        for i, code in enumerate(snippets):
            try:
                exec(compile(code, f"{page.name} python snippet {i + 1}", "exec"), namespace)  # noqa: S102
            except Exception as e:  # name the snippet, then fail with the original error
                raise AssertionError(f"{page.name} python snippet {i + 1} failed:\n{code}") from e
        _RAN[snippets] = (namespace, tmp_path)
    namespace, folder = _RAN[snippets]
    CHECKS.get(page.name, lambda *_: None)(namespace, folder)
