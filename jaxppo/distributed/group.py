"""The host group: Ray places one learner per node, they join one `jax.distributed` group,
and the run loop (jaxppo.run.loop) drives them chunk by chunk, as it drives one process.

    driver (this process)                         learners (one Ray actor per node)
    place bundles (STRICT_SPREAD) ─────────────►  start; host 0 picks the coordinator port
    hand every host the coordinator address ───►  jax.distributed.initialize(addr, H, i)
    start(snapshot) ───────────────────────────►  build + compile the same chunk
    train_chunk(start, stop) per chunk ────────►  the chunk, all-reduces inside XLA
    ◄──────────────────── metrics + unsharded state (host 0; gathered by a collective)

The driver keeps the newest snapshot (the whole TrainState after the last chunk, env states
included). When a host dies, the group is torn down and started again from that snapshot, on
the nodes Ray has (at least `min_hosts`; the envs are re-split when fewer): at most one chunk
is redone, and since the loop only sees the chunk succeed once, metrics.jsonl has every
iteration once.
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any

import jax
import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from jaxppo.core.algorithm import Algorithm
from jaxppo.envs.gymnasium_env import check_hosts as check_host_loop_hosts
from jaxppo.errors import ConfigError
from jaxppo.program.shards import join_parts, shard_state
from jaxppo.program.layout import Layout
from jaxppo.program.resolved import Resolved
from jaxppo.distributed.cluster import (DistributedError, HostsConfigError, HostsOutput,
                                        NotEnoughNodesError, _node_summary, disconnect,
                                        joined_cluster)
from jaxppo.distributed.learner import HostLearner, versions

logger = logging.getLogger("jaxppo.distributed")

STRATEGIES = ("STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK")
# How long the learners' processes may take to start, once placed: each imports Python, jax
# and jaxppo, which a loaded node or a network filesystem makes slow (a minute and more on a
# 2-core machine running other jobs). A process that dies while starting is reported at once.
START_TIMEOUT_S = 300.0


class HostLost(Exception):
    """A learner died (its process or its node); the group must be started again.
    `dead`: [(host index, reason)]."""

    def __init__(self, dead: list[tuple[int | None, str]]):
        super().__init__("; ".join(f"host {k}: {r}" for k, r in dead))
        self.dead = dead


def check_hosts(resolved: Resolved, hosts: int, min_hosts: int | None = None) -> None:
    """Check `hosts` and `min_hosts`, and that the run can be split over `hosts` hosts.

    Raises:
        HostsConfigError: (a ConfigError) naming the problem and the fix.
    """
    for name, value in (("hosts", hosts), ("min_hosts", min_hosts)):
        if value is None and name == "min_hosts":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise HostsConfigError(f"{name}={value!r} must be an integer >= 1, e.g. --hosts 2")
    if min_hosts is not None and min_hosts > hosts:
        raise HostsConfigError(f"min_hosts={min_hosts} is more than hosts={hosts}; use "
                               f"--min-hosts {hosts} or fewer")
    problem = split_problem(resolved, hosts)
    if problem is not None:
        raise problem


def split_problem(resolved: Resolved, hosts: int) -> HostsConfigError | None:
    """Why the run cannot be split over `hosts` hosts, or None when it can.

    Every host owns the same number of envs (PBT runs included); then `jaxppo.resolve`'s
    check for a layout of one shard per host applies, and for an env that steps in Python
    the host loop's (`jaxppo.envs.gymnasium_env.check_hosts`).
    """
    n = resolved.config.num_envs
    if n % hosts:
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        lower = (n // hosts) * hosts
        envs_hint = f"{lower + hosts}" if lower == 0 else f"{lower} or {lower + hosts}"
        return HostsConfigError(
            f"num_envs={n} (the global env count) is not divisible by hosts={hosts}: every "
            f"host must own the same number of envs. Use hosts from {divisors}, or set "
            f"num_envs to a multiple of {hosts} (e.g. --set num_envs={envs_hint})")
    try:
        if resolved.host_loop:  # each host steps its share of the envs in Python
            check_host_loop_hosts(resolved.config, hosts)
        resolved.with_layout(Layout(1, hosts))
    except ConfigError as e:
        return HostsConfigError(str(e))
    return None


class HostGroup:
    """The `jaxppo.run.runner.Runner` whose chunk runs on `hosts` Ray learners.

    restored: the unsharded state to start from (a resumed run), else None (fresh, from the
    config's seed). Ray must be connected (jaxppo.distributed.cluster.connect); with
    `owns_ray`, `close` also disconnects it.
    """

    def __init__(self, resolved: Resolved, hp, hosts: int, *, chunk_len: int,
                 restored=None, start_iter: int = 0, min_hosts: int | None = None,
                 strategy: str = "STRICT_SPREAD", gpus_per_host: float = 0,
                 placement_timeout_s: float = 60.0, init_timeout_s: int = 60,
                 coordinator_port: int = 0, max_restarts: int = 8,
                 pin_cpus: list[list[int]] | None = None,
                 learner_env: dict[str, str] | None = None, snapshot_every_s: float = 0.0,
                 owns_ray: bool = False, output: HostsOutput | None = None):
        if strategy not in STRATEGIES:
            raise HostsConfigError(f"strategy={strategy!r} must be one of {', '.join(STRATEGIES)} "
                                   "(STRICT_SPREAD, the default, puts one host on each node)")
        self.resolved = resolved
        self.config = resolved.config
        self.hp = jax.tree.map(np.asarray, hp)
        self.requested = hosts
        self.min_hosts = hosts if min_hosts is None else min_hosts
        self.chunk_len = chunk_len
        self.strategy = strategy
        self.bundle = {"CPU": 1.0, **({"GPU": float(gpus_per_host)} if gpus_per_host else {})}
        self.placement_timeout_s = placement_timeout_s
        self.init_timeout_s = int(init_timeout_s)
        self.coordinator_port = coordinator_port
        self.max_restarts = max_restarts
        self.pin_cpus = pin_cpus
        self.learner_env = dict(learner_env or {})
        self.algorithm = Algorithm.create(resolved)
        self.snapshot_every_s = snapshot_every_s
        self.snapshot_state = restored
        # The run's iteration (what the loop has), the newest snapshot's, and where the
        # learners' state is (behind the run's after a restart, until replayed).
        self.snapshot_iter = self.iteration = self.learners_at = start_iter
        self.snapshot_time = time.monotonic()
        self.host_failures: list[dict] = []
        self.learners: list[Any] = []
        self.host_info: list[dict] = []
        self.pg = None
        self.hosts = 0
        self.shards = 0
        self.compile_seconds = 0.0
        self.owns_ray = owns_ray
        self.output = output

    # -------------------------------------------------------------- the Runner protocol
    def train_chunk(self, start: int, stop: int) -> dict:
        """Iterations start+1..stop on every host (after a restart, the learners first redo
        what the loop already has); host 0's metrics [seeds?, stop - start]."""
        if start != self.iteration:
            raise RuntimeError(f"chunk from {start}, but the group is at iteration {self.iteration}")
        if self.output is not None:
            self.output.attach()  # the run folder exists once the loop runs chunks
        while True:
            try:
                if self.learners_at < start:  # restarted: redo what the loop already logged
                    self._replay(start)
                take = time.monotonic() - self.snapshot_time >= self.snapshot_every_s
                out = self._call_all("train_chunk", start, stop, take)
                self.iteration = self.learners_at = stop
                if take:
                    self._keep([part for _, part in out])
                return out[0][0]
            except HostLost as e:
                self._recover(e)

    def snapshot(self):
        """The unsharded state after the last chunk (taken now if the newest is older)."""
        while self.snapshot_iter != self.iteration:
            try:
                if self.learners_at < self.iteration:
                    self._replay(self.iteration)
                self._keep(self._call_all("snapshot"))
            except HostLost as e:
                self._recover(e)
        return self.snapshot_state

    def _keep(self, parts) -> None:
        """Keep the unsharded state joined from every host's part."""
        state = join_parts(parts, self.shards, self.config.num_seeds, self.population)
        self.snapshot_state, self.snapshot_iter = state, self.iteration
        self.snapshot_time = time.monotonic()

    def _replay(self, until: int) -> None:
        """Run the learners from the snapshot's iteration to `until`, dropping the metrics
        (the loop has them): the same numbers again, since the state and keys are."""
        while self.learners_at < until:
            nxt = min(until, self.learners_at + self.chunk_len)
            self._call_all("train_chunk", self.learners_at, nxt, False)
            self.learners_at = nxt

    @property
    def layout_note(self) -> str | None:
        """For an env that steps in Python, where it steps and acts (the layout line's note)."""
        if not self.resolved.host_loop:
            return None
        cfg, hosts = self.config, self.hosts or self.requested
        lag = (f"; actor threads on each host, max_policy_lag {cfg.max_policy_lag}"
               if cfg.max_policy_lag else "")
        return (f"each host steps its {cfg.num_envs // hosts} envs in Python and acts on one "
                f"device{lag}")

    @property
    def population(self) -> bool:
        """A PBT population split over the hosts (each trains its own members)."""
        return self.config.pbt is not None and self.shards > 1

    @property
    def params_replicated(self) -> bool:
        """The final state's params are one copy per shard (not a population's members)."""
        return self.shards > 1 and not self.population

    def final_state(self):
        """The state after the last chunk: [shards, ...] as one process's pmap holds it, or a
        population's [members, ...]."""
        state = self.snapshot()
        if self.shards > 1 and not self.population:
            return shard_state(state, self.shards, self.config.num_seeds)
        return state  # a population: [members, ...]

    def close(self) -> None:
        """Leave the jax.distributed group in order (a barrier; otherwise the learners that
        outlive host 0's coordinator log fatal errors), then stop the learners (and, with
        `owns_ray`, disconnect from Ray)."""
        try:
            ray.get([a.leave.remote() for a in self.learners], timeout=10)
        except Exception:  # a learner already gone: nothing to leave in order
            pass
        self._teardown()
        if self.output is not None:
            self.output.close()
        if self.owns_ray:
            disconnect()

    # -------------------------------------------------------------- starting
    def start(self) -> "HostGroup":
        """Place, start, join and compile `hosts` learners (fewer, down to min_hosts, only
        after a failure). Cleans up if anything fails."""
        t0 = time.perf_counter()
        try:
            self._launch(self.requested)
        except HostLost as e:
            self._teardown()
            raise DistributedError(f"a learner died while the group was starting ({e}); check "
                                   "the nodes (`ray status`) and the learners' logs") from None
        except BaseException:
            self._teardown()
            raise
        self.compile_seconds = time.perf_counter() - t0
        return self

    def _fitting_nodes(self) -> tuple[list[dict], list[dict]]:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        fits = [n for n in nodes if all(n["Resources"].get(k, 0) >= v for k, v in self.bundle.items())]
        return nodes, fits

    def _bundle_words(self) -> str:
        """What one learner reserves, in words: "1 CPU", "1 CPU and 1 GPU"."""
        return " and ".join(f"{v:g} {k}" for k, v in self.bundle.items())

    def _too_few_nodes(self, hosts: int, nodes: list[dict], fits: list[dict]) -> str:
        """Why `hosts` learners do not fit (one per node): the nodes that can hold one, of
        all alive, in which cluster, and the ways to more nodes."""
        return (
            f"hosts={hosts} needs {hosts} Ray nodes with {self._bundle_words()} each for its "
            f"learners (one per node, placement STRICT_SPREAD), but {joined_cluster()} has only "
            f"{len(fits)} alive node(s) with that, of {len(nodes)} alive: "
            f"{_node_summary(nodes)}. Start a "
            f"cluster with {hosts} worker nodes (on this machine `make ray-cluster "
            f"RAY_WORKERS={hosts}`, which jaxppo then finds and joins; elsewhere `ray start "
            "--address=<head>:6379` on each node) or name one with --address <head>:6379 or "
            f"RAY_ADDRESS=<head>:6379; or train on fewer hosts (--hosts {max(len(fits), 1)})")

    def _launch(self, hosts: int, placement_timeout_s: float | None = None) -> None:
        placement_timeout_s = placement_timeout_s or self.placement_timeout_s
        nodes, fits = self._fitting_nodes()
        if self.strategy == "STRICT_SPREAD" and hosts > len(fits):
            raise NotEnoughNodesError(self._too_few_nodes(hosts, nodes, fits))
        self.pg = placement_group([dict(self.bundle) for _ in range(hosts)], strategy=self.strategy)
        self._wait_placed(hosts, placement_timeout_s, nodes)
        remote = ray.remote(HostLearner)
        use_gpu = bool(self.bundle.get("GPU"))
        self.learners = [
            remote.options(
                num_cpus=self.bundle["CPU"], num_gpus=self.bundle.get("GPU", 0), max_restarts=0,
                max_task_retries=0,
                **({"runtime_env": {"env_vars": self.learner_env}} if self.learner_env else {}),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=k),
            ).remote(self.config, self.hp, k, hosts, use_gpu,
                     self.pin_cpus[k] if self.pin_cpus else None,
                     own_node=self.strategy == "STRICT_SPREAD")
            for k in range(hosts)]
        self.hosts = hosts
        self.host_info = self._get([a.info.remote() for a in self.learners],
                                   max(START_TIMEOUT_S, self.placement_timeout_s),
                                   "starting the learners")
        self._check_versions()
        coordinator = self._get([self.learners[0].coordinator_address.remote(self.coordinator_port)],
                                30, "choosing the coordinator address")[0]
        joined = self._get([a.initialize.remote(coordinator, self.init_timeout_s) for a in self.learners],
                           self.init_timeout_s + 30, f"joining the jax.distributed group at {coordinator}")
        for info, j in zip(self.host_info, joined):
            info.update(j, coordinator=coordinator)
        local = {j["local_devices"] for j in joined}
        if len(local) != 1:
            raise DistributedError(
                f"the hosts have different numbers of devices ({sorted(local)}); every host needs "
                "the same: set num_devices to the smallest, or use alike nodes")
        self.shards = hosts * local.pop()
        self._get([a.start.remote(self.snapshot_state, self.chunk_len) for a in self.learners],
                  None, "compiling the program")
        self.learners_at = self.snapshot_iter

    def _wait_placed(self, hosts: int, timeout_s: float, nodes: list[dict]) -> None:
        """Wait up to `timeout_s` for the placement group. With one learner per node, stop
        waiting as soon as fewer nodes than `hosts` can hold one: a node that died keeps
        counting as alive until Ray's health checks time out, and a placement on it would
        wait out the whole timeout."""
        ready, deadline = self.pg.ready(), time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if ray.wait([ready], timeout=max(0.0, min(1.0, left)))[0]:
                ray.get(ready)
                return
            if left <= 0:
                raise NotEnoughNodesError(
                    f"could not reserve {self._bundle_words()} for each of {hosts} learners "
                    f"(placement {self.strategy}) within {timeout_s:g}s: other jobs hold some "
                    f"of the nodes' resources (`ray status` shows what is in use), or the "
                    f"cluster's nodes cannot take that placement. Nodes: {_node_summary(nodes)}. "
                    "Stop those jobs, train on fewer hosts (--hosts), or wait longer "
                    "(train_distributed(placement_timeout_s=...))")
            if self.strategy == "STRICT_SPREAD":
                now, fits = self._fitting_nodes()
                if len(fits) < hosts:
                    raise NotEnoughNodesError(self._too_few_nodes(hosts, now, fits))

    def _check_versions(self) -> None:
        mine = versions()
        for info in self.host_info:
            theirs = info["versions"]
            diff = {k: (mine[k], theirs.get(k)) for k in ("jax", "jaxlib", "jaxppo")
                    if theirs.get(k) != mine[k]}
            if diff:
                what = ", ".join(f"{k} {a} here but {b} there" for k, (a, b) in diff.items())
                raise DistributedError(
                    f"host {info['host_index']} (node {info['node_ip']}) runs different versions: "
                    f"{what}. Every node needs the same install: `pip install -e '.[ray]'` from "
                    "the same checkout (jax==0.10.2) on each node, then restart its `ray start`")

    # -------------------------------------------------------------- calls and failures
    def _get(self, refs, timeout, what: str):
        """ray.get with the learners' own errors as clear errors; HostLost when one died."""
        try:
            return ray.get(refs, timeout=timeout)
        except RayActorError as e:
            raise HostLost([(None, _short_reason(e))]) from None
        except GetTimeoutError:
            raise DistributedError(
                f"no answer from the learners within {timeout:g}s while {what}. Nodes: "
                f"{_node_summary([n for n in ray.nodes() if n.get('Alive')])}. Check that every "
                "node can reach the others (firewalls; the coordinator port), and the learners' "
                "logs (`ray logs`, the dashboard)") from None
        except RayTaskError as e:
            raise _task_error(e, what) from None

    def _call_all(self, method: str, *args, grace_s: float = 10.0):
        """Call `method` on every learner and wait for all. A learner that dies is noticed at
        once (the others may be blocked in a collective with it): HostLost. A learner's own
        error waits `grace_s` for a death that explains it (a peer's collective failing)."""
        refs = [getattr(a, method).remote(*args) for a in self.learners]
        pending, failed, failed_host, deadline = list(refs), None, None, None
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            for ref in ready:
                try:
                    ray.get(ref)
                except RayActorError as e:
                    raise HostLost([(refs.index(ref), _short_reason(e))]) from None
                except RayTaskError as e:
                    if failed is None:
                        failed, failed_host = e, refs.index(ref)
                    deadline = deadline or time.monotonic() + grace_s
            if failed is not None and time.monotonic() > deadline:
                break
        if failed is not None:
            raise _task_error(failed, f"running {method}", failed_host)
        return ray.get(refs)

    def _recover(self, error: HostLost) -> None:
        """Start the group again from the newest snapshot, on the nodes Ray has now; with
        fewer nodes than min_hosts, wait for a replacement (a bounded time) first."""
        lost = self._describe(error)
        self._teardown()
        self._count_failure(error)
        redo = (f"redoing iterations {self.snapshot_iter + 1}-{self.iteration}"
                if self.iteration > self.snapshot_iter else "nothing to redo")
        where = (f"; the cluster's output (abort traces, Ray's errors) goes to {self.output.path}"
                 if self.output is not None else "")
        logger.warning("lost %s; restarting the group from the state after iteration %d (%s)%s",
                       lost, self.snapshot_iter, redo, where)
        # A lost node stays "alive" in Ray's view until its health checks time out (~15-30 s):
        # a placement on it waits until then (`_wait_placed`), and the next count lacks it.
        wait_s = max(self.placement_timeout_s, 60.0)
        deadline, waiting_since = time.monotonic() + wait_s, None
        while True:
            _, fits = self._fitting_nodes()
            available = len(fits) if self.strategy == "STRICT_SPREAD" else self.requested
            try:
                hosts = self._hosts_for(available)
            except DistributedError as too_few:
                now = time.monotonic()
                if waiting_since is not None and now > deadline:
                    raise DistributedError(
                        f"{too_few} (waited {now - waiting_since:.0f}s for a node to replace "
                        "the lost one)") from None
                if waiting_since is None:
                    waiting_since, deadline = now, now + wait_s
                    fewer = self._fewer_hint(available)
                    logger.warning(
                        "%d node(s) can host a learner now, fewer than min_hosts=%d: waiting up "
                        "to %.0fs for a node to replace the lost one%s", available,
                        self.min_hosts, wait_s, f" ({fewer} would continue without it)" if fewer else "")
                time.sleep(2.0)
                continue
            try:
                self._launch(hosts, placement_timeout_s=min(20.0, self.placement_timeout_s))
            except NotEnoughNodesError:
                self._teardown()
                if time.monotonic() > deadline:
                    raise
                time.sleep(2.0)
                continue
            except HostLost as again:  # lost another while starting: count it, try again
                self._teardown()
                self._count_failure(again)
                continue
            except BaseException:
                self._teardown()
                raise
            if hosts != self.requested:
                logger.warning("continuing on %d host(s) instead of %d: %d envs per host",
                               hosts, self.requested, self.config.num_envs // hosts)
            else:
                logger.info("the group runs again on %d hosts", hosts)
            return

    def _describe(self, error: HostLost) -> str:
        """'host 1 (node 127.0.0.1 dafc7dd7, pid 123): <reason>' for each lost host."""
        out = []
        for k, reason in error.dead:
            info = self.host_info[k] if k is not None and k < len(self.host_info) else None
            where = (f" (node {info['node_ip']} {info['node_id'][:8]}, pid {info['pid']})"
                     if info else "")
            out.append(f"{'a host' if k is None else f'host {k}'}{where}: {reason}")
        return "; ".join(out)

    def _fewer_hint(self, available: int) -> str | None:
        """'--min-hosts N': the most hosts <= available that divide num_envs, if any."""
        for h in range(min(available, self.requested), 0, -1):
            if split_problem(self.resolved, h) is None:
                return f"--min-hosts {h}"
        return None

    def _count_failure(self, error: HostLost) -> None:
        """Record the lost hosts; DistributedError past max_restarts."""
        for k, reason in error.dead:
            self.host_failures.append({"host": k, "iteration": self.iteration + 1,
                                       "reason": reason})
        if len(self.host_failures) > self.max_restarts:
            raise DistributedError(
                f"{len(self.host_failures)} host failures, more than max_restarts="
                f"{self.max_restarts}; giving up. Last: {error}. Check the nodes (`ray status`) "
                "and the learners' logs (`ray logs`, the dashboard)")

    def _hosts_for(self, available: int) -> int:
        """The most hosts (<= requested, <= available, >= min_hosts) the run splits over."""
        for h in range(min(self.requested, available), self.min_hosts - 1, -1):
            if split_problem(self.resolved, h) is None:
                return h
        fewer = self._fewer_hint(available)
        raise DistributedError(
            f"only {available} node(s) can host a learner now, fewer than min_hosts="
            f"{self.min_hosts} (with num_envs={self.config.num_envs} divisible by the number of "
            "hosts). The newest checkpoint is kept; add nodes and resume with --resume, or "
            f"allow fewer hosts with {fewer or '--min-hosts'}")

    def _teardown(self) -> None:
        for a in reversed(self.learners):  # host 0 (the coordinator) last
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass
        self.learners = []
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None


def _short_reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = next((line.strip() for line in text if line.strip()), "")
    if len(first) > 200:
        first = first[:197] + "..."
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _task_error(e: RayTaskError, what: str, host: int | None = None) -> Exception:
    """A learner's exception as the driver raises it: config errors as they are, anything
    else as a DistributedError naming the host, what failed and what jaxppo noted where it
    was raised (e.g. the actor thread and the line of an env that raised)."""
    cause = getattr(e, "cause", None) or e
    if isinstance(cause, (ConfigError, DistributedError)):
        return cause
    who = "a learner" if host is None else f"the learner of host {host}"
    notes = [n.removeprefix("jaxppo: ") for n in getattr(cause, "__notes__", ())
             if n.startswith("jaxppo: ")]
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', str(e))  # Ray's traceback
    if not notes and frames:  # the line that raised, from the learner's traceback
        file, line, function = frames[-1]
        notes = [f"raised at {os.path.basename(file)}:{line} in {function}"]
    where = f" ({'; '.join(notes)})" if notes else ""
    return DistributedError(f"{who} failed while {what}: {_short_reason(cause)}{where}. See the "
                            "learners' logs (`ray logs`, the dashboard) for the whole traceback")
