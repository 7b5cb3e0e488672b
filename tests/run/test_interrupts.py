"""Ctrl-C and SIGTERM on the command line: the first is acknowledged at once and stops after the
running chunk with a checkpoint; a second stops at once, without a traceback, leaving a folder
that resumes; one that comes during the last chunk leaves a complete run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jaxppo
from jaxppo.config import NetworkConfig, PPOConfig
from jaxppo.run.checkpoints import find_latest

ROOT = Path(__file__).resolve().parents[2]
# Chunks of 50 iterations of 64 env steps and a checkpoint at each chunk's end, on a CartPole
# whose steps wait while a gate file exists (tests/custom_env_module.py:GatedCartPole): a test
# holds a chunk running for as long as it needs, so no verdict rests on how fast the machine is.
CHUNK = 50
SETTINGS = ["num_envs=4", "num_steps=16", "num_minibatches=2", "total_timesteps=20000000",
            f"log_every={CHUNK}", f"checkpoint_every={CHUNK}", "network.hidden_sizes=[16,16]"]
ACK = "SIGINT: training stops after the running chunk and saves a checkpoint; Ctrl-C again"


class Train:
    """`python -m jaxppo train` in a subprocess, its stderr read line by line as it comes."""

    def __init__(self, tmp_path: Path, cache: str | None, *args: str):
        self.run = tmp_path / "run"
        self.gate = tmp_path / "gate"
        cmd = [sys.executable, "-m", "jaxppo", "train", "--no-progress", "--no-plot",
               "--set", f"compilation_cache_dir={cache or 'null'}"]
        if "--resume" not in args:
            cmd += ["--env", "custom_env_module:GatedCartPole", "--defaults", "--runs-dir",
                    str(tmp_path), "--run-name", "run", "--set", *SETTINGS]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
                   JAXPPO_TEST_GATE=str(self.gate))
        self.proc = subprocess.Popen(cmd + list(args), stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line))

    def rows(self) -> int:
        path = self.run / "metrics.jsonl"
        return path.read_text().count("\n") if path.exists() else 0

    def _wait(self, ready, what: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.proc.poll() is None, self.err()
            assert time.monotonic() < deadline, f"{what} did not come:\n{self.err()}"
            time.sleep(0.02)

    def hold_a_chunk(self) -> int:
        """Once a first checkpoint is written, close the gate and wait until a chunk's env
        steps wait at it: that chunk now runs until `release`. The rows written by then (every
        earlier chunk's: the loop writes a chunk's rows before it starts the next)."""
        self._wait(lambda: (self.run / "checkpoints" / str(CHUNK)).is_dir(), "a checkpoint")
        self.gate.touch()
        self._wait(Path(f"{self.gate}.reached").exists, "a chunk held at the gate")
        rows = self.rows()
        assert rows >= CHUNK and rows % CHUNK == 0, rows
        return rows

    def release(self) -> float:
        """Open the gate (the held chunk goes on); when."""
        self.gate.unlink()
        return time.monotonic()

    def wait_line(self, text: str, timeout: float) -> float:
        """When a stderr line with `text` came (waiting for it up to `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            for t, line in list(self.lines):
                if text in line:
                    return t
            if time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        raise AssertionError(f"no line with {text!r} within {timeout}s:\n{self.err()}")

    def finish(self, timeout: float = 300) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code

    def err(self) -> str:
        return "".join(line for _, line in self.lines)


def test_first_sigint_is_acknowledged_at_once_and_stops_after_the_chunk(tmp_path, compile_cache_dir):
    """The acknowledgement comes while the chunk is held running (no new metric rows, the
    process alive); once the chunk is let go, the run stops at its end with a checkpoint there
    and exits 130."""
    train = Train(tmp_path, compile_cache_dir)
    rows = train.hold_a_chunk()
    train.proc.send_signal(signal.SIGINT)
    train.wait_line(ACK, timeout=60)
    assert train.proc.poll() is None and train.rows() == rows, train.err()
    released = train.release()
    assert train.finish() == 130, train.err()
    assert train.wait_line("SIGINT stopped training", 0) > released  # the chunk went on
    err = train.err()
    done = train.rows()
    assert done == rows + CHUNK
    assert find_latest(train.run)[1] == done
    assert json.loads((train.run / "summary.json").read_text())["iterations"] == done
    assert (f"SIGINT stopped training after iteration {done} of 312500: checkpoint, params and "
            f"summary of iteration {done} are in {train.run}; continue with: jaxppo train "
            f"--resume {train.run}") in err
    assert "Traceback" not in err and "Exception ignored" not in err


def test_second_sigint_stops_at_once_and_the_folder_resumes(tmp_path, compile_cache_dir):
    """A second Ctrl-C ends the process while its chunk is still held, mid-chunk: exit 130,
    one message naming the checkpoint kept and the resume command, no traceback; `--resume`
    then trains the run to its end from that checkpoint."""
    train = Train(tmp_path, compile_cache_dir)
    rows = train.hold_a_chunk()
    train.proc.send_signal(signal.SIGINT)
    train.wait_line(ACK, timeout=60)
    train.proc.send_signal(signal.SIGINT)
    assert train.finish(timeout=60) == 130, train.err()  # with the gate still closed
    assert train.rows() == rows, "the second Ctrl-C waited for the chunk to end"
    err = train.err()
    assert "Traceback" not in err and "Exception ignored" not in err
    assert (f"Second SIGINT: stopped at once. {train.run} keeps the checkpoint of iteration "
            f"{rows} of 312500; continue with: jaxppo train --resume {train.run}") in err
    assert find_latest(train.run)[1] == rows
    assert not (train.run / "summary.json").exists()

    train.release()
    end = rows + CHUNK  # resume to a nearer end: one more chunk
    resumed = Train(tmp_path, compile_cache_dir, "--resume", str(train.run),
                    "--set", f"total_timesteps={end * 64}")
    assert resumed.finish() == 0, resumed.err()
    assert "done: final return" in resumed.err()
    iterations = [json.loads(line)["iteration"]
                  for line in (train.run / "metrics.jsonl").read_text().splitlines()]
    assert iterations == list(range(1, end + 1))
    assert find_latest(train.run)[1] == end


def test_a_signal_during_the_last_chunk_leaves_a_complete_run(tmp_path, capsys):
    """SIGINT once the last chunk has begun stops nothing: the run completes (no
    TrainingInterrupted, `interrupted` None), its folder is complete, and the
    acknowledgement says that training ends with that chunk."""
    cfg = PPOConfig(env="CartPole-v1", num_envs=4, num_steps=16, total_timesteps=6 * 64,
                    num_minibatches=2, network=NetworkConfig((16, 16)), log_every=3,
                    compilation_cache_dir=None)
    before = signal.getsignal(signal.SIGINT)

    def interrupt(rows):
        if rows[-1]["iteration"] == 6:  # the last chunk's rows: the loop is at its end
            os.kill(os.getpid(), signal.SIGINT)

    result = jaxppo.train(cfg, run_dir=tmp_path / "run", progress=False, callback=interrupt)
    assert result.completed and result.interrupted is None and result.iterations_done == 6
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["iterations"] == 6
    assert find_latest(tmp_path / "run")[1] == 6
    assert ("SIGINT: the running chunk is the last one: training ends with it and saves as "
            "usual") in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is before
