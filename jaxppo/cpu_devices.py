"""One JAX CPU device per core, set when jaxppo is imported (before JAX's backend starts).

JAX shows a CPU host as one device unless told otherwise, so a run would keep one core busy
however many the machine has. `configure` (called first thing by `import jaxppo`) gives the
CPU backend one device per core this process may run on (`os.sched_getaffinity`), and
`jaxppo.resolve` lays seeds, PBT members or envs over them. In a Ray task or actor the cores
are those Ray gave it (`num_cpus`), when fewer: Ray reserves CPUs without pinning the process,
so its affinity is the whole node (a host learner, alone on its node, takes the node's CPUs:
jaxppo.distributed.learner). It changes nothing when:

* JAXPPO_CPU_DEVICES says otherwise: `1` (one device, as JAX's default) or `N` (N devices);
* the user chose already: XLA_FLAGS holds --xla_force_host_platform_device_count, or
  jax_num_cpu_devices is set;
* the default platform is not the CPU (JAX_PLATFORMS / jax_platforms naming a GPU or TPU);
* JAX's backend has started (the user ran JAX code before importing jaxppo): the device count
  is fixed then, and a run that would have used more devices says how to get them.

Only the CPU backend's device count is set: a machine with a GPU trains on its GPU(s).

The count is the whole process's, so JAX code next to jaxppo sees it too (`jax.devices()`).
`describe()` says what jaxppo did, and a run's layout line says when its CPU devices are
jaxppo's (`layout_note`). Why a default and not an opt-in: docs/design.md, "CPU devices".
"""

from __future__ import annotations

import os
import sys

from jaxppo.errors import warn

ENV_VAR = "JAXPPO_CPU_DEVICES"
XLA_FLAG = "xla_force_host_platform_device_count"

# What `configure` did: "set" (jaxppo chose `devices`), "off" (JAXPPO_CPU_DEVICES=1), "user"
# (XLA_FLAGS or jax_num_cpu_devices), "platform" (not a CPU run), "started" (the backend was
# already up), or "" (not called yet).
status = {"action": "", "devices": 1}


