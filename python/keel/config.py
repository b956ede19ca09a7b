"""keel.TrainingConfig: a training recipe as keyword arguments.

Every key of a TOML recipe (docs/recipe.md) is a keyword, with the type and default the recipe
gives it; cann-recipes-train's names (the article's `hccl_topology`, ...) are accepted too. The
values are checked by the same parser as `keel train RECIPE.toml`, so a mistake gives the CLI's
message, its place written as the keyword: `TrainingConfig(batch_size=0): key 'batch_size' must be
positive, got 0`, `TrainingConfig(learning_rte=0.001): unknown key 'learning_rte' (did you mean
'learning_rate'?)`. Relative paths are relative to the current directory (the resolved config
holds them absolute, as a checkpoint's recipe does).
"""
import json
import math
import os
import tomllib

from . import _native
from ._native import Error

_SOURCE = "TrainingConfig"


def _defaults():
    table = tomllib.loads(_native.default_recipe())
    model_config = table.pop("model_config")
    return table, model_config


_DEFAULTS, _MODEL_CONFIG_DEFAULTS = _defaults()
_ALIASES = dict(_native.recipe_key_aliases())  # alias -> key


def _toml_value(value, key):
    """A Python value as a TOML value (the recipe's types: str, int, float, bool, lists, tables)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, (str, os.PathLike)):
        return json.dumps(os.fspath(value), ensure_ascii=False)  # JSON's escapes are TOML's
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v, key) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join("%s = %s" % (k, _toml_value(v, "%s.%s" % (key, k))) for k, v in value.items()) + "}"
    raise Error("%s(%s=%r): a %s is not a recipe value (strings, numbers, booleans, lists of strings, and a dict "
                "for model_config)" % (_SOURCE, key, value, type(value).__name__))


class TrainingConfig:
    """A training recipe: TrainingConfig(model_name=..., data_path=..., max_steps=..., ...).

    Keys and defaults: TrainingConfig.keys(), docs/recipe.md. A new model instead of model_name:
    model_config={"family": "llama", "vocab_size": ..., "hidden_size": ..., ...}.
    """

    def __init__(self, **kwargs):
        resolved = self._resolve(kwargs)
        object.__setattr__(self, "_values", {})
        self._load(resolved)

    # -- construction ---------------------------------------------------------------------------
    @staticmethod
    def _resolve(kwargs, base_dir=""):
        overrides = ["%s=%s" % (k, _toml_value(v, k)) for k, v in kwargs.items() if v is not None]
        return _native.resolve_recipe("", _SOURCE, overrides, _SOURCE, base_dir)

    def _load(self, resolved_toml):
        table = tomllib.loads(resolved_toml)
        values = {k: table.get(k, v) for k, v in _DEFAULTS.items()}
        values["model_config"] = table.get("model_config")
        object.__setattr__(self, "_values", values)

    @classmethod
    def from_toml(cls, recipe):
        """From a recipe file (its relative paths relative to its directory, as `keel train` reads
        it) or from TOML text (relative paths relative to the current directory)."""
        if "\n" not in recipe and os.path.isfile(recipe):
            path = os.path.abspath(recipe)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            resolved = _native.resolve_recipe(text, recipe, [], "--set", os.path.dirname(path))
        else:
            resolved = _native.resolve_recipe(recipe, _SOURCE, [], _SOURCE, "")
        config = cls.__new__(cls)
        config._load(resolved)
        return config

    def to_toml(self):
        """The resolved recipe (every key) as TOML: `keel train` runs it as this config."""
        return self._resolve(self.to_dict())

    def to_dict(self):
        values = dict(self._values)
        if values.get("model_config") is None:
            values.pop("model_config", None)
        return values

    @staticmethod
    def keys():
        """Every key with its default (model_config: a new model's keys with theirs)."""
        keys = dict(_DEFAULTS)
        keys["model_config"] = dict(_MODEL_CONFIG_DEFAULTS)
        return keys

    # -- attributes -----------------------------------------------------------------------------
    def __getattr__(self, name):
        values = object.__getattribute__(self, "_values")
        key = _ALIASES.get(name, name)
        if key in values:
            return values[key]
        raise AttributeError("TrainingConfig has no key '%s'" % name)

    def __setattr__(self, name, value):
        # Checked as the constructor checks it: an unknown key or a wrong value is keel.Error now,
        # not a silently ignored attribute.
        values = dict(self.to_dict())
        values[_ALIASES.get(name, name)] = value
        self._load(self._resolve(values))

    def __eq__(self, other):
        return isinstance(other, TrainingConfig) and self.to_dict() == other.to_dict()

    def __repr__(self):
        changed = ["%s=%r" % (k, v) for k, v in self.to_dict().items() if k == "model_config" or v != _DEFAULTS.get(k)]
        return "TrainingConfig(%s)" % ", ".join(changed)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(_DEFAULTS) | {"model_config"})


def _signature():
    """help(TrainingConfig) and editors show every key with its type and default."""
    import inspect
    params = [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v, annotation=type(v))
              for k, v in _DEFAULTS.items()]
    params.append(inspect.Parameter("model_config", inspect.Parameter.KEYWORD_ONLY, default=None,
                                    annotation=dict))
    return inspect.Signature([inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)] + params)


TrainingConfig.__init__.__signature__ = _signature()
