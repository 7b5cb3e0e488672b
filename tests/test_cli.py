"""`python -m jaxppo` end to end in a subprocess: run folder contents, errors, help."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jaxppo import ConfigError, PPOConfig

REPO = Path(__file__).resolve().parent.parent
REQUIRED_KEYS = {
    "iteration", "env_steps", "episode_return_mean", "episode_length_mean", "policy_loss",
    "value_loss", "entropy", "kl", "approx_kl", "clip_fraction", "grad_norm", "lr",
    "wall_time", "sps",
}


def run_cli(*args, timeout=300, cwd=None, extra_env=None):
    env = dict(os.environ, **(extra_env or {}))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "jaxppo", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or REPO, env=env)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, compile_cache_dir):
    runs = tmp_path_factory.mktemp("runs")
    cache = [f"compilation_cache_dir={compile_cache_dir}"] if compile_cache_dir else ["compilation_cache_dir=null"]
    proc = run_cli(
        "train", "--env", "CartPole-v1",
        "--set", "total_timesteps=5000", "num_envs=4", "num_steps=32",
        # keep the compiled program small whatever tuned config ships for CartPole
        "num_epochs=2", "num_minibatches=2", "network.hidden_sizes=[16,16]", *cache,
        "--runs-dir", str(runs), "--run-name", "r", "--no-progress",
    )
    return proc, runs / "r"


def test_exit_code_and_files(short_run):
    proc, run = short_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("config.yaml", "metrics.jsonl", "params.msgpack", "summary.json", "curve.png"):
        assert (run / name).is_file(), name
        assert (run / name).stat().st_size > 0, name
    assert "Traceback" not in proc.stderr


def test_config_yaml_round_trips(short_run):
    _, run = short_run
    data = yaml.safe_load((run / "config.yaml").read_text())
    cfg = PPOConfig.from_dict(data)
    assert cfg.env == "CartPole-v1"
    assert (cfg.total_timesteps, cfg.num_envs, cfg.num_steps) == (5000, 4, 32)
    assert cfg.network.hidden_sizes == (16, 16)
    cfg.validate()
    assert PPOConfig.from_dict(cfg.to_dict()) == cfg
    assert yaml.safe_load(yaml.safe_dump(cfg.to_dict())) == data


def test_metrics_jsonl(short_run):
    _, run = short_run
    lines = (run / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    n_iter = 5000 // (4 * 32)
    assert [r["iteration"] for r in rows] == list(range(1, n_iter + 1))
    for r in rows:
        missing = REQUIRED_KEYS - set(r)
        assert not missing, missing
        assert r["env_steps"] == r["iteration"] * 128
        for k in ("policy_loss", "value_loss", "entropy", "grad_norm"):
            assert isinstance(r[k], float), (r["iteration"], k)
    assert any(r["episode_return_mean"] is not None for r in rows)


def test_summary_json(short_run):
    _, run = short_run
    s = json.loads((run / "summary.json").read_text())
    assert s["env"] == "CartPole-v1" and s["num_seeds"] == 1
    assert s["env_steps"] == (5000 // 128) * 128
    assert s["final_return_mean"] > 0
    assert s["train_seconds"] > 0 and s["compile_seconds"] >= 0 and s["sps"] > 0


def test_params_msgpack_loads(short_run):
    from flax import serialization

    _, run = short_run
    data = serialization.msgpack_restore((run / "params.msgpack").read_bytes())
    assert "params" in data
    leaves = [x for x in _leaves(data["params"])]
    assert leaves and all(getattr(x, "size", 0) > 0 for x in leaves)


def _leaves(d):
    for v in d.values():
        if isinstance(v, dict):
            yield from _leaves(v)
        else:
            yield v


def test_curve_png(short_run):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg

    _, run = short_run
    png = run / "curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(png)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert img.std() > 0  # not a blank image


def test_existing_run_folder_is_refused(short_run):
    proc, run = short_run
    again = run_cli("train", "--env", "CartPole-v1", "--runs-dir", str(run.parent), "--run-name", "r",
                    "--no-progress", timeout=120)
    assert again.returncode == 2
    assert "already exists" in again.stderr and "Traceback" not in again.stderr


# ------------------------------------------------------------------ errors: exit 2, no traceback
@pytest.mark.parametrize(
    "args,expected",
    [
        (["--env", "CartPole-v0"], ["CartPole-v0", "CartPole-v1"]),
        (["--env", "cartpole"], ["cartpole", "CartPole-v1"]),
        (["--env", "CartPole-v1", "--set", "num_env=8"], ["num_env", "num_envs"]),
        (["--env", "CartPole-v1", "--set", "network.hidden_size=[8]"], ["network.hidden_size", "network.hidden_sizes"]),
        (["--env", "CartPole-v1", "--set", "num_minibatches=3"], ["num_minibatches=3"]),
        (["--env", "CartPole-v1", "--set", "gamma=1.5"], ["gamma=1.5"]),
        (["--env", "CartPole-v1", "--set", "lr"], ["key=value"]),
    ],
)
def test_bad_input_exits_2_with_message(args, expected, tmp_path):
    proc = run_cli("train", *args, "--runs-dir", str(tmp_path), "--run-name", "x", "--no-progress",
                   timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    for word in expected:
        assert word in proc.stderr, (word, proc.stderr)
    if args[1] != "CartPole-v1":  # an unknown env: told before any run folder is named
        assert proc.stderr.startswith("error: env=") and "run folder" not in proc.stderr
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())


@pytest.mark.parametrize("env,expected", [
    ("envpool:Breakuot-v5", "did you mean 'envpool:Breakout-v5'"),
    ("jaxmarl:smax:3mm", "did you mean 'jaxmarl:smax:3m'"),
    ("brax:typo", "is not a registered Brax environment"),
])
def test_a_suites_unknown_env_is_told_before_any_run_folder(env, expected, tmp_path, capsys):
    from jaxppo import cli

    code = cli.main(["train", "--env", env, "--runs-dir", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: env={env!r}") and expected in err, err
    assert "run folder" not in err and not any(tmp_path.iterdir())


def test_missing_config_file_exits_2(tmp_path):
    proc = run_cli("train", "--config", str(tmp_path / "nope.yaml"), "--runs-dir", str(tmp_path),
                   timeout=120)
    assert proc.returncode == 2 and "nope.yaml" in proc.stderr and "Traceback" not in proc.stderr


def test_train_help_mentions_every_option():
    proc = run_cli("train", "--help", timeout=120)
    assert proc.returncode == 0
    from jaxppo.cli import _build_parser

    parser = _build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    train_parser = sub.choices["train"]
    options = [s for a in train_parser._actions for s in a.option_strings if s.startswith("--")]
    assert {"--env", "--config", "--set", "--seeds", "--runs-dir", "--run-name", "--no-progress"} <= set(options)
    for opt in options:
        assert opt in proc.stdout, opt
    # every config key, with its default, under "config keys"
    import dataclasses

    from jaxppo.config import NetworkConfig, PPOConfig

    keys = proc.stdout.split("config keys", 1)[1]
    for f in dataclasses.fields(PPOConfig):
        if f.name != "network":
            assert f"\n    {f.name} = " in keys, f.name
    for f in dataclasses.fields(NetworkConfig):
        assert f"\n    network.{f.name} = " in keys, f.name
    assert "    checkpoint_minutes = 5.0  -- minutes between checkpoints" in keys
    assert "    use_kl_loss = false  -- " in keys and "    num_devices = auto  -- " in keys


def test_config_keys_help_parses_no_python(monkeypatch):
    """The help's config keys come from the fields' declarations: no ast.parse (which
    inspect.getsource runs for a class), whose AST state CPython 3.11 shares between threads
    and which can then fail with a spurious SystemError while another thread parses."""
    import ast

    from jaxppo.run import command

    expected = command.config_keys_help()
    parsed, real_parse = [], ast.parse
    monkeypatch.setattr(ast, "parse", lambda *a, **k: parsed.append(a) or real_parse(*a, **k))
    got = command.config_keys_help()
    monkeypatch.undo()
    assert not parsed, "config_keys_help ran ast.parse"
    assert got == expected
    assert "    network.hidden_sizes = [64, 64]  -- " in expected


def test_top_level_help_lists_commands():
    proc = run_cli("--help", timeout=120)
    assert proc.returncode == 0
    for cmd in ("train", "plot", "envs"):
        assert cmd in proc.stdout


def _cli_out(capsys, *argv) -> str:
    from jaxppo import cli

    assert cli.main(list(argv)) == 0
    return capsys.readouterr().out


def test_envs_lists_registered_names_spaces_and_tuned_configs(capsys):
    gymnax, suites, tuned = _cli_out(capsys, "envs").strip().split("\n\n")
    rows = {line.split()[0]: line.split()[1:] for line in gymnax.splitlines()[1:]}
    assert rows["CartPole-v1"] == ["Box(4)", "Discrete(2)", "yes"]
    assert rows["Pendulum-v1"] == ["Box(3)", "Box(1)", "yes"]
    assert rows["Breakout-MinAtar"] == ["Box(10x10x4)", "Discrete(3)", "yes"]
    assert rows["UmbrellaChain-bsuite"] == ["Box(3)", "Discrete(2)"]  # no tuned config
    assert "downloads MNIST" in " ".join(rows["MNISTBandit-bsuite"])  # listed, never built
    names = _cli_out(capsys, "envs", "--names").split()
    assert names[0] == "CartPole-v1" and "Pendulum-v1" in names and len(names) == len(rows)
    # the other suites, each as an env names it, installed here (the dev extras)
    listed = {line.split()[0]: line for line in suites.splitlines()[2:]}
    assert set(listed) == {"brax", "jumanji", "craftax", "xminigrid", "jaxmarl", "gymnasium",
                           "envpool", "your"}
    assert listed["envpool"].split()[1] == "envpool:<task>" and listed["envpool"].endswith(" yes")
    assert "actor-learner" in listed["gymnasium"] and "multi-agent" in listed["jaxmarl"]
    assert " ".join(tuned.split()) == (
        "Tuned configs of other suites: envpool:Breakout-v5, envpool:Pong-v5, "
        "jaxmarl:MPE_simple_spread_v3, jaxmarl:overcooked:cramped_room, jaxmarl:smax:2s3z, "
        "jaxmarl:smax:3m (every other Atari game starts from Breakout-v5's, every other SMAX map "
        "from 3m's)")
    rows = {line.split()[0]: line.split()[1:]
            for line in _cli_out(capsys, "envs", "--suite", "gymnasium").splitlines()[1:]}
    assert rows["gymnasium:CartPole-v1"] == ["gymnax's", "CartPole-v1"]
    assert rows["gymnasium:Pendulum-v1"] == []  # gymnax's is tuned with a transform


def test_envs_of_one_suite_and_of_a_suite_not_installed(monkeypatch):
    import dataclasses

    from jaxppo.envs import catalog

    table, note = catalog.suite_table("jaxmarl").split("\n\n")
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines()}
    assert note.startswith("Every other SMAX map starts from jaxmarl:smax:3m's tuned config")
    assert rows["jaxmarl:MPE_simple_spread_v3"] == ["yes"] and rows["jaxmarl:smax:2s3z"] == ["yes"]
    assert rows["jaxmarl:smax:5m_vs_6m"] == ["jaxmarl:smax:3m's"]  # every SMAX map: 3m's
    assert rows["jaxmarl:MPE_simple_tag_v3"] == [] and "jaxmarl:overcooked:cramped_room" in rows
    names = catalog.suite_table("envpool", names_only=True).splitlines()
    assert "envpool:Breakout-v5" in names and all(n.startswith("envpool:") for n in names)
    listing = catalog.suite_table("envpool")
    assert "envpool:Breakout-v5's tuned config" in listing.splitlines()[-1]
    assert catalog.prefixes_text().startswith("brax:<name>, jumanji:<Id>,")
    missing = dataclasses.replace(catalog.SUITES_BY_PREFIX["brax"], package="no_such_package_x")
    monkeypatch.setitem(catalog.SUITES_BY_PREFIX, "brax", missing)
    with pytest.raises(ConfigError, match=r"^the brax suite needs the no_such_package_x package: "
                                          r"pip install 'jaxppo\[brax\]'$"):
        catalog.suite_table("brax")


def test_config_precedence_defaults_tuned_file_set(tmp_path):
    """defaults < the env's tuned config < --config file < --set, as the README says; the
    env is --env or the file's."""
    import argparse

    from jaxppo.run import command

    parser = argparse.ArgumentParser()
    command.add_config_flags(parser)
    parser.add_argument("--run-name")
    path = tmp_path / "c.yaml"
    path.write_text("env: CartPole-v1\nlr: 0.005\nnetwork: {activation: relu}\n")
    tuned = PPOConfig.tuned("CartPole-v1")

    cfg, source = command.new_config(parser.parse_args(["--config", str(path), "--set", "num_epochs=3"]))
    assert (cfg.lr, cfg.num_epochs, cfg.network.activation) == (0.005, 3, "relu")  # file, --set
    assert cfg.num_envs == tuned.num_envs != PPOConfig().num_envs  # from the tuned config
    assert cfg.network.hidden_sizes == tuned.network.hidden_sizes
    assert source == f"defaults < tuned CartPole-v1 < {path} < --set"

    cfg, source = command.new_config(parser.parse_args(["--config", str(path), "--defaults"]))
    assert cfg.num_envs == PPOConfig().num_envs and cfg.lr == 0.005 and source == f"defaults < {path}"
    cfg, _ = command.new_config(parser.parse_args(["--env", "Acrobot-v1", "--config", str(path)]))
    assert cfg.env == "Acrobot-v1" and cfg.num_envs == PPOConfig.tuned("Acrobot-v1").num_envs


