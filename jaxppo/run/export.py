"""Export a trained policy to run without jaxppo: a serialized `jax.export` function
(`format="jax"`, needs only jax) or an ONNX model (`format="onnx"`, the `export` extra), with a
JSON description of its inputs and outputs next to it.

    jaxppo.export_policy("runs/CartPole-v1-...", format="onnx", path="cartpole.onnx")
"""

from __future__ import annotations

import dataclasses

import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.core import networks
from jaxppo.envs.spec import HOST_MASK_SOURCES, env_action
from jaxppo.errors import ExportError
from jaxppo.run.files import write_atomic
from jaxppo.run.folder import output_problem
from jaxppo.run.policy import Policy, load_policy
from jaxppo.process import __version__

FORMATS = {"jax": ".jaxexport", "onnx": ".onnx"}
EXPORT_INSTALL = "pip install 'jaxppo[export]'"
# A serialized function carries one lowering per platform and runs on any of them; lowering
# needs no device of that kind.
JAX_PLATFORMS = ("cpu", "cuda", "tpu")


class Exported(NamedTuple):
    """The files `export_policy` wrote: the deterministic policy, the sampling variant
    (None unless stochastic=True) and the JSON description; `metadata` is that JSON."""

    path: Path
    sample_path: Path | None
    metadata_path: Path
    metadata: dict


def export_policy(source: str | Path | Policy, format: str = "jax", path: str | Path | None = None,
                  *, stochastic: bool = False, seed_index: int = 0, step: int | None = None,
                  env: Any = None, batch_size: int | None = None,
                  trust_config: bool = True) -> Exported:
    """Writes a trained policy as a function that runs without jaxppo.

    The function is the policy as `load_policy` runs it (observation normalisation included,
    actions ready for the env, continuous ones clipped) with its params baked in, for a batch
    of observations [b, *obs_shape]. The deterministic variant is `obs -> action`. The
    sampling variant is `(obs, seed uint32) -> action` for "jax", equal to
    `policy(obs, jax.random.PRNGKey(seed))`, and `(obs, noise) -> action` for "onnx", the
    noise being Gumbel(0, 1) [b, num_actions] (discrete) or standard normal [b, D]. A
    recurrent policy also takes its carry and returns the next one (zeros at an episode's
    start). Actions are those of the env it trained on, transforms included (with
    `discretize_actions` an index; the JSON's `env_action_table` maps it). A policy trained
    with the env's action mask (`policy.masked`) takes the legal actions, bool [b,
    num_actions] (true = legal, at least one per row), right after the observations: inputs
    `(obs, action_mask[, carry][, seed | noise])`; its actions are always legal ones.

    Args:
      source: a run folder or a `Policy`.
      format: "jax" (`jax.export.deserialize(open(f, "rb").read()).call(obs)`) or "onnx".
      path: the file (default: `<run folder name>[-seed<I>]<.jaxexport|.onnx>` in the run
        folder, or `<env><.jaxexport|.onnx>` in the working directory for a Policy);
        `<file>.json` describes it.
      stochastic: also write the sampling variant, to `<stem>.sample<suffix>`.
      seed_index: as for `load_policy` (a run folder only).
      step: as for `load_policy` (a run folder only).
      env: as for `load_policy` (a run folder only).
      batch_size: a fixed batch instead of a symbolic one.
      trust_config: as for `load_policy` (a run folder only).

    Returns:
      The files written and the JSON's content (`Exported`).

    Raises:
      ExportError: what cannot be exported, a missing extra, or a file to write that is one
        of the run folder's own (config.yaml, params.msgpack, summary.json, checkpoints/,
        best/, ...) or a symbolic link in the run folder.
      CheckpointError, ConfigError, TypeError, ValueError: as `load_policy` raises them.
    """
    _check_options(format, batch_size)
    path, sample_path, metadata_path = _output_paths(source, format, path, seed_index,
                                                     stochastic)
    policy = source if isinstance(source, Policy) else load_policy(
        source, seed_index=seed_index, step=step, env=env, trust_config=trust_config)
    io = _signature(policy, batch_size)
    files = _serialize(policy, format, io, stochastic)
    metadata = _metadata(policy, format, io, path, sample_path, source)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Each file replaces what stands at its name: a link there is replaced, not written through.
    write_atomic(path, files["deterministic"])
    if sample_path is not None:
        write_atomic(sample_path, files["sample"])
    write_atomic(metadata_path, json.dumps(metadata, indent=2) + "\n")
    return Exported(path, sample_path, metadata_path, metadata)


