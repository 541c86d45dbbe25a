"""`--config=NAME --config.a.b=value`: pick configs/NAME.py and override fields of its typed dataclass.

Values are parsed by the field's declared type (int, float, bool, str, `X | None`, tuples as comma-separated lists),
so a typo or a wrong type is an error that names the field and what it accepts, never a silently ignored flag.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import os
import sys
import types
import typing
from typing import Any

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


class ConfigFlagError(ValueError):
    """A --config or --config.* flag that cannot be applied; the message says what to pass instead."""


def available_configs() -> list[str]:
    if not os.path.isdir(CONFIG_DIR):
        return []
    return sorted(f[:-3] for f in os.listdir(CONFIG_DIR) if f.endswith(".py") and not f.startswith("_"))


def _exec_file(module_name: str, path: str):
    """Import a config file as `module_name` (registered in sys.modules: dataclasses need their module there)."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def load_named(name: str):
    """The object returned by get_config() of configs/NAME.py (or of a .py file given by path)."""
    if name.endswith(".py") or os.sep in name:
        if not os.path.isfile(name):
            raise ConfigFlagError(f"--config={name}: no such file")
        module = _exec_file(f"_kvjax_config_{os.path.splitext(os.path.basename(name))[0]}", name)
        where = name
    else:
        path = os.path.join(CONFIG_DIR, f"{name}.py")
        if not os.path.isfile(path):
            raise ConfigFlagError(f"--config={name}: there is no configs/{name}.py; available: "
                                  f"{', '.join(available_configs()) or 'none'}")
        module = _exec_file(f"configs.{name}", path)
        where = f"configs/{name}.py"
    if not hasattr(module, "get_config"):
        raise ConfigFlagError(f"{where} has no get_config() function")
    return module.get_config(), where


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_dataclass_type(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _describe(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is tuple:
        return f"comma-separated list of {_describe(args[0])}"
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def parse_value(text: str, tp, field: str):
    """`text` converted to type `tp` (raises ConfigFlagError naming `field` and the accepted form)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    bad = ConfigFlagError(f"--config.{field}={text!r}: expected {_describe(tp)}")
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and text.strip().lower() in ("none", "null"):
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return parse_value(text, arg, field)
            except ConfigFlagError:
                pass
        raise bad
    if origin is tuple:
        inner = args[0]
        body = text.strip()
        if body[:1] in "([" and body[-1:] in ")]":
            body = body[1:-1]
        parts = [p.strip() for p in body.split(",") if p.strip()]
        return tuple(parse_value(p, inner, field) for p in parts)
    if tp is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise bad
    if tp is int:
        try:
            return int(text.strip().replace("_", ""))
        except ValueError:
            raise bad from None
    if tp is float:
        try:
            return float(text.strip())
        except ValueError:
            raise bad from None
    if tp is str:
        return text
    raise ConfigFlagError(f"--config.{field}: fields of type {tp} cannot be set from the command line")


def _field_names(cfg) -> list[str]:
    """Every settable dotted field name of a dataclass instance."""
    out = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out += [f"{f.name}.{sub}" for sub in _field_names(value)]
        else:
            out.append(f.name)
    return out


def override(cfg, dotted: str, text: str, _prefix: str = ""):
    """A copy of dataclass `cfg` with field `dotted` (e.g. "eval.mc.limit") set from the string `text`."""
    head, _, rest = dotted.partition(".")
    full = _prefix + head
    if head not in [f.name for f in dataclasses.fields(cfg)]:
        everything = [_prefix + n for n in _field_names(cfg)]
        close = difflib.get_close_matches(_prefix + dotted, everything, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        here = [_prefix + f.name + (".*" if dataclasses.is_dataclass(getattr(cfg, f.name)) else "")
                for f in dataclasses.fields(cfg)]
        raise ConfigFlagError(f"unknown config field {_prefix + dotted!r}{hint}; the fields"
                              f"{' of ' + _prefix[:-1] if _prefix else ''} are: {', '.join(here)}")
    tp = _hints(type(cfg))[head]
    current = getattr(cfg, head)
    if rest:
        if not dataclasses.is_dataclass(current):
            raise ConfigFlagError(f"config field {full!r} holds a single value ({_describe(tp)}); it has no "
                                  f"field {rest!r}")
        return dataclasses.replace(cfg, **{head: override(current, rest, text, full + ".")})
    if dataclasses.is_dataclass(current):
        raise ConfigFlagError(f"config field {full!r} is a group of settings; set one of its fields, e.g. "
                              f"--config.{full}.{_field_names(current)[0]}=...")
    return dataclasses.replace(cfg, **{head: parse_value(text, tp, full)})


def parse_argv(argv: list[str]) -> tuple[str | None, list[tuple[str, str]], list[str]]:
    """Split argv into (config name, [(field, value)], other args). Accepts --config=NAME / --config NAME and
    --config.a.b=v / --config.a.b v."""
    name, overrides, rest = None, [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" or arg.startswith("--config=") or arg.startswith("--config."):
            key, eq, value = arg[2:].partition("=")
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigFlagError(f"{arg} needs a value: {arg}=VALUE")
                value, i = argv[i + 1], i + 1
            if key == "config":
                name = value
            else:
                overrides.append((key[len("config."):], value))
        else:
            rest.append(arg)
        i += 1
    return name, overrides, rest


def build(name: str, overrides: list[tuple[str, str]], expect: type | None = None):
    """get_config() of `name` with `overrides` applied, checked to be an instance of `expect`."""
    cfg, where = load_named(name)
    if expect is not None and not isinstance(cfg, expect):
        raise ConfigFlagError(f"{where}: get_config() returns a {type(cfg).__name__}, not a {expect.__name__}; "
                              f"pick a config made for this command (available: {', '.join(available_configs())})")
    for dotted, text in overrides:
        cfg = override(cfg, dotted, text)
    check_types(cfg)
    return cfg


def check_types(cfg, prefix: str = "") -> None:
    """Every field holds a value of its declared type (catches config files that put e.g. a list in a tuple)."""
    hints = _hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value, tp, name = getattr(cfg, f.name), hints[f.name], prefix + f.name
        if dataclasses.is_dataclass(value):
            check_types(value, name + ".")
        elif not _matches(value, tp):
            raise ConfigFlagError(f"config field {name} = {value!r} is not a {_describe(tp)}")


def _matches(value, tp) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if tp is type(None):
        return value is None
    if origin is tuple:
        return isinstance(value, tuple) and all(_matches(v, args[0]) for v in value)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if _is_dataclass_type(tp):
        return isinstance(value, tp)
    return isinstance(value, tp)


def to_dict(cfg) -> dict:
    """JSON-able nested dict of a dataclass tree (tuples become lists)."""
    return dataclasses.asdict(cfg)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def describe_config(cfg) -> str:
    """One `field = value` line per setting (for --help and the log)."""
    return "\n".join(f"  {k} = {v!r}" for k, v in flatten(to_dict(cfg)).items())


# ---- the main job's distributed flags (kvjax.distributed starts the runtime from them) -------------------------

@dataclasses.dataclass(frozen=True)
class LaunchFlags:
    """The distributed flags of `python -m kvjax.launch` (its --name=value style; its --help says what each does)."""
    distributed: str = "auto"
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout: int = 30
    init_timeout: int = 300
    step_timeout: float = 0.0


def split_launch_flags(argv: list[str]) -> tuple[LaunchFlags, list[str]]:
    """(the distributed flags in argv, the other arguments). Raises ValueError saying what is wrong."""
    fields = {f.name: f for f in dataclasses.fields(LaunchFlags)}
    values, rest = {}, []
    for arg in argv:
        name, eq, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        if not arg.startswith("--") or name not in fields:
            rest.append(arg)
            continue
        if not eq:
            raise ValueError(f"{arg}: give a value, --{name}=VALUE")
        if name == "distributed" and value not in ("auto", "on", "off"):
            raise ValueError(f"--distributed={value}: use auto, on or off")
        kind = {"coordinator": str, "step_timeout": float}.get(name, int) if name != "distributed" else str
        try:
            values[name] = kind(value)
        except ValueError:
            raise ValueError(f"--{name}={value!r}: expected {kind.__name__}") from None
    return LaunchFlags(**values), rest
