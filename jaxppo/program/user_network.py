"""A user's own network (`network.module`): the flax module class a config names, imported
and built here (`user_module`), outside jaxppo.core, which gets the module; and the check of
the built network against the one network contract (`check_custom_network`).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.config import PPOConfig
from jaxppo.core.networks import module_name
from jaxppo.envs.make import import_attribute
from jaxppo.envs.spec import EnvSpec
from jaxppo.errors import ConfigError


def user_module(net) -> nn.Module:
    """The flax module a NetworkConfig's `module` gives: the object itself, or the class
    "module:Class" names, checked to be a flax.linen.Module subclass before it is called with
    `kwargs` (a config may name code only as a class of the kind expected).

    Raises:
      ConfigError: the import fails, the name is not a flax.linen.Module subclass, or its
        constructor rejects the kwargs.
    """
    if isinstance(net.module, nn.Module):
        return net.module
    path = net.module
    obj = import_attribute(path, "network.module")
    if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
        kind = "class" if isinstance(obj, type) else ("function" if callable(obj) else type(obj).__name__)
        raise ConfigError(
            f"network.module={path!r} is a {kind} {getattr(obj, '__name__', '')}, not a "
            "flax.linen.Module subclass: a config may name only a flax module class as its "
            "network (jaxppo calls nothing else a config names); define the network as "
            "`class ActorCritic(flax.linen.Module)`")
    kwargs = {k: _tupled(v) for k, v in net.kwargs.items()}
    try:
        return obj(**kwargs)
    except Exception as e:  # noqa: BLE001 - any constructor failure is the config's
        call = f"{obj.__name__}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
        raise ConfigError(f"network.module={path!r}: {call} raised {type(e).__name__}: "
                          f"{str(e)[:200]}; network.kwargs are the module's constructor "
                          "arguments") from None


def _tupled(v):
    """A config file's lists as tuples (what a flax module's fields usually hold)."""
    if isinstance(v, list):
        return tuple(_tupled(x) for x in v)
    if isinstance(v, dict):
        return {k: _tupled(x) for k, x in v.items()}
    return v


def check_custom_network(config: PPOConfig, spec: EnvSpec, network) -> None:
    """Checks a user's module (`networks.CustomNetwork`) against the network contract by
    tracing its init and apply (jax.eval_shape: nothing is computed or compiled) on
    observations of batch shapes (1,), (2,) and (3, 2), as training calls it.

    Raises:
      ConfigError: what the contract expects and what came out (or what the module raised):
        params that are not float arrays in the "params" collection, outputs of another
        structure or shape, a value of another shape, or a carry that changes.
    """
    name = f"network.module={module_name(config.network.module)}"
    obs1 = jax.ShapeDtypeStruct((1, spec.obs_dim), jnp.float32)
    variables = _traced(name, "init(key, obs [1, obs_dim], carry, reset)",
                        network.init, jax.random.PRNGKey(0), obs1)
    _check_params(name, variables)
    for batch in ((2,), (3, 2)):
        obs = jax.ShapeDtypeStruct(batch + (spec.obs_dim,), jnp.float32)
        carry = _traced(name, f"initial_carry({batch})", lambda b=batch: network.initial_carry(b))
        reset = jax.ShapeDtypeStruct(batch, jnp.bool_)
        out = _traced(name, f"apply(params, obs {list(obs.shape)}, carry, reset)",
                      network.module.apply, variables, obs, carry, reset)
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            raise ConfigError(
                f"{name}: __call__(obs, carry, reset) must return (outputs, value, new_carry), "
                f"got {_described(out)}")
        outputs, value, new_carry = out
        _check_outputs(name, spec, batch, outputs)
        if not _is_float(value) or tuple(value.shape) != batch:
            raise ConfigError(
                f"{name}: the value must be a float array of shape {list(batch)} (the batch "
                f"shape of obs {list(obs.shape)}, no trailing 1), got {_described(value)}; "
                "e.g. return nn.Dense(1)(h)[..., 0]")
        _check_carry(name, network, batch, carry, new_carry)


def _traced(name: str, call: str, fn, *args):
    """jax.eval_shape(fn, *args); what the user's code raises becomes a ConfigError."""
    try:
        return jax.eval_shape(fn, *args)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the user's module is the config's
        reason = (str(e).strip().splitlines() or [""])[0][:300].rstrip(".")
        raise ConfigError(
            f"{name}: {call} raised {type(e).__name__}: {reason}. The module must take "
            "observations [..., obs_dim] with any leading axes, its carry and reset [...] "
            '(docs/configuration.md, "Your own network")') from None


