"""Typed options: every field of a process's configuration defined once, as a dataclass field.

A configuration is a frozen dataclass whose fields are made with `option(...)`. From it come the
command-line flags (`--kv-memory`, each with its `TS_*` variable, default and help), the values
read from the environment and from a YAML file (`--config`), their validation, the YAML that
`--print-config` prints, and the arguments `serve` hands to its children. Precedence: flag >
environment > config file > default. An empty environment variable means unset.

This is the one module that reads the product's `TS_*` variables from the environment; kernel
debugging switches are read in `kernels/switches.py`.

A bad value raises `ConfigError` with one line naming where the value came from (flag,
variable or config-file key), the value, and what is accepted; the commands exit with status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from shared.option_kinds import Flag, Kind, Text

REDACTED = "***"
CONFIG_FLAG, PRINT_FLAG = "--config", "--print-config"


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message is one line for the user."""


# ---- fields --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Spec:
    """What `option()` records about a field; `name` and the flag and variable names are derived
    from the field's name unless given."""
    help: str
    kind: Kind
    flag: str | None = None
    aliases: tuple[str, ...] = ()
    short: str | None = None
    env: tuple[str, ...] = ()
    internal: bool = False       # assigned by `tensorserve serve` to its children, not a `serve` flag
    secret: bool = False         # redacted in logs and printed configurations, handed to children by environment


def option(default: Any, help: str, kind: Kind | None = None, *, flag: str | None = None,
           aliases: Iterable[str] = (), short: str | None = None, env: str | Iterable[str] | None = None,
           internal: bool = False, secret: bool = False) -> Any:
    """A configuration field. `env` names the variable(s) read (the first is the one documented;
    default TS_<FIELD>); `aliases` are further flags (vLLM's names)."""
    envs = (env,) if isinstance(env, str) else tuple(env or ())
    spec = Spec(help, kind or Text(), flag, tuple(aliases), short, envs, internal, secret)
    return dataclasses.field(default=default, metadata={"option": spec})


@dataclass(frozen=True)
class Option:
    """A field of a configuration class, with its names resolved."""
    name: str
    default: Any
    spec: Spec

    @property
    def flag(self) -> str:
        return self.spec.flag or "--" + self.name.replace("_", "-")

    @property
    def flags(self) -> tuple[str, ...]:
        return (self.flag, *self.spec.aliases, *([self.spec.short] if self.spec.short else []))

    @property
    def env(self) -> tuple[str, ...]:
        return self.spec.env or ("TS_" + self.name.upper(),)

    @property
    def kind(self) -> Kind:
        return self.spec.kind

    def shown(self, value: Any) -> str:
        if value is None:
            return "unset"
        return REDACTED if self.spec.secret else self.kind.format(value)


def options_of(*classes: type, include_internal: bool = True, only: Iterable[str] | None = None,
               leave_out: Iterable[tuple[type, str]] = ()) -> list[Option]:
    """The options of configuration classes, each field once (a field shared through a common base
    class appears once); two different fields of one name or one variable are an error.
    `leave_out` names (class, field) pairs to skip (serve's --model is the router's, not the worker's)."""
    seen: dict[str, Option] = {}
    wanted = set(only) if only is not None else None
    skipped = set(leave_out)
    for cls in classes:
        for f in dataclasses.fields(cls):
            spec = f.metadata.get("option")
            if spec is None or (spec.internal and not include_internal) or (wanted and f.name not in wanted):
                continue
            if (cls, f.name) in skipped:
                continue
            opt = Option(f.name, f.default, spec)
            if f.name in seen:
                if seen[f.name].spec is not spec:
                    raise TypeError(f"two different options named {f.name!r} in {[c.__name__ for c in classes]}")
                continue
            seen[f.name] = opt
    names: dict[str, str] = {}
    for opt in seen.values():
        for key in (*opt.flags, *opt.env):
            if names.setdefault(key, opt.name) != opt.name:
                raise TypeError(f"{key} names both {names[key]!r} and {opt.name!r}")
    return list(seen.values())


