"""Config files and the names other libraries give our fields.

`read_config_file` reads a YAML or JSON file of config fields, and `load_yaml` a `--set`
value, both bounded (a file whose aliases expand past any config's size is refused) and
strict (a key given twice is an error). An unknown key or keyword (`refuse_unknown_keys`,
`refuse_unknown_keywords`) is a ConfigError naming the field meant: the one other PPO code
means by that name (`ALIASES`), else the nearest field names.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
from pathlib import Path

from jaxppo.config_fields import did_you_mean, nested_fields, nested_hint
from jaxppo.errors import ConfigError

# Names other PPO code uses for our fields (PureJaxRL, RLlib, CleanRL, SB3, Cleanba, gymnasium,
# Stoix and Mava).
ALIASES = {
    "learning_rate": "lr", "ent_coef": "entropy_coeff", "entropy_coef": "entropy_coeff",
    "vf_coef": "vf_coeff", "vf_loss_coeff": "vf_coeff", "clip_eps": "clip_param",
    "clip_range": "clip_param", "clip_coef": "clip_param", "lambda": "gae_lambda",
    "lambda_": "gae_lambda", "update_epochs": "num_epochs", "num_sgd_iter": "num_epochs",
    "n_epochs": "num_epochs", "n_steps": "num_steps", "rollout_fragment_length": "num_steps",
    "n_envs": "num_envs", "max_grad_norm_clip": "max_grad_norm", "grad_clip": "max_grad_norm",
    "anneal_lr": "lr_schedule", "env_name": "env", "env_id": "env", "env_config": "env_kwargs",
    "total_steps": "total_timesteps", "fcnet_hiddens": "network", "activation": "network",
    "num_actor_threads": "actor_threads", "vectorization_mode": "gymnasium_vectorization",
    "actor_lr": "lr", "_lr_vf": "critic_lr", "lr_vf": "critic_lr",
    "target_kl": "kl_early_stop",
}

# jaxppo's built-in transforms (jaxppo.envs.transforms.BUILTIN_TRANSFORMS), and other code's
# names for frame stacking: keys a config gives inside `transforms`, with an example of each.
TRANSFORM_KEYS = {"frame_stack": "{frame_stack: {k: 4}}", "framestack": "{frame_stack: {k: 4}}",
                  "frame_stack_num": "{frame_stack: {k: 4}}",
                  "discretize_actions": "{discretize_actions: {bins: 11}}",
                  "count_bonus": "{count_bonus: {scale: 0.1}}"}


def _yaml_loader():
    """PyYAML's SafeLoader with YAML 1.2 floats, so 3e-4 and 5e5 are numbers, not strings."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if isinstance(key, (str, int, float, bool)) and key in seen:
                    raise _DuplicateKey(
                        f"key {key!r} is given twice (lines {seen[key] + 1} and "
                        f"{key_node.start_mark.line + 1}); keep one")
                if isinstance(key, (str, int, float, bool)):
                    seen[key] = key_node.start_mark.line
            return super().construct_mapping(node, deep=deep)

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"""^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                    |[0-9][0-9_]*[eE][-+]?[0-9]+
                    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                    |\.(?:inf|Inf|INF)|[-+]\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", re.X),
        list("-+0123456789."),
    )
    return Loader


def read_config_file(path: str | Path) -> dict:
    """The mapping of field: value a YAML or JSON config file holds; ConfigError for a path
    that is not a readable file, malformed YAML/JSON, a key given twice, or a file whose
    aliases expand to more values than any config holds."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist; check the path")
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory; give the YAML or JSON "
                          "file itself (e.g. a run folder's config.yaml)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read as text: "
                          f"{getattr(e, 'strerror', None) or e}") from None
    if path.suffix == ".json":
        try:
            data = json.loads(text, object_pairs_hook=_unique_json_keys)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid JSON: {e.msg} at line "
                              f"{e.lineno}, column {e.colno}") from None
        except _DuplicateKey as e:
            raise ConfigError(f"config file {str(path)!r}: {e}") from None
        _check_size(data, f"config file {str(path)!r}")
    else:
        data = load_yaml(text, where=f"config file {str(path)!r}") or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of field: value")
    return data


# More values than any config holds: a file beyond this is refused before anything reads it
# through (aliases can make a few lines expand to billions of values).
MAX_CONFIG_VALUES = 100_000