def _check_options(format: str, batch_size: int | None) -> None:
    """ExportError for an unknown format or a batch size that is not a whole number >= 1."""
    if format not in FORMATS:
        raise ExportError(f"format={format!r} is not an export format; use one of "
                          f"{', '.join(map(repr, FORMATS))}")
    if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool)
                                   or batch_size < 1):
        raise ExportError(f"batch_size={batch_size!r} must be an integer >= 1, or None for a "
                          "symbolic batch dimension")


def _output_paths(source: str | Path | Policy, format: str, path: str | Path | None,
                  seed_index: int, stochastic: bool) -> tuple[Path, Path | None, Path]:
    """The files to write (the function, its sampling variant when `stochastic`, the JSON),
    checked not to be a run folder's own (`_check_outside_run`)."""
    if isinstance(source, Policy):
        name = source.config.env_name
    elif isinstance(source, (str, os.PathLike)):
        name = Path(source).resolve().name + (f"-seed{seed_index}" if seed_index else "")
    else:
        raise TypeError(f"source={source!r:.60} must be a run folder (a str or Path) or a "
                        "Policy (jaxppo.load_policy(run_dir))")
    if path is None:  # a run folder's export goes into it, a Policy's into the working dir
        folder = Path(source) if not isinstance(source, Policy) else Path()
        path = folder / (name + FORMATS[format])
    path = Path(path)
    sample_path = path.with_name(f"{path.stem}.sample{path.suffix}") if stochastic else None
    metadata_path = path.with_name(path.name + ".json")
    if not isinstance(source, Policy):
        _check_outside_run(Path(source), path, [p for p in (metadata_path, sample_path) if p])
    return path, sample_path, metadata_path


def _serialize(policy: Policy, format: str, io: _Signature,
               stochastic: bool) -> dict[str, bytes]:
    """The exported functions' bytes: "deterministic", and "sample" when `stochastic`."""
    if format == "onnx" and io.carry is not None and "leaves" in io.carry:
        raise ExportError(
            f"the policy's carry is a pytree of {len(io.carry['leaves'])} arrays (a network "
            "module's own), and ONNX inputs are single arrays; export it with format='jax'")
    carry_in, carry_out = (["carry"], ["next_carry"]) if policy.recurrent else ([], [])
    carry_in = (["action_mask"] if policy.masked else []) + carry_in
    if format == "jax":
        files = {"deterministic": _jax_bytes(_deterministic_fn(policy), io.deterministic_in)}
        if stochastic:
            files["sample"] = _jax_bytes(_seeded_sample_fn(policy), io.seeded_in)
    else:
        if policy.algorithm.per_agent:  # jax2onnx does not batch flax modules under a vmap
            algo = policy.algorithm
            policy = Policy(dataclasses.replace(
                algo, network=dataclasses.replace(algo.network, unrolled=True)),
                policy.params, policy.obs_stats, policy.iteration)
        files = {"deterministic": _onnx_bytes(_deterministic_fn(policy), io.deterministic_in,
                                              ["obs", *carry_in], ["action", *carry_out])}
        if stochastic:
            files["sample"] = _onnx_bytes(_noise_sample_fn(policy), io.noise_in,
                                          ["obs", *carry_in, "noise"], ["action", *carry_out])
    return files


def _check_outside_run(run_dir: Path, path: Path, others: list[Path]) -> None:
    """ExportError when `path` or a file written next to it (`others`: its .json, its
    .sample variant) may not be written (`jaxppo.run.folder.output_problem`): the run
    folder's own files, or a link in the folder."""
    for out in [path, *others]:
        problem = output_problem(run_dir, out, None if out == path else path)
        if problem:
            raise ExportError(problem)


