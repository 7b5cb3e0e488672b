"""The `Runner` protocol: what the run loop (jaxppo.run.loop) drives, wherever the chunk runs.

Four classes implement it: `ChunkRunner` (below: the compiled chunk on this process's
devices), `jaxppo.run.hostloop.HostLoopRunner` (a gymnasium env stepped in Python),
`jaxppo.run.actorlearner.ActorLearnerRunner` (the same with actor threads, max_policy_lag >=
1) and `jaxppo.distributed.group.HostGroup` (the chunk on several Ray hosts).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.core.algorithm import Algorithm, TrainState
from jaxppo.core.hyperparams import HyperParams
from jaxppo.program import build, memory
from jaxppo.program.build import Program
from jaxppo.program.shards import from_unsharded, local_metrics, local_part, to_unsharded


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

    A runner may also have `stop_check`, which the run loop sets to a function that says
    whether a stop signal asks the running chunk to end: `train_chunk` may then return after
    fewer iterations (one at least), and `layout_note`, a line on where it trains.
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
            Their metrics, name -> numpy array [num_seeds?, stop - start] (fewer iterations
            when a `stop_check` ended the chunk early).
        """

    def snapshot(self) -> TrainState:
        """The state after the last chunk in the unsharded layout (numpy), as checkpoints hold it."""

    def final_state(self) -> Any:
        """The state after the last chunk as `TrainResult.state` holds it."""

    def close(self) -> None:
        """Release what the runner holds (envs, Ray learners); the state is no longer needed."""


class ChunkRunner:
    """A compiled program and its state on this process's devices: a `Runner` (driven by the
    run loop in-process, and inside each host's learner for several hosts)."""

    def __init__(self, program: Program, hp: HyperParams, key: jax.Array,
                 restored: TrainState | None = None):
        self.program = program
        self.layout = program.layout
        self.algorithm = program.algorithm
        self.config = program.algorithm.config
        self.shards = self.layout.shards
        self.hosts = self.layout.num_processes
        self.hp = hp
        self.population = program.population
        # pmapped params are one copy per device, unless the devices hold different members
        self.params_replicated = self.shards > 1 and not program.population
        self.host_failures: list[dict] = []
        t0 = time.perf_counter()
        memory.check_memory_estimate(program, key, hp)
        self.state, self.compiled = build.initialise_and_compile(program, key, hp)
        memory.check_memory(self.compiled, program, self.state)
        if restored is not None:
            self.state = from_unsharded(restored, self.state, self.layout, self.config.num_seeds,
                                        self.population)
        self.compile_seconds = time.perf_counter() - t0

    def train_chunk(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """Iterations start+1..stop (at most one chunk); their metrics [seeds?, stop - start]."""
        self.state, m = self.compiled(self.state, self.hp, jnp.asarray(start, jnp.int32),
                                      jnp.asarray(stop, jnp.int32))
        m = local_metrics(m, self.layout)
        return {k: v[..., :stop - start] for k, v in m.items()}

    def snapshot(self) -> TrainState:
        """The state after the last chunk, unsharded (one process holding every shard)."""
        return to_unsharded(self.state, self.layout, self.config.num_seeds, self.population)

    def local_part(self, replicated: bool = True) -> TrainState:
        """This process's shards of the state after the last chunk
        (`jaxppo.program.shards.local_part`)."""
        return local_part(self.state, self.layout, replicated, self.population)

    def final_state(self) -> Any:
        """The state as the program holds it (device layout), for TrainResult.state; a
        population split over this process's devices as [members, ...] (unsharded)."""
        if self.population and self.hosts == 1:
            return self.snapshot()
        return self.state

    def close(self) -> None:
        """Nothing to release: the state goes with the runner."""
