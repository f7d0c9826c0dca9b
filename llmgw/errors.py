"""The small error vocabulary every part of llmgw raises.

Each class carries its fields; the gateway maps them to OpenAI-style bodies in one table
(gateway/errors.py) and the CLI prints `str(err)` and exits non-zero. No traceback ever reaches a user.
"""

from __future__ import annotations

from dataclasses import dataclass


class LlmgwError(Exception):
    """Base class: everything llmgw raises on purpose."""


class ConfigError(LlmgwError):
    def __init__(self, variable: str, reason: str):
        self.variable, self.reason = variable, reason
        super().__init__(f"{variable}: {reason}")


@dataclass(frozen=True)
class Problem:
    """One problem in a document: where (a field path such as `models[2].profiles[0].gpu`) and why."""

    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}" if self.path else self.reason


class CatalogInvalid(LlmgwError):
    """A catalog failed validation; `problems` lists every problem found, not only the first."""

    def __init__(self, source: str, problems: list[Problem]):
        self.source, self.problems = source, list(problems)
        super().__init__("\n".join(f"{source}: {p}" for p in self.problems))


class CatalogConflict(LlmgwError):
    """Compare-and-set failed: someone applied another catalog version in between."""

    def __init__(self, expected: int, actual: int):
        self.expected, self.actual = expected, actual
        super().__init__(
            f"catalog changed while applying: expected version {expected}, found {actual}; "
            "re-run the command to diff against the new version"
        )


class EngineRefused(LlmgwError):
    """An engine driver refuses a profile (e.g. llama.cpp with tensor parallelism)."""

    def __init__(self, engine: str, field: str, reason: str):
        self.engine, self.field, self.reason = engine, field, reason
        super().__init__(f"{engine}: {field}: {reason}")


class RedisUnreachable(LlmgwError):
    """Redis did not answer: one line naming the URL and the variables that set it."""

    exit_code = 1

    def __init__(self, url: str, err: Exception, exit_code: int | None = None):
        self.url = url
        if exit_code is not None:
            self.exit_code = exit_code
        super().__init__(f"cannot reach Redis at {url}: {err} (set REDIS_URL or LLMGW_REDIS_URL)")


class NotReplicated(LlmgwError):
    """A write that must not be lost is on the master, but fewer replicas than asked acknowledged it
    within the timeout (`llmgw.redisurl.Durability`): a failover now could lose it. `value` is what the
    write returned; the write itself stands."""

    exit_code = 0  # what was asked is done; the CLI says it is not yet safe against a failover

    def __init__(self, what: str, acked: int, wanted: int, timeout: float, value=None):
        self.what, self.acked, self.wanted, self.timeout, self.value = what, acked, wanted, timeout, value
        super().__init__(
            f"{what} is on the Redis master, but {acked} of {wanted} replica(s) acknowledged it within "
            f"{timeout:g} s: a failover before a replica has it would lose it (LLMGW_REDIS_WAIT_REPLICAS, "
            "LLMGW_REDIS_WAIT_TIMEOUT; docs/store.md)")


class NotFound(LlmgwError):
    def __init__(self, kind: str, name: str):
        self.kind, self.name = kind, name
        super().__init__(f"no {kind} named {name!r}")


class NoFreePorts(LlmgwError):
    """No `size` consecutive free ports in the range a variable sets (`LLMGW_UP_PORT_RANGE` for `llmgw
    up`, `LLMGW_PORT_RANGE` for a node's engines): one line saying what to set."""

    def __init__(self, variable: str, port_range: tuple[int, int], size: int = 1,
                 ephemeral: tuple[int, int] | None = None):
        self.variable, self.port_range, self.size, self.ephemeral = variable, port_range, size, ephemeral
        lo, hi = port_range
        what = "free port" if size == 1 else f"block of {size} free consecutive ports"
        outside = (f"outside the kernel's ephemeral range {ephemeral[0]}-{ephemeral[1]} "
                   "(net.ipv4.ip_local_port_range)" if ephemeral else
                   "outside the kernel's ephemeral range (net.ipv4.ip_local_port_range)")
        super().__init__(f"no {what} in {variable} {lo}-{hi} (each is held, or refuses a bind); "
                         f"set {variable}=START-END to a range with free ports, {outside}")
