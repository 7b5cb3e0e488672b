"""The errors jaxppo raises on purpose, each message naming the problem and the fix; and
`warn`, its warnings attributed to the user's own line.

A leaf module: everything else imports from here, and it imports nothing from jaxppo.
"""

from __future__ import annotations

import os
import sys
import warnings


class ConfigError(ValueError):
    """An impossible or unknown configuration value; the message names field, value and fix."""


class CheckpointError(RuntimeError):
    """A run folder or checkpoint that cannot be resumed or loaded; the message names the
    path and what to do. Nothing in the run folder was changed."""


class RunFolderError(RuntimeError):
    """The run folder could not be written (a full disk, a read-only folder, permissions); the
    message names the file, the system's reason, what is already saved there and how to
    continue. Nothing already saved is removed."""


class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM stopped training once the running chunk had finished (one
    that comes during the last chunk stops nothing: the run completes); the run folder then
    holds a checkpoint of that iteration, the params and summary.json. `result` is the
    TrainResult so far; `signal_name` says which signal it was. (A KeyboardInterrupt, so
    `except Exception` does not swallow it.) A second signal does not wait for the chunk:
    `jaxppo train` ends at once, a library call raises a plain KeyboardInterrupt."""

    def __init__(self, message: str, signal_name: str, result=None):
        super().__init__(message)
        self.signal_name = signal_name
        self.result = result


class StopTraining(Exception):
    """Raised by a `jaxppo.train` callback to end training after the chunk it was called
    for (returning False does the same). The run checkpoints and finishes as a stopped run
    (`TrainResult.completed` False, `TrainResult.stopped` saying why); `train` returns
    normally, and `--resume` can continue it. The message, if any, is the reason given."""


class TrainingDivergedError(RuntimeError):
    """A loss, gradient or parameter became NaN/inf; metrics up to that point are kept."""

    def __init__(self, message: str, iteration: int, last_finite: dict | None):
        super().__init__(message)
        self.iteration = iteration
        self.last_finite = last_finite


class ActionMaskError(TrainingDivergedError):
    """The env's action mask left a state with no legal action, so the policy had none to
    choose; metrics up to the iteration before are kept."""


class RolloutTimeoutError(RuntimeError):
    """An actor thread of the actor-learner (max_policy_lag >= 1) handed the learner no
    rollout within rollout_timeout: its envs stopped answering. The message names the actor,
    its envs, what it was doing and the setting to raise if the envs are only slow."""


class ExportError(RuntimeError):
    """A policy that cannot be exported in the asked format (or a missing optional
    dependency); the message names what is unsupported and the alternative or install."""


class VideoError(RuntimeError):
    """A video that cannot be made: an env jaxppo cannot draw, or a format whose writer is
    missing; the message names the envs and formats that work, or the install."""


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn` attributed to the first caller outside jaxppo: the user's own line
    (`train(...)` in their script), not the jaxppo module that noticed the problem."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 2  # stacklevel 2: the caller of warn
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
