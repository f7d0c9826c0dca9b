"""Settings read once from the environment: one typed class per process role.

- `Settings`: what every part shares (Redis, the state dir, this machine's node name); the CLI's.
- `ControlSettings`: the control worker and beat (the schedule, the catalog file).
- `workers.agent.config.AgentSettings`: the node agent (`LLMGW_NODE_*`, ports, heartbeats, `LLMGW_AGENT_*`).
- `gateway.config.GatewaySettings` (with its `RoutingConfig`) and `gateway.config.GunicornSettings`.

Each field is declared with `env(VARIABLE, default=..., meaning=...)`; the knob tables of README.md and
docs/ are checked against these declarations (tests/unit/test_settings.py). `X.from_env()` reads the
process environment (or a mapping handed to it) once, at start-up; a bad value raises
`ConfigError(variable, reason)` naming every bad variable. Constructing a class directly
(`Settings(node_name="a")`) validates what it is given and reads no environment at all.
"""

from __future__ import annotations

import os
import socket
import typing
from pathlib import Path
from typing import Annotated, Any, ClassVar, Mapping

from pydantic import AfterValidator, AliasChoices, BeforeValidator, Field, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, SettingsConfigDict

from llmgw.errors import ConfigError
from llmgw.redisurl import Durability, check as check_redis_url


class Says:
    """Field metadata naming what a value is, for messages: `expected seconds, got 'soon'`."""

    def __init__(self, what: str):
        self.what = what


# Durations are floats in seconds; each field adds its own bounds (gt=0: positive, ge=0: 0 allowed).
Seconds = Annotated[float, Says("seconds")]


def parse_port_range(value: str) -> tuple[int, int]:
    """`21000-21999` -> (21000, 21999); ValueError saying what is wrong."""
    lo, sep, hi = value.partition("-")
    try:
        start, end = int(lo), int(hi)
    except ValueError:
        raise ValueError(f"expected START-END, got {value!r}") from None
    if not sep or not (0 < start <= end < 65536):
        raise ValueError(f"expected START-END within 1..65535, got {value!r}")
    return start, end


def _port_range(value: object) -> object:
    return parse_port_range(value) if isinstance(value, str) else value


# A range of TCP ports, `START-END` in the environment.
PortRange = Annotated[tuple[int, int], NoDecode, BeforeValidator(_port_range)]


def env(*names: str, default: Any = None, default_factory: Any = None, meaning: str,
        empty_is_value: bool = False, **bounds: Any) -> Any:
    """A field read from the variable `names[0]`; further names are accepted too (`REDIS_URL`). An
    empty variable counts as unset unless `empty_is_value` (`LLMGW_NODE_GPUS=""`: no GPUs)."""
    kw: dict[str, Any] = dict(
        validation_alias=AliasChoices(*names) if len(names) > 1 else names[0],
        description=meaning,
        json_schema_extra={"variables": list(names), "empty_is_value": empty_is_value},
        **bounds,
    )
    if default_factory is not None:
        return Field(default_factory=default_factory, **kw)
    return Field(default, **kw)


def variables(field: FieldInfo) -> list[str]:
    """The variables a field is read from, the first being its name in docs and messages."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    return list(extra.get("variables") or [])


class _Environment(EnvSettingsSource):
    """The environment (or a given mapping) as pydantic-settings reads it: exact names, empty = unset."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]):
        self._environ = environ
        super().__init__(settings_cls, case_sensitive=True)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        keep = {name for f in self.settings_cls.model_fields.values() if _empty_is_value(f)
                for name in variables(f)}
        return {k: v for k, v in self._environ.items() if v != "" or k in keep}


def _empty_is_value(field: FieldInfo) -> bool:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    return bool(extra.get("empty_is_value"))


def _nested(field: FieldInfo) -> type[EnvSettings] | None:
    """The settings class of a field that is itself a group of settings (the gateway's routing)."""
    kind = field.annotation
    return kind if isinstance(kind, type) and issubclass(kind, EnvSettings) else None


class EnvSettings(BaseSettings):
    """The base of every settings class: frozen, typed, read by `from_env` only."""

    model_config = SettingsConfigDict(frozen=True, extra="ignore", populate_by_name=True)
    # The page whose knob table lists this class's variables (checked by tests/unit/test_settings.py).
    docs: ClassVar[str] = ""

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        # Direct construction takes only what it is given; `from_env` is the one reader of the environment.
        return (init_settings,)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None):
        environ = os.environ if environ is None else environ
        values = _Environment(cls, environ)()
        for name, field in cls.model_fields.items():
            group = _nested(field)
            if group is not None:
                values[name] = group.from_env(environ)
        try:
            return cls(**values)
        except ValidationError as e:
            raise _config_error(cls, e) from None


def _config_error(cls: type[EnvSettings], e: ValidationError) -> ConfigError:
    """One ConfigError naming the first bad variable, its reason, and any further ones."""
    by_variable = {v: f for f in cls.model_fields.values() for v in variables(f)}
    found = []
    for err in e.errors(include_url=False):
        variable = str(err["loc"][0]) if err["loc"] else "environment"
        field = by_variable.get(variable) or cls.model_fields.get(variable)
        if field is not None and variables(field):
            variable = variables(field)[0]
        found.append((variable, _reason(err, field)))
    (variable, reason), rest = found[0], found[1:]
    return ConfigError(variable, reason + "".join(f"; {v}: {r}" for v, r in rest))