# ---- argparse ------------------------------------------------------------------------------------

class ArgumentParser(argparse.ArgumentParser):
    """argparse with its usage errors on one line, as bad values are (status 2)."""

    def error(self, message: str):
        self.exit(2, f"error: {message}; see `{self.prog} --help`\n")


def add_flags(parser: argparse.ArgumentParser, options: list[Option], config_file: bool = True) -> None:
    """One flag per option (default suppressed, so `resolve` knows what was given), plus
    --config and --print-config."""
    group = parser.add_argument_group("options (flag > TS_* variable > --config file > default)")
    for opt in options:
        tail = f"[env {opt.env[0]}, default {opt.shown(opt.default) if opt.default is not None else 'unset'}]"
        text = f"{opt.spec.help} {tail}".replace("%", "%%")
        if isinstance(opt.kind, Flag):
            group.add_argument(*opt.flags, dest=opt.name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=text)
        elif opt.kind.repeatable:
            group.add_argument(*opt.flags, dest=opt.name, action="append", default=argparse.SUPPRESS,
                               metavar=opt.kind.metavar, help=text)
        else:
            group.add_argument(*opt.flags, dest=opt.name, default=argparse.SUPPRESS,
                               metavar=opt.kind.metavar, help=text)
    if config_file:
        parser.add_argument(CONFIG_FLAG, metavar="FILE.yaml", default=None,
                            help="read options from this YAML file (keys are the option names, e.g. "
                                 "kv_memory: 2GiB); flags and TS_* variables win over it")
        parser.add_argument(PRINT_FLAG, action="store_true",
                            help="print the effective configuration as YAML (secrets redacted) and exit")


# ---- resolution ----------------------------------------------------------------------------------

@dataclass
class Resolved:
    """Every option's value and where it came from ('flag --x', 'environment variable TS_X', ...)."""
    options: list[Option]
    values: dict[str, Any]
    sources: dict[str, str]

    def build(self, cls: type, **assigned: Any) -> Any:
        """An instance of `cls` from the values of its fields (others keep their defaults)."""
        specs = {f.name: f.metadata.get("option") for f in dataclasses.fields(cls)}
        mine = {o.name for o in self.options if specs.get(o.name) is o.spec}    # not another's `host`
        return cls(**{**{k: v for k, v in self.values.items() if k in mine}, **assigned})

    def source(self, name: str) -> str:
        return self.sources.get(name, "default")

    def where(self, name: str) -> str:
        """How to name the option in a message: its flag with the source of its value."""
        opt = next(o for o in self.options if o.name == name)
        source = self.source(name)
        return f"{opt.flag} {opt.shown(self.values[name])} ({'flag' if source.startswith('flag') else source})"

    def non_default(self) -> list[str]:
        return [f"{o.name}={o.shown(self.values[o.name])} ({self.source(o.name)})" for o in self.options
                if self.source(o.name) != "default"]

    def to_yaml(self) -> str:
        import yaml
        data = {o.name: (REDACTED if o.spec.secret and self.values[o.name] is not None
                         else (None if self.values[o.name] is None else o.kind.to_yaml(self.values[o.name])))
                for o in self.options}
        return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def read_config_file(path: str) -> dict[str, Any]:
    import yaml
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{CONFIG_FLAG} {path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{CONFIG_FLAG} {path}: not valid YAML ({' '.join(str(exc).split())})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{CONFIG_FLAG} {path}: expected a mapping of option names to values, "
                          f"got a YAML {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def resolve(options: list[Option], flags: argparse.Namespace | Mapping[str, Any] | None = None,
            environ: Mapping[str, str] | None = None, config_file: str | None = None) -> Resolved:
    """Each option's value: flag > environment > config file > default, parsed and checked."""
    given = vars(flags) if isinstance(flags, argparse.Namespace) else dict(flags or {})
    environ = os.environ if environ is None else environ
    file_values = read_config_file(config_file) if config_file else {}
    aliases = {a.lstrip("-").replace("-", "_"): o.name for o in options for a in (o.flag, *o.spec.aliases)
               if a.startswith("--")}
    file_values = {aliases.get(k, k): v for k, v in file_values.items()}      # e.g. max_model_len, port
    known = {o.name for o in options}
    unknown = sorted(set(file_values) - known)
    if unknown:
        raise ConfigError(f"{CONFIG_FLAG} {config_file}: unknown key {unknown[0]!r}; the keys are the option "
                          f"names of this command: {', '.join(sorted(known))}")
    values, sources = {}, {}
    for opt in options:
        values[opt.name], origin = opt.default, None
        if opt.name in given and given[opt.name] is not None:
            raw, origin = given[opt.name], f"flag {opt.flag}"
            if isinstance(raw, str):
                values[opt.name] = _parse(opt, raw, f"flag {opt.flag}")
            elif opt.kind.repeatable and isinstance(raw, list):      # the flag given several times
                values[opt.name] = tuple(v for r in raw for v in _parse(opt, r, f"flag {opt.flag}"))
            else:
                values[opt.name] = raw
        elif (name := next((e for e in opt.env if environ.get(e, "") != ""), None)) is not None:
            origin = f"environment variable {name}"
            values[opt.name] = _parse(opt, environ[name], f"environment variable {name}")
        elif opt.name in file_values:
            raw = file_values[opt.name]
            if raw is None or (opt.spec.secret and raw == REDACTED):
                continue                    # null, or a printed configuration's redacted secret: unset here
            origin = f"config file {config_file}, key {opt.name}"
            values[opt.name] = _parse(opt, raw, origin, from_yaml=True)
        if origin:
            sources[opt.name] = origin
    return Resolved(options, values, sources)


