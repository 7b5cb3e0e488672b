"""Every Python snippet of the README runs as written (in order, sharing one namespace, in a
scratch folder), so the first thing a newcomer copies works."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def python_snippets() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_the_readme_has_python_snippets():
    snippets = python_snippets()
    assert len(snippets) >= 3 and all(s.strip() for s in snippets)


@pytest.mark.slow
def test_every_readme_python_snippet_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for i, code in enumerate(python_snippets()):
        try:
            exec(compile(code, f"README.md python snippet {i + 1}", "exec"), namespace)
        except Exception as e:  # name the snippet, then fail with the original error
            raise AssertionError(f"README python snippet {i + 1} failed:\n{code}") from e
    # What the snippets claim: 8 seeds of the tuned CartPole learn, the policy acts.
    returns = namespace["result"].metrics["episode_return_mean"]
    assert returns.shape[0] == 8 and np.nanmean(returns[:, -5:]) > 400
    assert (tmp_path / "runs" / "cartpole-api" / "config.yaml").exists()
    assert namespace["act"].evaluate(episodes=4)["return_mean"] > 400