def _check_params(name: str, variables) -> None:
    collections = sorted(variables) if hasattr(variables, "keys") else None
    if collections != ["params"]:
        got = collections if collections is not None else _described(variables)
        raise ConfigError(
            f"{name}: init must give only the 'params' collection (PPO trains params and "
            f"updates nothing else, e.g. no BatchNorm statistics), got collections {got}")
    for path, leaf in jax.tree_util.tree_flatten_with_path(variables["params"])[0]:
        if not _is_float(leaf):
            raise ConfigError(
                f"{name}: every param must be a float array (the optimiser updates them all), "
                f"but params{jax.tree_util.keystr(path)} is {_described(leaf)}")


def _check_outputs(name: str, spec: EnvSpec, batch: tuple, outputs) -> None:
    """Logits [*batch, A] for discrete actions; (mean [*batch, D], log_std [D] or
    [*batch, D]) for continuous ones."""
    A = spec.action_dim
    if spec.discrete:
        if not _is_float(outputs) or tuple(outputs.shape) != batch + (A,):
            raise ConfigError(
                f"{name}: for the env's {A} discrete actions the outputs must be the logits, a "
                f"float array of shape {list(batch + (A,))}, got {_described(outputs)}")
        return
    ok = (isinstance(outputs, (tuple, list)) and len(outputs) == 2
          and all(_is_float(x) for x in outputs) and tuple(outputs[0].shape) == batch + (A,)
          and tuple(outputs[1].shape) in ((A,), batch + (A,)))
    if not ok:
        raise ConfigError(
            f"{name}: for the env's {A}-dimensional continuous actions the outputs must be "
            f"(mean, log_std): mean a float array of shape {list(batch + (A,))}, log_std of "
            f"shape [{A}] (one for every state) or {list(batch + (A,))}, got "
            f"{_described(outputs)}")


def _check_carry(name: str, network, batch: tuple, carry, new_carry) -> None:
    """A feed-forward module returns no arrays as its carry; a recurrent one returns a carry
    of the structure, shapes and dtypes of the one it was given."""
    if not network.recurrent:
        if jax.tree.leaves(new_carry):
            raise ConfigError(
                f"{name}: a module without initial_carry is feed-forward and must return the "
                f"carry () it is given, got {_described(new_carry)}; a recurrent module "
                "defines initial_carry(batch_shape) -> its carry at an episode's start")
        return
    same = jax.tree.structure(carry) == jax.tree.structure(new_carry) and all(
        _is_float(b) == _is_float(a) and getattr(b, "shape", None) == a.shape
        and getattr(b, "dtype", None) == a.dtype
        for a, b in zip(jax.tree.leaves(carry), jax.tree.leaves(new_carry)))
    if not same:
        raise ConfigError(
            f"{name}: the new carry must have the structure, shapes and dtypes of the carry "
            f"it is given (initial_carry({batch}) = {_described(carry)}), got "
            f"{_described(new_carry)}; a carry that changes shape cannot be carried from step "
            "to step")


def _is_float(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _described(x) -> str:
    """A pytree of arrays as types and shapes, e.g. "(float32[2, 3], float32[3])"."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{np.dtype(x.dtype).name}{list(x.shape)}"
    if isinstance(x, (tuple, list)):
        inner = ", ".join(_described(v) for v in x)
        return f"({inner})" if isinstance(x, tuple) else f"[{inner}]"
    if hasattr(x, "items"):
        return "{" + ", ".join(f"{k!r}: {_described(v)}" for k, v in x.items()) + "}"
    return f"{type(x).__name__} {x!r:.60}"
