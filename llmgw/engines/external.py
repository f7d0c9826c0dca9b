"""Engine driver for engine `external`: a server llmgw does not run (an existing vLLM deployment, a llama.cpp
box, a hosted OpenAI-compatible API as an overflow tier).

Nothing is launched: the control plane health-checks each `url` and publishes it as an endpoint while
it answers (workers/control/external.py), and the gateway sends it the key named by `api_key_env`.
This driver states what such a profile may say (the catalog asks it, field by field and as a whole):
`url` (one or a list, http or https, the server's root), `served_name`, `api_key_env` (the NAME of a
variable in the gateway's environment, never a key), `server` (what kind of server it is), `capacity`,
`priority`, `weight` and `metrics`; everything that starts, places or supervises a process is refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from urllib.parse import urlsplit

from llmgw.catalog.types import EXTERNAL_FIELDS, MetricMapping, Profile
from llmgw import surface as op
from llmgw.engines.base import EngineDriver, EngineUnavailable, LaunchContext, LaunchSpec
from llmgw.errors import Problem

# Routing hints stay: a server llmgw does not run is still routed to, its prefix cache included.
ALLOWED_FIELDS = frozenset({"name", "engine", "priority", "weight", "capacity", "metrics", "kv_cache_tokens",
                            *EXTERNAL_FIELDS})
_WHY_NOT = {
    "replicas": "llmgw runs no replicas of it; list one `url` per server instead",
    "gpu": "llmgw places nothing for it on a GPU",
    "tensor_parallel": "its own deployment decides its parallelism",
    "pipeline_parallel": "its own deployment decides its parallelism",
    "nodes": "its own deployment decides where it runs",
    "args": "llmgw does not start it",
    "env": "llmgw does not start it",
    "source": "its own deployment decides what it loads",
    "pool": "llmgw places nothing for it on a node",
    "node_selector": "llmgw places nothing for it on a node",
    "start_timeout": "llmgw does not start it (it is published while its health checks pass)",
    "drain_timeout": "llmgw does not stop it (it leaves routing when its health checks fail)",
}
# What a generic OpenAI-compatible API (`server: openai`, the default) is assumed to serve: the OpenAI
# API's own operations. The other kinds serve what the engine of that name does.
OPENAI_PATHS = op.same_paths(op.CHAT, op.COMPLETIONS, op.EMBEDDINGS, op.RESPONSES, op.RESPONSES_GET,
                             op.RESPONSES_DELETE, op.RESPONSES_CANCEL, op.TRANSCRIPTIONS)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def url_problem(url: str) -> str | None:
    """Why `url` cannot name an external server, or None. Never quotes the url: it may hold a key."""
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError:
        return "is not a url (expected http://host[:port] or https://host[:port])"
    if u.scheme not in ("http", "https"):
        return "must start with http:// or https://"
    if not u.hostname:
        return "names no host"
    if u.username is not None or u.password is not None:
        return ("holds credentials; the catalog is stored in Redis and shown by the CLI: put the key in an "
                "environment variable of the gateway and name it in `api_key_env`")
    if u.query or u.fragment:
        return "names the server: no query string or fragment (a key belongs in `api_key_env`)"
    if u.path.rstrip("/").endswith("/v1"):
        return "is the server's root, without the trailing /v1 (the gateway adds /v1/chat/completions and the rest)"
    if port == 0:
        return "has port 0"
    return None


class ExternalDriver(EngineDriver):
    name = "external"
    needs_gpu = False
    supports_tensor_parallel = False
    supports_multi_node = False
    default_metrics = MetricMapping()  # a generic server's series have no known names

    def __init__(self, kinds: Mapping[str, EngineDriver]):
        # `server: vllm|llamacpp|sim` borrows that engine's paths, health path and metric names.
        self._kinds = dict(kinds)

    def kind(self, profile: Profile) -> EngineDriver | None:
        """The engine driver whose server this is, or None for a generic OpenAI-compatible API."""
        return self._kinds.get(profile.server or "openai")

    def field_refusal(self, field: str) -> str | None:
        if field in ALLOWED_FIELDS:
            return None
        why = _WHY_NOT.get(field, "llmgw does not start, place or supervise this server")
        return f"'{field}' does not apply to engine: external: {why}"

    def refusals(self, profile: Profile) -> list[Problem]:
        problems: list[Problem] = []
        urls = profile.urls
        if not urls:
            problems.append(Problem("url", "engine: external needs a url: where the server is (http:// or https://)"))
        seen: dict[str, int] = {}
        for i, url in enumerate(urls):
            where = "url" if isinstance(profile.url, str) else f"url[{i}]"
            why = url_problem(url)
            key = url.rstrip("/")
            if why:
                problems.append(Problem(where, why))
            elif key in seen:
                problems.append(Problem(where, f"the same server as url[{seen[key]}]"))
            else:
                seen[key] = i
        env = profile.api_key_env
        if env is not None and not _ENV_NAME.match(env):
            # The value is not repeated: it may be the key itself, written where its name belongs.
            problems.append(Problem("api_key_env", "must be the NAME of an environment variable of the gateway "
                                                   "([A-Za-z_][A-Za-z0-9_]*) that holds the key, never the key itself"))
        if profile.metrics is not None and self.kind(profile) is None and not profile.metrics.running:
            problems.append(Problem("metrics", "a generic OpenAI-compatible server (`server: openai`) has no default "
                                               "metric names: name at least its `running` series, or set `server`"))
        return problems

    def source_problems(self, source: str, path: str, profile: str = "") -> list[Problem]:
        return []  # nothing is loaded: the model's source is for the engines llmgw runs

    def paths(self, profile: Profile) -> dict[str, str]:
        kind = self.kind(profile)
        return dict(OPENAI_PATHS) if kind is None else kind.paths(profile)

    def health_path(self, profile: Profile) -> str:
        """What the control plane checks: the engine's own health path, else GET /v1/models."""
        return "/v1/models" if self.kind(profile) is None else "/health"

    def metrics_engine(self, profile: Profile) -> EngineDriver:
        """The engine driver whose metric names and fallbacks read this server's /metrics."""
        return self.kind(profile) or self

    def command(self, ctx: LaunchContext) -> LaunchSpec:
        raise EngineUnavailable(self.name, "engine", "llmgw does not start external servers")
