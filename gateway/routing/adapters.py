"""LoRA adapters on the request path: which endpoints hold each adapter, built with the routing tables
(`adapter_table`, pure, called by `tables_from`) and read by the router.

A request naming an adapter (or an alias) goes only to the endpoints that hold it loaded: the router
chooses among them as among any model's endpoints (least loaded first). When none holds it, it may
wait for one to load it (gateway.routing.admission: an adapter load): when an endpoint of a profile
that serves it is published, or its model can start from zero; then the control plane is told at
once (a demand hint). Otherwise it is refused with the reason (`no_holder`). A request whose every holder failed it (the only holder was
killed, and is still listed) waits the same way; meanwhile an endpoint it failed on is tried again
once it has left the list and come back (`Lift`: the holder restarted), so it is served by whichever
comes first, a load elsewhere or the holder's return.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping, Sequence

from llmgw.state.records import EndpointInfo

NO_ADAPTER = "no_adapter"  # the Rejection kind: no endpoint holds the adapter now


@dataclass(frozen=True)
class AdapterRoute:
    """One adapter as the router reads it: its names, its model, the scale a llama.cpp endpoint
    applies it at, the endpoints holding it (in list order), how many published endpoints serve it
    (could load it), whether it is loaded only on demand (`replicas: 0`), and how long a request
    waits for a load."""

    name: str
    model: str
    names: tuple[str, ...]
    scale: float = 1.0
    holders: tuple[EndpointInfo, ...] = ()
    servers: int = 0
    on_demand: bool = False
    wait: float = 60.0
    can_cold_start: bool = False  # its model scales to zero: a replica starts first

    @property
    def loadable(self) -> bool:
        """Whether waiting can end in a holder: some replica serves it, or one starts."""
        return self.servers > 0 or self.can_cold_start


def adapter_table(adapters: Mapping[str, Mapping], endpoints: Sequence[EndpointInfo],
                  cold_start: Mapping[str, float]) -> dict[str, AdapterRoute]:
    """Name or alias -> its AdapterRoute, from the catalog outline's adapters and the endpoint list."""
    holders: dict[str, list[EndpointInfo]] = {}
    serving: dict[tuple[str, str], int] = {}
    for e in endpoints:
        for a in e.adapters:
            holders.setdefault(a, []).append(e)
        serving[(e.model, e.profile)] = serving.get((e.model, e.profile), 0) + 1
    out: dict[str, AdapterRoute] = {}
    for name, entry in adapters.items():
        model = str(entry.get("model") or "")
        own = [e for e in holders.get(name, ()) if e.model == model]
        route = AdapterRoute(
            name=name, model=model, names=tuple(entry.get("names") or (name,)), scale=float(entry.get("scale", 1.0)),
            holders=tuple(own), servers=sum(serving.get((model, p), 0) for p in entry.get("profiles") or ()),
            on_demand=entry.get("replicas") == 0, wait=float(entry.get("wait") or 60.0),
            can_cold_start=model in cold_start)
        for n in route.names:
            out[n] = route
    return out


def unique(table: Mapping[str, AdapterRoute]) -> list[AdapterRoute]:
    """Each adapter once (the table has one entry per name and alias), by name."""
    return sorted({r.name: r for r in table.values()}.values(), key=lambda r: r.name)


def no_holder(route: AdapterRoute) -> str:
    """Why a request for the adapter cannot be served now, for its 503."""
    if not route.loadable:
        return (f"no replica of model {route.model!r} that serves adapter {route.name!r} is Ready, so none can "
                "load it")
    return f"no replica holds adapter {route.name!r} loaded yet"


def lifted(exclude: frozenset[str], listed: Collection[str] | Mapping[str, EndpointInfo], gone: frozenset[str],
           urls: Mapping[str, str] | None = None) -> tuple[frozenset[str], frozenset[str]]:
    """The endpoints a waiting request still excludes, and those seen gone: an endpoint it failed on
    is excluded while it stays in the list at the address it failed at (`urls`, when known); once it
    left (its replica stopped or restarted) or moved to another address, it is another engine.
    Returns (exclude now, gone now)."""
    moved = (frozenset(i for i in exclude if i in listed and i in urls and listed[i].url != urls[i])
             if urls and isinstance(listed, Mapping) else frozenset())
    gone = gone | moved | frozenset(i for i in exclude if i not in listed)
    return exclude - gone, gone


class Lift:
    """`lifted` over a wait: call it with the endpoints listed now, get the exclusions that hold.
    Made with the endpoints listed when the request failed on them, it also sees an engine that
    restarted at another address between two looks."""

    __slots__ = ("exclude", "gone", "urls")

    def __init__(self, exclude: frozenset[str], listed: Mapping[str, EndpointInfo] | None = None,
                 failed_at: Mapping[str, str] | None = None):
        # `failed_at`: the address each endpoint failed at, where the caller knows it. The list of
        # now may already show the engine back at its new address (it restarted before the wait).
        self.exclude, self.gone = exclude, frozenset()
        urls = {i: listed[i].url for i in exclude if i in listed} if listed else {}
        urls.update({i: u for i, u in (failed_at or {}).items() if i in exclude})
        self.urls = urls or None

    def __call__(self, listed: Collection[str] | Mapping[str, EndpointInfo]) -> frozenset[str]:
        now, self.gone = lifted(self.exclude, listed, self.gone, self.urls)
        return now
