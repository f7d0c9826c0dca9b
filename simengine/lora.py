"""LoRA adapters in the simulated engine, as vLLM serves them (`--enable-lora`).

With `VLLM_ALLOW_RUNTIME_LORA_UPDATING` set (as for vLLM), `POST /v1/load_lora_adapter {"lora_name",
"lora_path"}` and `POST /v1/unload_lora_adapter {"lora_name"}` answer with vLLM's bodies: 200 and a
text line on success, a JSON error otherwise ("has already been loaded" 400, "No adapter found for"
404 when the path does not exist, a rank above `--max-lora-rank` 400 when the path's
`adapter_config.json` says `r`, "cannot be found" 404 on unloading an unknown name). A load takes
`--lora-load-time` seconds. A loaded adapter is served under its name and listed by /v1/models with
`parent`; the batching core keeps at most `--max-loras` distinct adapters in a batch (as vLLM's
scheduler: a request for another adapter waits), and /metrics says so in `vllm:lora_requests_info`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"


@dataclass(frozen=True)
class LoraOptions:
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters registered at most (vLLM's CPU cache); default max_loras
    load_time: float = 0.0  # seconds one load takes
    runtime: bool = False  # the load and unload endpoints exist (RUNTIME_ENV is true)

    @property
    def capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras


def runtime_allowed(environ) -> bool:
    """vLLM reads the variable as a boolean: "1" or "true" (any case)."""
    return str(environ.get(RUNTIME_ENV, "")).strip().lower() in ("1", "true")


@dataclass(frozen=True)
class Reply:
    """An answer of the load and unload endpoints: status, body, and its content type."""

    status: int
    body: bytes
    ctype: str = "application/json"


def _error(status: int, message: str, kind: str) -> Reply:
    return Reply(status, json.dumps({"error": {"message": message, "type": kind, "param": None,
                                               "code": status}}).encode())


def _rank(path: str) -> int | None:
    """The rank an adapter directory's adapter_config.json gives (`r`), if it says."""
    try:
        with open(os.path.join(path, "adapter_config.json")) as f:
            r = json.load(f).get("r")
        return r if isinstance(r, int) and not isinstance(r, bool) else None
    except (OSError, ValueError, AttributeError):
        return None


class Adapters:
    """The adapters a running sim holds, by name (in load order), and their paths."""

    def __init__(self, opts: LoraOptions, sleep=time.sleep):
        self.opts, self.sleep = opts, sleep
        self._lock = threading.Lock()
        self._paths: dict[str, str] = {}

    def names(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._paths)

    def cards(self, parent: str, created: int) -> list[dict]:
        """/v1/models cards of the loaded adapters, as vLLM lists them after its base models."""
        with self._lock:
            return [{"id": n, "object": "model", "created": created, "owned_by": "vllm", "root": p, "parent": parent}
                    for n, p in self._paths.items()]

    def load(self, body: dict) -> Reply:
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return _error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        with self._lock:
            if name in self._paths:
                return _error(400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput")
        if not os.path.exists(path):
            return _error(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
        rank = _rank(path)
        if rank is not None and rank > self.opts.max_lora_rank:
            return _error(400, f"LoRA rank {rank} is greater than max_lora_rank {self.opts.max_lora_rank}.",
                          "BadRequestError")
        if self.opts.load_time:
            self.sleep(self.opts.load_time)
        with self._lock:
            if name in self._paths:
                return _error(400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput")
            if len(self._paths) >= self.opts.capacity:
                return _error(400, f"cannot load lora {name}: {len(self._paths)} adapters are loaded, the most "
                                   f"this engine holds (--max-cpu-loras {self.opts.capacity})", "InvalidUserInput")
            self._paths[name] = path
        return Reply(200, f"Success: LoRA adapter '{name}' added successfully.".encode(), "text/plain; charset=utf-8")

    def unload(self, body: dict) -> Reply:
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            return _error(400, "'lora_name' must be provided.", "InvalidUserInput")
        with self._lock:
            if self._paths.pop(name, None) is None:
                return _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        return Reply(200, f"Success: LoRA adapter '{name}' removed successfully.".encode(), "text/plain; charset=utf-8")


class LoraInfo:
    """`vllm:lora_requests_info`: every label set it ever had stays a series, valued at the time it
    was last current (vLLM's gauge `set_to_current_time`), the newest being the current one."""

    KEEP = 64  # label sets kept (vLLM keeps all; a long-running sim need not)

    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self._seen: dict[tuple[str, str], float] = {}

    def observe(self, running: tuple[str, ...], waiting: tuple[str, ...], now: float) -> list[tuple[dict, float]]:
        """The series after an update at wall time `now`: (labels, value) each."""
        key = (",".join(running), ",".join(waiting))
        self._seen.pop(key, None)
        self._seen[key] = now
        while len(self._seen) > self.KEEP:
            self._seen.pop(next(iter(self._seen)))
        return [({"max_lora": str(self.max_loras), "running_lora_adapters": r, "waiting_lora_adapters": w}, t)
                for (r, w), t in self._seen.items()]