# ---------------------------------------------------------------- the functions exported
# What an exported masked policy returns for an observation whose mask has no legal action
# (`load_policy`'s policies raise ValueError there instead).
NO_LEGAL_ACTION = -1


def _positional(policy: Policy, step):
    """`step(obs, mask, carry, *rest) -> (action, carry)` as the exported function's
    signature: (obs[, action_mask][, carry], *rest) -> action, or (action, carry) for a
    recurrent policy; the mask only for a masked policy, the carry only for a recurrent one.
    A row whose mask has no legal action gets NO_LEGAL_ACTION (-1), never a made-up action."""
    masked, recurrent = policy.masked, policy.recurrent

    def call(*args):
        obs, args = args[0], list(args[1:])
        mask = args.pop(0) if masked else None
        carry = args.pop(0) if recurrent else ()
        action, carry = step(obs, mask, carry, *args)
        if masked:
            action = jnp.where(jnp.any(mask, axis=-1), action, NO_LEGAL_ACTION).astype(action.dtype)
        return (action, carry) if recurrent else action

    return call


def _deterministic_fn(policy: Policy):
    """obs -> action, or (obs, carry) -> (action, carry) for a recurrent policy (action_mask
    after obs for a masked one)."""
    algo, params, stats = policy.algorithm, policy.params, policy.obs_stats
    return _positional(policy, lambda obs, mask, carry: algo.policy_step(
        params, stats, obs, carry, None, True, mask))


def _seeded_sample_fn(policy: Policy):
    """(obs, seed) -> action: `policy(obs, PRNGKey(seed))`; recurrent: (obs, carry, seed) ->
    (action, carry) (action_mask after obs for a masked one)."""
    algo, params, stats = policy.algorithm, policy.params, policy.obs_stats
    return _positional(policy, lambda obs, mask, carry, seed: algo.policy_step(
        params, stats, obs, carry, jax.random.PRNGKey(seed), False, mask))


def _noise_sample_fn(policy: Policy):
    """(obs, noise) -> action, the noise being what `networks.sampling_noise` draws (ONNX
    has no random numbers that match JAX's, so the caller supplies them); recurrent: (obs,
    carry, noise) -> (action, carry) (action_mask after obs for a masked one)."""
    algo, params, stats = policy.algorithm, policy.params, policy.obs_stats

    def step(obs, mask, carry, noise):
        # The observation pipeline of Algorithm.policy_step, with the noise given.
        dist, _, carry = algo.network.apply(params, algo.obs_in(stats, obs), carry)
        dist = networks.mask_logits(dist, mask)
        return env_action(algo.spec, networks.sample_with_noise(algo.discrete, dist, noise)), carry

    return _positional(policy, step)


# ---------------------------------------------------------------- shapes and description
class _Signature(NamedTuple):
    """Input specs of each variant (batch dimension symbolic or fixed) and what the JSON
    says about each array."""

    deterministic_in: list
    seeded_in: list
    noise_in: list
    obs: dict
    action: dict
    carry: dict | None
    noise: dict
    action_mask: dict | None