def _reason(err: dict, field: FieldInfo | None) -> str:
    """One line a person can act on, from one pydantic error."""
    t, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    says = next((m.what for m in (field.metadata if field else ()) if isinstance(m, Says)), "a number")
    if t in ("float_parsing", "float_type", "finite_number"):
        return f"expected {says}, got {value!r}"
    if t in ("int_parsing", "int_type", "int_from_float"):
        return f"expected an integer, got {value!r}"
    if t in ("bool_parsing", "bool_type"):
        return f"expected 1 or 0, got {value!r}"
    if t == "greater_than":
        return "must be positive" if ctx.get("gt") == 0 else f"must be greater than {ctx.get('gt')}, got {value}"
    if t == "greater_than_equal":
        return "must not be negative" if ctx.get("ge") == 0 else f"must be at least {ctx.get('ge')}, got {value}"
    if t == "less_than_equal":
        return f"must be at most {ctx.get('le')}, got {value}"
    if t == "literal_error" and field is not None:
        return f"expected one of {', '.join(map(str, typing.get_args(field.annotation)))}, got {value!r}"
    if t == "value_error":
        return str(ctx.get("error", err["msg"]))
    return str(err["msg"]).rstrip(".")


def _absolute(path: Path) -> Path:
    # Absolute from the start: engines run with their replica dir as working directory, so a relative
    # path would point somewhere else for them (and for the shim).
    return path.absolute()


class Settings(EnvSettings):
    """What every part shares: the CLI reads only these."""

    docs: ClassVar[str] = "README.md"

    redis_url: Annotated[str, AfterValidator(check_redis_url)] = env(
        "LLMGW_REDIS_URL", "REDIS_URL", default="redis://127.0.0.1:6379/0",
        meaning="the Redis every part shares (`llmgw up` starts its own unless set; other `llmgw` commands "
                "then find that one through its state dir); a master behind Sentinel is "
                "`redis+sentinel://[:password@]host:port[,host:port...]/MASTER[/DB]` ([store](docs/store.md))")
    redis_wait_replicas: int | None = env(
        "LLMGW_REDIS_WAIT_REPLICAS", default=None, ge=0,
        meaning="replicas that must hold a catalog apply, an API key's creation, change or revocation, a "
                "cordon/drain or a credential rotation before it returns (Redis `WAIT`); unset: 1 with a "
                "Sentinel URL, 0 otherwise ([store](docs/store.md))")
    redis_wait_timeout: Seconds = env("LLMGW_REDIS_WAIT_TIMEOUT", default=2.0, gt=0,
                                      meaning="seconds such a write waits for its replicas before it is "
                                              "reported as not yet safe from a failover (it stands on the master)")
    state_dir: Annotated[Path, AfterValidator(_absolute)] = env(
        "LLMGW_STATE_DIR", default=Path(".llmgw"), validate_default=True,
        meaning="logs, engine state, Redis data of `llmgw up`")
    node_name: str = env("LLMGW_NODE", default_factory=socket.gethostname,
                         meaning="this machine's node name; its agent consumes `node-<name>`")
    up_port_range: PortRange = env(
        "LLMGW_UP_PORT_RANGE", default=(22000, 29999),
        meaning="where `llmgw up` takes its ports, `START-END`: a free block of 100 (its Redis on the first, "
                "its engines on the rest unless `LLMGW_PORT_RANGE` is set); keep it outside the kernel's "
                "ephemeral range (`net.ipv4.ip_local_port_range`), whose ports outgoing connections take")
    event_driven: bool = env("LLMGW_EVENT_DRIVEN", default=True,
                             meaning="facts (a catalog apply, a replica turning Ready or exiting, a stop) "
                                     "kick the control passes at once ([lifecycle](docs/lifecycle.md)); "
                                     "0 leaves only beat's timers")


    @property
    def durability(self) -> Durability:
        """What a write that must not be lost waits for (`Store(r, durability)`)."""
        return Durability.of(self.redis_url, self.redis_wait_replicas, self.redis_wait_timeout)


class ControlSettings(Settings):
    """The control worker and beat: the Celery app (`celery -A workers`) carries these."""

    docs: ClassVar[str] = "docs/control-plane.md"

    reconcile_interval: Seconds = env("LLMGW_RECONCILE_INTERVAL", default=5.0, gt=0,
                                      meaning="beat schedule of `llmgw.reconcile`, the backstop: facts kick it at once")
    publish_interval: Seconds = env("LLMGW_PUBLISH_INTERVAL", default=1.0, gt=0,
                                    meaning="beat schedule of `llmgw.publish`")
    catalog_file: Path | None = env("LLMGW_CATALOG", default=None,
                                    meaning="a catalog file synced at the start of every reconcile pass")
    external_interval: Seconds = env("LLMGW_EXTERNAL_INTERVAL", default=1.0, gt=0,
                                     meaning="beat schedule of `llmgw.external`: scrapes the /metrics of external "
                                             "servers that have a mapping, and checks the urls that are due")
    external_check_interval: Seconds = env("LLMGW_EXTERNAL_CHECK_INTERVAL", default=5.0, gt=0,
                                           meaning="seconds between health checks of one external url")
    external_timeout: Seconds = env("LLMGW_EXTERNAL_TIMEOUT", default=2.0, gt=0,
                                    meaning="seconds a health check or scrape of an external url may take")
    external_failures: int = env("LLMGW_EXTERNAL_FAILURES", default=3, ge=1,
                                 meaning="failed health checks in a row that make a url that answered before "
                                         "Unreachable (it leaves routing)")
