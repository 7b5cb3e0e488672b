"""The `Runner` protocol: what the run loop (jaxppo.run.loop) drives, wherever the chunk runs.

Three classes implement it: `jaxppo.program.ChunkRunner` (the compiled chunk on this
process's devices), `jaxppo.run.hostloop.HostLoopRunner` (a gymnasium env stepped in Python)
and `jaxppo.distributed.group.HostGroup` (the chunk on several Ray hosts).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from jaxppo.core.algorithm import Algorithm, TrainState


class Runner(Protocol):
    """A run's program and its state, advanced one chunk of iterations at a time.

    Attributes:
        algorithm: the run's Algorithm (for TrainResult's policy, value and evaluation).
        shards: the shards the envs are split over (devices of every host); 1 unsharded.
        hosts: the processes the run is spread over (1 unless several hosts).
        compile_seconds: the time building and compiling the program took.
        params_replicated: True when the params in `final_state()` carry a leading shard axis
            of identical copies (False for one shard, or shards holding different PBT members).
        host_failures: the hosts lost and replaced so far, one dict each (empty in-process).
    """

    algorithm: Algorithm
    shards: int
    hosts: int
    compile_seconds: float
    params_replicated: bool
    host_failures: list[dict]

    def train_chunk(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """Train iterations start+1..stop (at most one chunk).

        Returns:
            Their metrics, name -> numpy array [num_seeds?, stop - start].
        """

    def snapshot(self) -> TrainState:
        """The state after the last chunk in the unsharded layout (numpy), as checkpoints hold it."""

    def final_state(self) -> Any:
        """The state after the last chunk as `TrainResult.state` holds it."""

    def close(self) -> None:
        """Release what the runner holds (envs, Ray learners); the state is no longer needed."""
