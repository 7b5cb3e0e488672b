"""GPU readiness without a GPU: the training program of every layout lowers for CUDA.

`jax.export.export(..., platforms=["cuda"])` lowers a function for CUDA on a CPU-only jaxlib
(lowering is tracing plus StableHLO emission; nothing is compiled or run). Every operation
must have a CUDA lowering rule, so an op that only the CPU can run (a LAPACK-only linear
algebra routine, say) fails here rather than on the first GPU machine. A custom call that a
CUDA lowering emits is only a name at this stage (the cuSOLVER QR of the orthogonal
initialiser: cusolver_geqrf_ffi, cusolver_orgqr_ffi); `jax.export` checks that each is one of
jax's stable custom-call targets.

Layouts: one device (jit), the envs split over 2 devices (pmap, with the collectives), a
sweep (num_seeds=2 vmapped, one set of hyperparameters per seed), a sweep's members split
over 2 devices (pmap, no collective), a PBT population split over 2 devices, and a recurrent
policy over continuous actions on one device. Each lowers
`init` and the chunk of iterations (with evaluations) that `ChunkRunner` compiles. The two
devices are forced host devices, which XLA_FLAGS must set before jax starts, so the lowering
runs in a subprocess: this file run as a script.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

DEVICES = 2
CASES = {  # case -> devices its program spans
    "one-device": 1,
    "pmap": DEVICES,
    "sweep": 1,
    "seeds-split": DEVICES,
    "pbt-split": DEVICES,
    "recurrent-continuous": 1,
}


COLLECTIVES = ("all_reduce", "all_gather", "all_to_all", "reduce_scatter", "collective_permute",
               "collective_broadcast")


def lower_for_cuda(fn, *args):
    """`jax.export` of `fn` (jitted unless it is already) for CUDA only."""
    import jax

    return jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)


def custom_calls(module_text: str) -> list[str]:
    """The custom-call targets a StableHLO module names."""
    return sorted(set(re.findall(r"custom_call @([\w.]+)", module_text)))


# ---------------------------------------------------------------------- the subprocess
def _configs():
    import jaxppo
    from jaxppo.core.hyperparams import HyperParams
    from jaxppo.program.layout import Layout
    from jaxppo.program.resolved import resolve
    from jaxppo.search.sweep import sample_hparams

    base = jaxppo.PPOConfig(
        env="CartPole-v1", num_envs=4, num_steps=8, total_timesteps=4 * 8 * 4, num_epochs=1,
        num_minibatches=2, network=jaxppo.NetworkConfig((8,)), normalize_observations=True,
        eval_every=2, eval_episodes=2, compilation_cache_dir=None)
    sweep = HyperParams.stack([HyperParams.from_config(base.replace(lr=lr)) for lr in (1e-3, 3e-4)])
    pbt = base.replace(num_seeds=DEVICES, search={"lr": {"loguniform": [1e-4, 1e-2]}},
                       pbt={"interval": 2, "fraction": 0.5}, log_every=2)
    recurrent = base.replace(env="Pendulum-v1", env_kwargs={"max_steps_in_episode": 10},
                             network=jaxppo.NetworkConfig((8,), recurrent_size=4))
    return {  # case -> (config, layout, hyperparameters or None for the config's)
        "one-device": (base, Layout(), None),
        "pmap": (base, Layout(DEVICES), None),
        "sweep": (base.replace(num_seeds=2), Layout(), sweep),
        "seeds-split": (base.replace(num_seeds=2), Layout(DEVICES, by_seed=True), sweep),
        "pbt-split": (pbt, Layout(DEVICES), sample_hparams(resolve(pbt).config)),
        "recurrent-continuous": (recurrent, Layout(), None),
    }


def _lower_case(config, layout, hp) -> dict:
    """Lower init and the chunk of `config`'s program on `layout` for CUDA."""
    import jax
    import jax.numpy as jnp

    from jaxppo.core.hyperparams import HyperParams
    from jaxppo.program.build import build_program
    from jaxppo.program.resolved import resolve

    run = resolve(config, layout)
    hp = HyperParams.from_config(run.config) if hp is None else hp
    program = build_program(run, hp, chunk_len=2)
    key = jax.random.PRNGKey(0)
    state = jax.eval_shape(program.init, key, hp)
    index = jax.ShapeDtypeStruct((), jnp.int32)
    out = {}
    for name, fn, args in (("init", program.init, (key, hp)),
                           ("chunk", program.chunk, (state, hp, index, index))):
        try:
            exported = lower_for_cuda(fn, *args)
        except Exception as err:  # noqa: BLE001 - reported to the test, which fails on it
            out[name] = {"error": f"{type(err).__name__}: {err}"[:4000]}
            continue
        text = exported.mlir_module()
        out[name] = {"platforms": list(exported.platforms), "nr_devices": exported.nr_devices,
                     "custom_calls": custom_calls(text),
                     "all_reduce": "stablehlo.all_reduce" in text,
                     "collectives": sorted({op for op in COLLECTIVES if f"stablehlo.{op}" in text})}
    return out


def _main() -> None:
    results = {case: _lower_case(*spec) for case, spec in _configs().items()}
    print("RESULT " + json.dumps(results))


# ---------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def lowered() -> dict:
    """Every case lowered in one subprocess with DEVICES forced host devices."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}",
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, __file__], check=False, capture_output=True,
                          text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("part", ["init", "chunk"])
def test_program_lowers_for_cuda(lowered, case, part):
    result = lowered[case][part]
    assert "error" not in result, f"{case} {part} has no CUDA lowering: {result.get('error')}"
    assert result["platforms"] == ["cuda"]
    assert result["nr_devices"] == CASES[case]
    # cuSOLVER/cuBLAS targets only, nothing of the CPU's (lapack_*, ducc_*, ...)
    assert all(t.startswith(("cu", "hip")) for t in result["custom_calls"]), result["custom_calls"]


def test_pmap_chunk_holds_the_cross_device_reductions(lowered):
    """The split layout's program is the multi-device one: its gradients and batch
    statistics are all-reduced over the devices (the one-device program has none)."""
    assert lowered["pmap"]["chunk"]["all_reduce"]
    assert not lowered["one-device"]["chunk"]["all_reduce"]


def test_seeds_split_chunk_has_no_collective(lowered):
    """Seeds split over devices train independently: their program passes nothing between
    devices (the envs-split one does, so the check can fail)."""
    assert lowered["seeds-split"]["chunk"]["collectives"] == []
    assert lowered["seeds-split"]["init"]["collectives"] == []
    assert lowered["pmap"]["chunk"]["collectives"]


def test_an_op_without_a_cuda_lowering_is_caught():
    """The check can fail: Schur's decomposition has a LAPACK (CPU) lowering only."""
    import jax
    import jax.numpy as jnp

    lower_for_cuda(lambda x: jnp.linalg.qr(x)[0], jnp.eye(3))  # cuSOLVER: lowers
    with pytest.raises(NotImplementedError, match="schur.*cuda"):
        lower_for_cuda(lambda x: jax.lax.linalg.schur(x)[0], jnp.eye(3))


if __name__ == "__main__":
    _main()
