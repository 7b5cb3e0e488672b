"""`python -m jaxppo.distributed.loopback <ray CLI args>`: the `ray` CLI for a cluster that
lives entirely on this machine's loopback interface (127.0.0.1).

Ray rewrites 127.0.0.1/localhost, both in `--node-ip-address` and in `--address`, to the
machine's outward IP (so that other machines could reach it), and so do the Ray processes
it starts whenever they connect by a loopback address (the dashboard's job agent, a job's
driver). A local multi-node test cluster should never leave loopback. This wrapper

* runs the `ray` CLI with loopback addresses kept as given, and
* starts every Ray process with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, Ray's own switch for
  "this machine's address is 127.0.0.1" (the CLI itself still allows `ray start --address`).

`make ray-cluster` starts the head and two worker nodes with it:

    python -m jaxppo.distributed.loopback start --head --node-ip-address=127.0.0.1 --port=6379 ...
    python -m jaxppo.distributed.loopback start --address=127.0.0.1:6379 \\
        --node-ip-address=127.0.0.1 --num-cpus=1 --dashboard-agent-listen-port=0

Only use it for single-machine clusters; on real clusters use the plain `ray` CLI.
"""

from __future__ import annotations

import os
import sys

LOOPBACK = ("127.0.0.1", "localhost", "::1")
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def main(argv: list[str] | None = None) -> int:
    import ray._private.ray_constants  # noqa: F401  (reads the env before we change it)
    import ray._private.services as services

    resolve = services.resolve_ip_for_localhost

    def keep_loopback(host: str):
        return host if host in LOOPBACK else resolve(host)

    services.resolve_ip_for_localhost = keep_loopback
    os.environ.update(LOOPBACK_ENV)  # inherited by the GCS, raylets, agents, workers, jobs
    from ray.scripts.scripts import main as ray_main

    sys.argv = ["ray", *(sys.argv[1:] if argv is None else argv)]
    return ray_main()


if __name__ == "__main__":
    raise SystemExit(main())
