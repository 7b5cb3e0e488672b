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
# Chunks of 4000 iterations of 64 env steps (a few seconds each here), a checkpoint at each
# chunk's end, and far more iterations than a test waits for.
CHUNK = 4000
SETTINGS = ["num_envs=4", "num_steps=16", "num_minibatches=2", "total_timesteps=20000000",
            f"log_every={CHUNK}", f"checkpoint_every={CHUNK}", "network.hidden_sizes=[16,16]"]
ACK = "SIGINT: training stops after the running chunk and saves a checkpoint; Ctrl-C again"


class Train:
    """`python -m jaxppo train` in a subprocess, its stderr read line by line as it comes."""

    def __init__(self, tmp_path: Path, cache: str | None, *args: str):
        self.run = tmp_path / "run"
        cmd = [sys.executable, "-m", "jaxppo", "train", "--no-progress", "--no-plot",
               "--set", f"compilation_cache_dir={cache or 'null'}"]
        if "--resume" not in args:
            cmd += ["--env", "CartPole-v1", "--defaults", "--runs-dir", str(tmp_path),
                    "--run-name", "run", "--set", *SETTINGS]
        self.proc = subprocess.Popen(cmd + list(args), stderr=subprocess.PIPE, text=True,
                                     env=dict(os.environ, PYTHONPATH=str(ROOT)))
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line))

    def rows(self) -> int:
        path = self.run / "metrics.jsonl"
        return path.read_text().count("\n") if path.exists() else 0

    def wait_rows(self, n: int, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while self.rows() < n:
            assert self.proc.poll() is None, self.err()
            assert time.monotonic() < deadline, "no metrics came"
            time.sleep(0.05)

    def wait_next_chunk(self, timeout: float = 300) -> int:
        """Wait until a chunk has ended, its checkpoint is written and the next chunk runs;
        the rows written by then."""
        self.wait_rows(CHUNK, timeout)
        deadline = time.monotonic() + timeout
        while not (self.run / "checkpoints" / str(CHUNK)).is_dir():
            assert time.monotonic() < deadline, "no checkpoint came"
            time.sleep(0.05)
        time.sleep(1.0)  # the next chunk has started (it takes seconds)
        return self.rows()

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
    """The acknowledgement comes while the chunk still runs (no new metric rows yet); the run
    then stops at the chunk's end with a checkpoint there and exits 130."""
    train = Train(tmp_path, compile_cache_dir)
    rows = train.wait_next_chunk()
    sent = time.monotonic()
    train.proc.send_signal(signal.SIGINT)
    acked = train.wait_line(ACK, timeout=30)
    assert acked - sent < 2.0, train.err()
    assert train.rows() == rows, "the acknowledgement waited for the chunk to end"
    assert train.finish() == 130, train.err()
    assert train.wait_line("SIGINT stopped training", 0) - acked > 0.5  # the chunk went on
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
    """A second Ctrl-C ends the process within moments, mid-chunk: exit 130, one message
    naming the checkpoint kept and the resume command, no traceback; `--resume` then trains
    the run to its end from that checkpoint."""
    train = Train(tmp_path, compile_cache_dir)
    rows = train.wait_next_chunk()
    train.proc.send_signal(signal.SIGINT)
    train.wait_line(ACK, timeout=30)
    sent = time.monotonic()
    train.proc.send_signal(signal.SIGINT)
    assert train.finish() == 130, train.err()
    assert time.monotonic() - sent < 3.0
    assert train.rows() == rows, "the second Ctrl-C waited for the chunk to end"
    err = train.err()
    assert "Traceback" not in err and "Exception ignored" not in err
    assert (f"Second SIGINT: stopped at once. {train.run} keeps the checkpoint of iteration "
            f"{rows} of 312500; continue with: jaxppo train --resume {train.run}") in err
    assert find_latest(train.run)[1] == rows
    assert not (train.run / "summary.json").exists()

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