def load_yaml(text: str, where: str = "the value"):
    """YAML (1.2 floats, safe tags only) -> Python values; ConfigError, naming `where` and
    the line, for malformed YAML, a key given twice, or an alias bomb."""
    import yaml

    try:
        data = yaml.load(text, Loader=_yaml_loader())
    except _DuplicateKey as e:
        raise ConfigError(f"{where}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where} is not valid YAML: {problem}{at}") from None
    _check_size(data, where)
    return data


def _check_size(data, where: str) -> None:
    """Count values through every alias, stopping at MAX_CONFIG_VALUES (time stays bounded)."""
    stack, seen = [data], 0
    while stack:
        v = stack.pop()
        seen += 1
        if seen > MAX_CONFIG_VALUES:
            raise ConfigError(f"{where} expands to more than {MAX_CONFIG_VALUES:,} values (YAML "
                              "aliases?); a config is a few dozen fields: write it out plainly")
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


class _DuplicateKey(Exception):
    pass


def _unique_json_keys(pairs):
    keys = [k for k, _ in pairs]
    dup = next((k for k in keys if keys.count(k) > 1), None)
    if dup is not None:
        raise _DuplicateKey(f"key {dup!r} is given twice in one JSON object; keep one")
    return dict(pairs)


def _suggest_field(key: str, names, cls=None, keyword: bool = False) -> str:
    """"; did you mean ...?" for an unknown config key: a nested config's field of that name
    (network.hidden_sizes), the field another library's name for it means, else the nearest
    field names, else the nearest nested field."""
    if cls is not None and nested_hint(key, cls, keyword):
        return nested_hint(key, cls, keyword)
    if str(key).lower() in TRANSFORM_KEYS and "transforms" in names:
        example = TRANSFORM_KEYS[str(key).lower()]
        return (f"; it is an env transform, given in the list `transforms`: "
                f"transforms=[{example}] (docs/configuration.md, Transforms)")
    alias = ALIASES.get(str(key).lower())
    if alias is not None and alias in names:
        hint = f"; did you mean {alias!r}?"
        if alias == "network":
            hint = "; set it inside network, e.g. network.hidden_sizes=[64,64] or network.activation=tanh"
        if alias == "lr_schedule":
            hint = "; did you mean 'lr_schedule' (linear or constant)?"
        return hint
    if cls is not None and _closer_nested(str(key), names, cls):
        near = nested_hint(key, cls, keyword, exact=False)
        if near:
            return near
    return did_you_mean(key, names)


def _closer_nested(key: str, names, cls) -> bool:
    """True when `key` is spelt more like a nested config's field than like a field of `cls`."""
    def best(pool):
        return max((difflib.SequenceMatcher(None, key, n).ratio() for n in pool), default=0.0)

    return best(nested_fields(cls)) > best(names)


def refuse_unknown_keys(values: dict, cls, prefix: str = "") -> None:
    """ConfigError for the first key of `values` that is not a field of `cls` (a mapping read
    from a file or --set pairs), suggesting the field meant."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in values if k not in names]
    if unknown:
        key = unknown[0]
        hint = did_you_mean(key, names, prefix) if prefix else _suggest_field(key, names, cls)
        shown = repr(prefix + str(key)) if prefix else repr(key)
        raise ConfigError(f"unknown config key {shown}{hint}; valid keys: "
                          f"{', '.join(prefix + n for n in sorted(names))}")


def refuse_unknown_keywords(cls, prefix: str = "") -> None:
    """`cls(...)` and `config.replace(...)` with a keyword that is not a field: a ConfigError
    naming the nearest fields, as `from_dict` gives, instead of the dataclass's bare
    TypeError ("__init__() got an unexpected keyword argument")."""
    init = cls.__init__
    names = {f.name for f in dataclasses.fields(cls)}

    def __init__(self, *args, **kwargs):
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            key = unknown[0]
            hint = (did_you_mean(key, names, prefix) if prefix
                    else _suggest_field(key, names, cls, keyword=True))
            raise ConfigError(
                f"{cls.__name__} has no field {prefix + key!r}{hint}; fields: "
                f"{', '.join(prefix + n for n in sorted(names))}")
        init(self, *args, **kwargs)

    __init__.__doc__, __init__.__signature__ = init.__doc__, inspect.signature(init)
    __init__.__qualname__ = init.__qualname__
    cls.__init__ = __init__
