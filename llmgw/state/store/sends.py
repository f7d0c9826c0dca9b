"""What the gateways sent where (gateway.server.sendshare), so that each gateway's prefix index holds
what the whole fleet of gateways sent each endpoint.

Each origin (a gateway: the gunicorn master, whose workers already share their sends in memory,
gateway.server.sentlog) has its own stream, `llmgw:sends:<origin>`, and says it shares in the hash
`llmgw:sends:origins`; a gateway reads only the other origins' streams, so a lone gateway reads
nothing. An entry is one flush of one worker: `d`, a JSON list of [endpoint id, sent at (the sender's
wall clock), prefill seconds it needed there, block keys as little-endian int64s in base64], and/or
`h`, what the whole gateway held per endpoint then, {"at": wall clock, "n": {endpoint id: requests}}
(gateway.routing.othergateways: the others count it as their sibling workers'). A stream
is trimmed by age as it is written (MINID), so it holds the last `keep` seconds of sends whatever the
traffic, and expires with its gateway. An unreadable entry (a newer or broken writer) is skipped,
never fatal to the reader.
"""

from __future__ import annotations

import base64
import json
import struct
from typing import Mapping, NamedTuple, Sequence

from llmgw.state import keys
from llmgw.state.demand_records import GatewayHolds, GatewaySent
from llmgw.state.store.base import Aggregate, compact, ms


class SendsRead(NamedTuple):
    """One read of the other gateways' streams (`Sends.sends_after`)."""

    cursors: dict[str, str]  # origin -> the entry to read on from
    read: int  # how many entries were read
    sends: list[GatewaySent]  # the sends in them, in order
    holds: list[GatewayHolds]  # what their gateways said they held, in order


def pack_keys(block_keys: Sequence[int]) -> str:
    return base64.b64encode(struct.pack(f"<{len(block_keys)}q", *block_keys)).decode("ascii")


def unpack_keys(text: str) -> list[int]:
    raw = base64.b64decode(text, validate=True)
    if len(raw) % 8:
        raise ValueError("block keys are 8 bytes each")
    return list(struct.unpack(f"<{len(raw) // 8}q", raw))


def decode_sends(doc: object) -> list[GatewaySent]:
    """The sends of one entry's `d` (already parsed); raises ValueError or TypeError when unreadable."""
    if not isinstance(doc, list):
        raise ValueError("sends must be a list")
    out = []
    for ep, at, prefill, packed in doc:
        if not isinstance(ep, str):
            raise ValueError("endpoint must be a string")
        out.append(GatewaySent(ep, unpack_keys(packed), float(at), max(0.0, float(prefill))))
    return out


def decode_holds(origin: str, doc: object) -> GatewayHolds:
    """One entry's `h` (already parsed); raises ValueError or TypeError when unreadable."""
    if not isinstance(doc, dict) or not isinstance(doc.get("n"), dict):
        raise ValueError("holds must be an object with counts")
    counts = {}
    for ep, n in doc["n"].items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError("a count must be a whole number")
        counts[ep] = n
    return GatewayHolds(origin, float(doc["at"]), counts)


def cursor_at(seconds: float) -> str:
    """The stream position of wall-clock time `seconds` (entry ids are milliseconds)."""
    return f"{max(0, int(seconds * 1000))}-0"


class Sends(Aggregate):
    def add_sends(self, origin: str, sends: Sequence[GatewaySent], now: float, keep: float,
                  announce: bool = True, holds: Mapping[str, int] | None = None) -> None:
        """Append one flush of `origin`'s sends, and what it holds per endpoint now (`holds`, when it
        says it), to its stream and drop its entries older than `keep` seconds. With `announce` (a
        writer does it about once a second, not on every flush), also say that `origin` shares, and
        let its stream expire `keep` seconds after that."""
        if not sends and holds is None:
            return
        entry = {}
        if sends:
            entry["d"] = compact([[s.endpoint, round(s.at, 4), round(s.prefill, 6), pack_keys(s.keys)] for s in sends])
        if holds is not None:
            entry["h"] = compact({"at": round(now, 4), "n": dict(holds)})
        stream = keys.sends(origin)
        pipe = self.r.pipeline(transaction=False)
        pipe.xadd(stream, entry, minid=cursor_at(now - keep), approximate=True)
        if announce:
            pipe.pexpire(stream, ms(keep))
            pipe.hset(keys.SENDS_ORIGINS, origin, repr(now))
        pipe.execute()

    def announce_sends(self, origin: str, now: float) -> None:
        """Say that `origin` shares, without an entry: a gateway alone writes no sends (nobody would
        read them) but must be seen by a gateway that starts, which then makes it publish."""
        self.r.hset(keys.SENDS_ORIGINS, origin, repr(now))

    def sending_origins(self, now: float, keep: float) -> list[str]:
        """The origins that wrote sends in the last `keep` seconds; older ones are tidied here."""
        got = self.r.hgetall(keys.SENDS_ORIGINS)
        live, gone = [], []
        for origin, at in got.items():
            try:
                (live if float(at) >= now - keep else gone).append(origin)
            except ValueError:
                gone.append(origin)
        if gone:
            self.r.hdel(keys.SENDS_ORIGINS, *gone)
        return sorted(live)

    def sends_after(self, cursors: Mapping[str, str], count: int, block: float | None = None
                    ) -> SendsRead:
        """Of the entries after each origin's cursor (at most `count` per origin; with `block`, waiting
        up to that many seconds for one when there is none): the cursors to read on from, how many
        entries were read, the sends in them and what their gateways said they held, in order."""
        if not cursors:
            return SendsRead({}, 0, [], [])
        streams = {keys.sends(o): c for o, c in cursors.items()}
        origin_of = {keys.sends(o): o for o in cursors}
        got = self.r.xread(streams, count=count, block=None if block is None else ms(block))
        out: list[GatewaySent] = []
        holds: list[GatewayHolds] = []
        moved = dict(cursors)
        n = 0
        for stream, entries in got or ():
            n += len(entries)
            for entry_id, fields in entries:
                moved[origin_of[stream]] = entry_id
                try:  # each part on its own: one unreadable part does not cost the other
                    out.extend(decode_sends(json.loads(fields.get("d") or "[]")))
                except (ValueError, TypeError):
                    pass
                if "h" in fields:
                    try:
                        holds.append(decode_holds(origin_of[stream], json.loads(fields["h"])))
                    except (ValueError, TypeError, KeyError):
                        pass
        return SendsRead(moved, n, out, holds)