def _parse(opt: Option, raw: Any, where: str, from_yaml: bool = False) -> Any:
    try:
        return opt.kind.from_yaml(raw) if from_yaml else opt.kind.parse(raw)
    except ValueError as exc:
        reason = "invalid value" if opt.spec.secret else _reason(exc)
        raise ConfigError(f"{where}: {reason}; {opt.flag} takes {opt.kind.accepted}") from None


def _reason(exc: ValueError) -> str:
    return str(exc).splitlines()[0] if str(exc) else "invalid value"


def env_value(name: str) -> str | None:
    """A product variable read outside a command's configuration (library code such as the model
    registry's cache folder); empty means unset."""
    value = os.environ.get(name, "")
    return value or None


def to_argv(options: list[Option], config: Any) -> tuple[list[str], dict[str, str]]:
    """Flags that give a child process this configuration's non-default values, and the
    environment that carries its secrets (never on a command line, which `ps` shows)."""
    argv, env = [], {}
    for opt in options:
        value = getattr(config, opt.name)
        if value == opt.default or value is None:
            continue
        if opt.spec.secret:
            env[opt.env[0]] = str(value)
        elif isinstance(opt.kind, Flag):
            argv.append(opt.flag if value else "--no-" + opt.flag[2:])
        elif opt.kind.repeatable:
            for item in value:
                argv += [opt.flag, opt.kind.inner.format(item)]
        else:
            argv += [opt.flag, opt.kind.format(value)]
    return argv, env


def product_variables(options: Iterable[Option]) -> set[str]:
    return {e for o in options for e in o.env}


def environment_without(options: Iterable[Option]) -> dict[str, str]:
    """This process's environment less these options' variables: what `serve` gives a child,
    whose configuration then comes from serve's flags alone."""
    product = product_variables(options)
    return {k: v for k, v in os.environ.items() if k not in product}


def parse_with(parser: argparse.ArgumentParser, options: list[Option],
               argv: list[str] | None = None) -> tuple[argparse.Namespace, dict[str, Any]]:
    """For tools (the benchmarks) that take some of the product's options beside their own: the
    parsed flags, and those options' values (flag > TS_* variable > default); a bad value exits 2."""
    add_flags(parser, options, config_file=False)
    flags = parser.parse_args(argv)
    try:
        return flags, resolve(options, flags).values
    except ConfigError as exc:
        parser.exit(2, f"error: {exc}\n")