def affinity() -> int:
    """The cores this process may run on (its CPU affinity; `taskset -c 0` gives 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def cores() -> int:
    """The cores this process may use: its affinity, or in a Ray worker the CPUs Ray gave
    its task or actor, if fewer."""
    n, given = affinity(), ray_cpus()
    return min(n, given) if given else n


def ray_cpus() -> int | None:
    """The whole CPUs Ray assigned to this worker's task or actor (at least 1); None outside
    a Ray worker (the driver included) or where it assigned none. Ray is only asked when the
    process has imported it: jaxppo never imports Ray for this."""
    ray = sys.modules.get("ray")
    if ray is None:
        return None
    try:
        from ray._private import worker

        if not ray.is_initialized() or worker.global_worker.mode != worker.WORKER_MODE:
            return None
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0)
    except Exception:  # noqa: BLE001  (another Ray version: affinity alone, as without Ray)
        return None
    return max(1, int(cpus)) if cpus else None


def wanted(environ=os.environ, num_cores: int | None = None) -> int:
    """The CPU devices asked for: JAXPPO_CPU_DEVICES (a positive integer) or one per core
    (`num_cores`, else `cores()`)."""
    value = environ.get(ENV_VAR, "").strip()
    if not value or value.lower() == "auto":
        return num_cores or cores()
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        warn(f"{ENV_VAR}={value!r} is not a positive integer (1 = one CPU device, N = N "
             "devices, unset = one per core); using one CPU device")
        return 1
    return n


def plan(environ, num_cpu_devices: int, platforms: str | None) -> tuple[str, int]:
    """(what to do, the devices wanted) from the environment, jax_num_cpu_devices (-1: unset)
    and jax_platforms: "user" (XLA_FLAGS or jax_num_cpu_devices chose), "platform" (not a
    CPU run), "off" (JAXPPO_CPU_DEVICES=1), else "set"."""
    n = wanted(environ)
    if XLA_FLAG in environ.get("XLA_FLAGS", "") or num_cpu_devices >= 0:
        return "user", n
    first = (environ.get("JAX_PLATFORMS") or platforms or "").split(",")[0].strip().lower()
    if first not in ("", "cpu"):
        return "platform", n
    if n == 1 and environ.get(ENV_VAR, "").strip():
        return "off", 1
    return "set", n


def configure() -> dict:
    """Give JAX's CPU backend `wanted()` devices unless the user (or a started backend) has
    fixed the count; returns `status`."""
    import jax

    action, n = plan(os.environ, jax.config.jax_num_cpu_devices, jax.config.jax_platforms)
    if action == "set" and n > 1:
        try:
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:  # the backend has started: its device count is fixed
            action = "started"
    status.update(action=action, devices=n)
    return status


def refit(num_cores: int | None = None) -> dict:
    """`configure` again for a process that knows its cores better than at import: one
    device per core of `num_cores` (default `cores()`, e.g. after pinning), unless
    JAXPPO_CPU_DEVICES says otherwise, as long as jaxppo chose the count and JAX's backend
    has not started. Returns `status`."""
    if status["action"] != "set":
        return status
    import jax

    n = wanted(os.environ, num_cores)
    if n != status["devices"]:
        try:
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:  # the backend has started: its device count is fixed
            return status
        status["devices"] = n
    return status


def describe() -> str:
    """What jaxppo did to JAX's CPU device count, in one line, e.g. "2 CPU devices, one per
    core: set by jaxppo on import (JAXPPO_CPU_DEVICES=1 before the import keeps JAX's one)".
    `status` holds the same as data: `action` ("set", "off", "user", "platform", "started")
    and `devices`."""
    action, n = status["action"], status["devices"]
    if action == "set":
        if n == 1:  # JAXPPO_CPU_DEVICES=1 is "off": this is one core
            return "one CPU device: jaxppo sets one per core, and this process may use one"
        return (f"{n} CPU devices, {_chosen_by()}: set by jaxppo on import ({ENV_VAR}=1 "
                "before the import keeps JAX's one)")
    return {
        "off": f"one CPU device, JAX's default: {ENV_VAR}=1 turned jaxppo's one per core off",
        "user": "CPU devices as XLA_FLAGS or jax_num_cpu_devices set them: jaxppo left them",
        "platform": "CPU devices left to JAX: the default platform is not the CPU",
        "started": (f"CPU devices left as they were: JAX's backend had started before jaxppo "
                    f"was imported (jaxppo would have set {n}, {_chosen_by()})"),
    }.get(action, "CPU devices not configured by jaxppo (cpu_devices.configure has not run)")


def layout_note(devices_used: int) -> str:
    """What a run's layout line adds when it trains on more than one of the CPU devices jaxppo
    set (`devices_used`: this host's), e.g. "; CPU devices: jaxppo's one per core
    (JAXPPO_CPU_DEVICES=1 turns it off)"; "" otherwise."""
    import jax

    if (status["action"] != "set" or status["devices"] < 2 or devices_used < 2
            or jax.default_backend() != "cpu"):
        return ""
    how = _chosen_by()
    if how != "one per core":
        return f"; CPU devices: {how}"
    return f"; CPU devices: jaxppo's one per core ({ENV_VAR}=1 turns it off)"


def _chosen_by() -> str:
    """How the count jaxppo sets is chosen: "one per core" or "JAXPPO_CPU_DEVICES=N"."""
    value = os.environ.get(ENV_VAR, "").strip()
    return "one per core" if not value or value.lower() == "auto" else f"{ENV_VAR}={value}"


def started_early_note(available: int, would_use: int) -> str | None:
    """The one-line note for a run that would have used `would_use` CPU devices but finds
    `available`, because JAX's backend started before jaxppo was imported; None otherwise."""
    if status["action"] != "started" or would_use <= available:
        return None
    return (f"note: JAX's CPU backend started before jaxppo was imported, so it has {available} "
            f"device(s); this run would use {would_use} (one per core). Import jaxppo before "
            f"running any JAX code, or call jax.config.update('jax_num_cpu_devices', "
            f"{would_use}) right after importing jax")


configure()  # on import: `import jaxppo` imports this module before anything that uses JAX