def _signature(policy: Policy, batch_size: int | None) -> _Signature:
    spec = policy.spec
    if getattr(spec.env, "host_loop", False):  # an env stepped in Python: no reset to trace
        space = spec.env.observation_space(spec.env_params)
        obs = jax.ShapeDtypeStruct(spec.obs_shape, np.dtype(getattr(space, "dtype", np.float32)))
    else:
        obs = jax.eval_shape(lambda k: spec.env.reset(k, spec.env_params)[0], jax.random.PRNGKey(0))
    if not isinstance(obs, jax.ShapeDtypeStruct):
        raise ExportError(f"{policy.config.env_name}'s observations are a {type(obs).__name__}, "
                          "not one array; only array observations can be exported")
    b = batch_size if batch_size is not None else jax.export.symbolic_shape("b")[0]
    label = batch_size if batch_size is not None else "b"
    # A policy that tells agents apart (agent_id, per_agent) takes each env's agents together.
    agents = (spec.num_agents,) if policy.algorithm.takes_every_agent else ()
    obs_in = jax.ShapeDtypeStruct((b, *agents, *spec.obs_shape), obs.dtype)
    carry = policy.initial_carry((1, *agents))
    # one array (the built-in GRU's) or a user's module's pytree of them, e.g. an LSTM's (c, h)
    carry_in = (jax.tree.map(lambda c: jax.ShapeDtypeStruct((b, *c.shape[1:]), c.dtype), carry)
                if policy.recurrent else None)
    noise_in = jax.ShapeDtypeStruct((b, *agents, spec.action_dim), jnp.float32)
    mask_in = ([jax.ShapeDtypeStruct((b, *agents, spec.action_dim), jnp.bool_)]
               if policy.masked else [])
    action = jax.eval_shape(lambda o: policy.algorithm.policy_step(
        policy.params, policy.obs_stats, o, carry, None, True)[0],
        jax.ShapeDtypeStruct((1, *agents, *spec.obs_shape), obs.dtype))  # masks change no shape
    describe = lambda s: {"shape": [label, *map(int, s.shape[1:])],  # noqa: E731
                          "dtype": np.dtype(s.dtype).name}
    action_info = {**describe(action), "kind": "discrete" if spec.discrete else "continuous"}
    if spec.discrete:
        action_info["num_actions"] = spec.action_dim
    else:
        action_info.update(low=np.asarray(spec.action_low).tolist(),
                           high=np.asarray(spec.action_high).tolist())
    seed_in = jax.ShapeDtypeStruct((), jnp.uint32)
    with_carry = mask_in + ([carry_in] if policy.recurrent else [])
    return _Signature(
        deterministic_in=[obs_in, *with_carry],
        seeded_in=[obs_in, *with_carry, seed_in],
        noise_in=[obs_in, *with_carry, noise_in],
        obs=describe(obs_in),
        action=action_info,
        carry=_describe_carry(carry_in, carry, describe) if policy.recurrent else None,
        noise={**describe(noise_in),
               "distribution": "gumbel(0, 1)" if spec.discrete else "standard normal"},
        action_mask={**describe(mask_in[0]), "meaning": (
            f"the legal actions of each observation ({_mask_source(spec)}), true = legal; the "
            "action is always a legal one, and -1 for a row with no legal action")}
        if mask_in else None,
    )


def _mask_source(spec) -> str:
    """Where the env gives the legal actions the exported policy takes."""
    if getattr(spec.env, "host_loop", False):  # an env stepped in Python
        return HOST_MASK_SOURCES
    return "the env's action_mask(state, params) of the observation's state"


def _describe_carry(carry_in, carry, describe) -> dict:
    """The JSON's carry: its shape and dtype (each leaf's, under "leaves", for a pytree), and
    whether an episode starts from zeros."""
    out = (describe(carry_in) if isinstance(carry_in, jax.ShapeDtypeStruct)
           else {"leaves": [describe(c) for c in jax.tree.leaves(carry_in)]})
    zeros = all(not np.any(np.asarray(c)) for c in jax.tree.leaves(carry))
    return {**out, "initial": "zeros" if zeros else "policy.initial_carry"}


def _env_action_table(policy: Policy) -> list | None:
    """For `discretize_actions`: the original env's action for each discrete action index."""
    env = policy.env
    while env is not None and not hasattr(env, "continuous_action"):
        env = getattr(env, "_env", None)
    if env is None:
        return None
    index = jnp.arange(policy.spec.action_dim)
    table = jax.vmap(lambda i: env.continuous_action(i, policy.env_params))(index)
    return np.asarray(table).tolist()