def test_a_gymnasium_env_starts_from_gymnaxs_tuned_config_of_the_same_env():
    """`--env gymnasium:CartPole-v1` gets the tuned CartPole-v1 config (the config: line says
    whose); an env whose tuned config wraps the gymnax env (Pendulum's discretised actions),
    or --defaults, gets the defaults."""
    import argparse

    from jaxppo.run import command

    parser = argparse.ArgumentParser()
    command.add_config_flags(parser)
    parser.add_argument("--run-name")
    cfg, source = command.new_config(parser.parse_args(["--env", "gymnasium:CartPole-v1"]))
    assert cfg == PPOConfig.tuned("CartPole-v1").replace(env="gymnasium:CartPole-v1")
    assert source == "defaults < tuned CartPole-v1 (gymnax's, the same env)"
    for args in (["--env", "gymnasium:Pendulum-v1"], ["--env", "gymnasium:CartPole-v1", "--defaults"]):
        cfg, source = command.new_config(parser.parse_args(args))
        assert cfg == PPOConfig(env=args[1]) and source == "defaults", args


def test_a_platform_this_machine_lacks_is_a_clear_error(tmp_path):
    """JAX_PLATFORMS=cuda on a machine without a GPU: JAX's own error is a bare
    AssertionError from deep inside; jaxppo names the variable and the fix, creates nothing."""
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("this machine has an accelerator")
    proc = run_cli("train", "--env", "CartPole-v1", "--runs-dir", str(tmp_path / "runs"),
                   extra_env={"JAX_PLATFORMS": "cuda"}, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "JAX cannot start a backend for JAX_PLATFORMS='cuda'" in proc.stderr
    assert "Unset JAX_PLATFORMS (or set it to cpu)" in proc.stderr
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------ adversarial input, in-process
TINY_SET = ["total_timesteps=2048", "num_envs=4", "num_steps=16", "num_minibatches=2",
            "compilation_cache_dir=null", "network.hidden_sizes=[8]"]


def _main(capsys, *argv):
    from jaxppo import cli

    code = cli.main(list(argv))
    return code, capsys.readouterr().err


@pytest.mark.parametrize("extra,words", [
    (["--env", ""], ["--env '' is empty", "CartPole-v1"]),
    (["--run-name", "../escape"], ["--run-name '../escape' must be a plain folder name"]),
    (["--run-name", "a/b"], ["--run-name 'a/b' must be a plain folder name"]),
    (["--run-name", "."], ["--run-name '.' must be a plain folder name"]),
    (["--run-name", ""], ["--run-name '' must be a plain folder name"]),
    (["--run-name", "a" * 300], ["is 300 bytes long (300 characters), more than the 255 bytes",
                                 "allows in a name: choose a shorter --run-name"]),
    (["--run-name", "ü" * 130], ["is 260 bytes long (130 characters), more than the 255 bytes"]),
    (["--set", "seed=99999999999999999999"], ["seed=99999999999999999999 must be an integer from -2**63"]),
    (["--set", "compilation_cache_dir=5"], ["compilation_cache_dir=5 must be a folder path"]),
    (["--set", "env_kwargs={max_steps_in_episode: abc}"], ["env_kwargs max_steps_in_episode='abc' must be a number"]),
    (["--set", "env_kwargs={gravity: [1, 2]}"], ["env_kwargs gravity=[1, 2] must be a number"]),
    (["--set", "network.hidden_sizes=64"], ["network.hidden_sizes=64 must be a non-empty list"]),
    (["--set", "network.hidden_sizes=null"], ["network.hidden_sizes=None must be a non-empty list"]),
    (["--set", "network.conv_channels=16"], ["network.conv_channels=16 / conv_kernel=3 must be positive"]),
    (["--set", "network.conv_channels=[32]"], ["network.conv_channels=[32] only shapes a CNN torso"]),
    (["--set", "eval_every=8", "eval_max_steps=1e12"], ["eval_max_steps=1000000000000 is more than 2147483647"]),
    (["--set", "lr=1e300"], ["lr=1e+300 is beyond the float32 range"]),
    (["--set", "num_env=8"], ["num_env", "num_envs"]),
])
def test_bad_train_input_in_process_exits_2_and_creates_nothing(tmp_path, capsys, extra, words):
    runs = tmp_path / "runs"
    code, err = _main(capsys, "train", "--env", "CartPole-v1", "--set", *TINY_SET, *extra,
                      "--runs-dir", str(runs), "--no-progress", "--no-plot")
    assert code == 2, err
    # The error is the last line; checks that need the env come after the "config: ...;
    # run folder: ..." line, and every check before "compiling ..." (nothing is compiled or
    # written then).
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: ") and "Traceback" not in err and len(lines) <= 2, err
    assert "compiling" not in err, err
    for w in words:
        assert w in lines[-1], (w, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no runs dir, no ../escape


@pytest.mark.parametrize("runs_dir", ["f", "f/sub"])
def test_a_runs_dir_where_a_file_stands_exits_2_before_compiling(tmp_path, capsys, runs_dir):
    (tmp_path / "f").write_text("x")
    code, err = _main(capsys, "train", "--env", "CartPole-v1", "--set", *TINY_SET,
                      "--runs-dir", str(tmp_path / runs_dir), "--run-name", "r", "--no-progress")
    assert code == 2 and "is a file, not a folder" in err and "compiling" not in err, err
    assert (tmp_path / "f").read_text() == "x"


def _metrics_run(tmp_path, rows, config="env: CartPole-v1\n"):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if config is not None:
        (run / "config.yaml").write_text(config)
    return run


GOOD_ROWS = [{"iteration": i, "env_steps": 64 * i, "episode_return_mean": 10.0 + i,
              "wall_time": 1.0 + i, "sps": 100.0} for i in range(1, 6)]


@pytest.mark.parametrize("rows,words", [
    ([{"iteration": 1, "env_steps": 999, "foo": 1}], ["row 1 has wall_time=None, not a number"]),
    ([{"iteration": 1, "env_steps": "a", "wall_time": 1.0}], ["row 1 has env_steps='a', not a number"]),
    (GOOD_ROWS + [{"iteration": 6, "env_steps": 384, "wall_time": 7.0, "episode_return_mean": "x"}],
     ["row 6 has episode_return_mean='x', not a number"]),
])
def test_plot_of_foreign_metric_rows_exits_2(tmp_path, capsys, rows, words):
    run = _metrics_run(tmp_path, rows)
    code, err = _main(capsys, "plot", str(run), "-o", str(tmp_path / "o.png"))
    assert code == 2 and "is not a jaxppo metrics file" in err and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)
    assert not (tmp_path / "o.png").exists()


@pytest.mark.parametrize("out,words", [
    ("nodir/x.png", ["the folder", "nodir does not exist"]),
    ("run", ["is a folder; give a file name"]),
    ("x.txt", [".txt is not an image format matplotlib writes", ".png"]),
    ("curves", ["no extension is not an image format"]),
])
def test_plot_output_that_cannot_be_written_exits_2_before_drawing(tmp_path, capsys, out, words):
    run = _metrics_run(tmp_path, GOOD_ROWS)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code, err = _main(capsys, "plot", str(run), "-o", str(tmp_path / out))
    assert code == 2 and err.startswith(f"error: -o {tmp_path / out}: ") and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_plot_of_a_run_with_a_damaged_config_yaml_draws_with_a_note(tmp_path, capsys):
    run = _metrics_run(tmp_path, GOOD_ROWS, config="{{{ not yaml")
    with pytest.warns(UserWarning, match=r"config\.yaml is not a readable config .*the legend leaves out"):
        code, err = _main(capsys, "plot", str(run), "-o", str(tmp_path / "o.png"))
    assert code == 0 and (tmp_path / "o.png").stat().st_size > 0, err
    assert "Traceback" not in err


def test_a_librarys_warning_is_a_one_line_note_without_colour_codes():
    """The CLI's notes: a warning's message alone, the colour codes some libraries put in
    theirs (gymnasium's logger) taken out."""
    from jaxppo.cli import _note

    coloured = "\x1b[33mWARN: the env's own warning\x1b[0m"
    assert _note(UserWarning(coloured), UserWarning, "f.py", 3) == (
        "note: WARN: the env's own warning\n")
    assert _note("total_timesteps=100 is not", UserWarning, "f.py", 1) == (
        "note: total_timesteps=100 is not\n")


def test_compiling_is_said_once_the_checks_pass_with_the_time_it_took(tmp_path, capsys):
    """Not a promise of seconds before the checks, but a line once they have passed and the
    time compiling took (a line per step when stderr is not a terminal, as here)."""
    code, err = _main(capsys, "train", "--env", "CartPole-v1", "--set", *TINY_SET,
                      "--runs-dir", str(tmp_path), "--run-name", "r", "--no-plot")
    assert code == 0, err
    lines = err.splitlines()
    i = lines.index("compiling the training program ...")
    assert lines[0].startswith("config: ") and i == 1, err
    assert re.fullmatch(r"compiling the training program \.\.\. done in \d+\.\d s", lines[i + 1]), err
    assert lines[i + 2].startswith("layout: "), err
