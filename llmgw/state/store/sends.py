"""What the gateways sent where: one stream (`llmgw:sends`) every gateway worker appends its recent
sends to and reads the other gateways' from (gateway.server.sendshare), so that each gateway's prefix
index holds what the whole fleet of gateways sent each endpoint.

An entry is one flush of one worker: its origin (the gateway it belongs to: the gunicorn master, whose
workers already share their sends in memory, gateway.server.sentlog) and a JSON list of
[endpoint id, sent at (the sender's wall clock), prefill seconds it needed there, block keys as
little-endian int64s in base64]. The stream is trimmed by age as it is written (MINID), so it holds
the last `keep` seconds of sends whatever the traffic. An unreadable entry (a newer or broken writer)
is skipped, never fatal to the reader.
"""

from __future__ import annotations

import base64
import json
import struct
from typing import Sequence

from llmgw.state import keys
from llmgw.state.demand_records import GatewaySent
from llmgw.state.store.base import Aggregate, compact


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


def cursor_at(seconds: float) -> str:
    """The stream position of wall-clock time `seconds` (entry ids are milliseconds)."""
    return f"{max(0, int(seconds * 1000))}-0"


class Sends(Aggregate):
    def add_sends(self, origin: str, sends: Sequence[GatewaySent], now: float, keep: float) -> None:
        """Append one flush of `origin`'s sends, and drop entries older than `keep` seconds."""
        if not sends:
            return
        doc = [[s.endpoint, round(s.at, 4), round(s.prefill, 6), pack_keys(s.keys)] for s in sends]
        self.r.xadd(keys.SENDS, {"o": origin, "d": compact(doc)}, minid=cursor_at(now - keep), approximate=True)

    def sends_after(self, cursor: str, origin: str, count: int) -> tuple[str, int, list[GatewaySent]]:
        """Of the entries after `cursor` (at most `count`): the cursor to read on from, how many were
        read, and the sends in those that other origins wrote."""
        got = self.r.xread({keys.SENDS: cursor}, count=count)
        out: list[GatewaySent] = []
        n = 0
        for _, entries in got or ():
            n += len(entries)
            for entry_id, fields in entries:
                cursor = entry_id
                if fields.get("o") == origin:
                    continue
                try:
                    out.extend(decode_sends(json.loads(fields.get("d") or "[]")))
                except (ValueError, TypeError):
                    continue
        return cursor, n, out