def _metadata(policy: Policy, fmt: str, io: _Signature, path: Path, sample_path: Path | None,
              source) -> dict:
    carry_in, carry_out = ([], []) if io.carry is None else (["carry"], ["next_carry"])
    carry_in = (["action_mask"] if io.action_mask is not None else []) + carry_in
    variants = {"deterministic": {"file": path.name, "inputs": ["obs", *carry_in],
                                  "outputs": ["action", *carry_out]}}
    if sample_path is not None:
        extra = ["seed"] if fmt == "jax" else ["noise"]
        variants["sample"] = {"file": sample_path.name, "inputs": ["obs", *carry_in, *extra],
                              "outputs": ["action", *carry_out]}
    meta = {
        "format": fmt,
        "env": policy.config.env_name,
        "run_dir": None if isinstance(source, Policy) else str(source),
        "iteration": policy.iteration,
        "observation_normalization": "included" if policy.config.normalize_observations else "none",
        "obs": io.obs,
        **({"action_mask": io.action_mask} if io.action_mask is not None else {}),
        "action": io.action,
        "variants": variants,
        "transforms": list(policy.config.to_dict().get("transforms") or []),
        "jaxppo_version": __version__,
        "jax_version": jax.__version__,
    }
    if io.carry is not None:
        meta["carry"] = io.carry
    if sample_path is not None and fmt == "jax":
        meta["seed"] = {"shape": [], "dtype": "uint32",
                        "meaning": "jax.random.PRNGKey(seed) draws the batch's sample"}
    elif sample_path is not None:
        meta["noise"] = io.noise
    if fmt == "jax":
        meta["platforms"] = list(JAX_PLATFORMS)
    if policy.agents:
        meta["agents"] = _agents_entry(policy)
    table = _env_action_table(policy)
    if table is not None:
        meta["env_action_table"] = table  # row i: what action index i does in the original env
    return meta


def _agents_entry(policy: Policy) -> dict:
    """A multi-agent run's agents: the one exported function is every agent's policy (they
    share the network), fed that agent's observation zero-padded at the end to obs_dim."""
    if policy.algorithm.takes_every_agent:
        own = ("one network shared by all, told apart by their one-hot ids"
               if not policy.algorithm.per_agent else "each agent with its own network"
               if policy.algorithm.network.groups is None else
               "each group of agents named alike with its own network")
        meaning = (f"the agents act together ({own}): obs holds an env's agents' observations "
                   "in names' order, each flattened and zero-padded at the end to obs's last "
                   "axis; the action has the same agent axis")
    else:
        meaning = ("every agent acts with this function (one network shared by all): its "
                   "observation, flattened, zero-padded at the end to obs's last axis; a "
                   "batch may hold rows of several agents and envs")
    return {"names": list(policy.agents),
            "obs_size": {a: policy.env.agent_obs_size(a) for a in policy.agents},
            "meaning": meaning}


# ---------------------------------------------------------------- writers
def _jax_bytes(fn, specs) -> bytes:
    try:
        exported = jax.export.export(jax.jit(fn), platforms=JAX_PLATFORMS)(*specs)
    except Exception as e:  # e.g. a custom env op with no lowering for a platform
        raise ExportError(f"jax.export could not export the policy: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}") from e
    return bytes(exported.serialize())


def _onnx_bytes(fn, specs, input_names, output_names) -> bytes:
    to_onnx = _import_jax2onnx()
    # jax2onnx names a symbolic dimension by a string.
    specs = [jax.ShapeDtypeStruct(tuple(d if isinstance(d, int) else "b" for d in s.shape), s.dtype)
             for s in specs]
    try:
        with warnings.catch_warnings():  # jax2onnx's own use of deprecated jax names
            warnings.simplefilter("ignore", DeprecationWarning)
            model = to_onnx(fn, specs, model_name="jaxppo_policy", input_names=input_names,
                            output_names=output_names)
    except Exception as e:  # an op jax2onnx has no translation for
        raise ExportError(f"jax2onnx could not convert the policy: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}. format='jax' exports "
                          "every policy") from e
    return model.SerializeToString()


def _import_jax2onnx():
    """jax2onnx's `to_onnx`, or an ExportError naming the extra to install."""
    # jax2onnx logs a traceback for each optional plugin that does not load (its dm-pix ops
    # need an older jax); none of them is used here.
    for name in ("jax2onnx", "onnx_ir"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import onnx  # noqa: F401
        from jax2onnx import to_onnx
    except ImportError as e:
        raise ExportError(f"ONNX export needs jax2onnx and onnx, which are not installed here "
                          f"({e}): {EXPORT_INSTALL}. format='jax' needs nothing more") from e
    return to_onnx
