"""vLLM's KV cache events as they arrive on the wire: one ZMQ message decoded into plain events.

vLLM's ZmqEventPublisher (vllm/distributed/kv_events.py) sends per engine step that changed its
prefix cache three frames: the topic, an 8-byte big-endian sequence number, and a msgpack
`KVEventBatch` `[ts, events, data_parallel_rank]`. Its replay socket (ROUTER) answers an 8-byte start
sequence with every buffered `(sequence, payload)` from there on, then `(-1, b"")`.

Two layouts of one event have shipped: a map whose `type` key names it (vLLM since its event structs
dropped `array_like`), and earlier a list with the tag first, then every field in declaration order.
Both are read here; a field a newer vLLM adds is ignored, a batch that is neither is a `WireError`.
Block hashes are ints (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, the default) or bytes: both are kept as
they come, since they are only compared with each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

END_OF_REPLAY = -1

# The array layout's field order per tag (vllm/distributed/kv_events.py, before `array_like` went).
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


class WireError(ValueError):
    """A message that is not a KV event batch of a layout vLLM has sent."""


@dataclass(frozen=True)
class BlocksStored:
    """Full blocks just cached, in chain order: the first's parent (None: a chain's first block), the
    tokens of all of them, and what seeds a chain besides its tokens (the adapter, the cache salt)."""

    block_hashes: tuple[Hashable, ...]
    parent: Hashable | None
    token_ids: tuple[int, ...]
    block_size: int
    lora: str | None = None
    salt: str | None = None
    medium: str | None = None


@dataclass(frozen=True)
class BlocksRemoved:
    block_hashes: tuple[Hashable, ...]
    medium: str | None = None


@dataclass(frozen=True)
class AllCleared:
    pass


KvEvent = BlocksStored | BlocksRemoved | AllCleared


@dataclass(frozen=True)
class Batch:
    seq: int
    ts: float
    events: tuple[KvEvent, ...]
    rank: int = 0


def decode_message(frames: list[bytes]) -> Batch:
    """The three frames of one published message (topic, sequence, payload)."""
    if len(frames) != 3:
        raise WireError(f"a KV events message has 3 frames (topic, sequence, payload), got {len(frames)}")
    return decode_payload(_seq(frames[1]), frames[2])


def decode_replay(frames: list[bytes]) -> Batch | None:
    """One answer of the replay socket, as a DEALER receives it (`b""`, sequence, payload); None at
    the end of the replay."""
    if frames and frames[0] == b"":
        frames = frames[1:]
    if len(frames) != 2:
        raise WireError(f"a KV events replay answer has 2 frames (sequence, payload), got {len(frames)}")
    seq = _seq(frames[0], signed=True)
    return None if seq == END_OF_REPLAY else decode_payload(seq, frames[1])


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends the replay socket to get every buffered batch from `start_seq` on."""
    return [b"", start_seq.to_bytes(8, "big")]


def decode_payload(seq: int, payload: bytes) -> Batch:
    import msgpack

    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise WireError(f"batch {seq}: not msgpack ({e})") from None
    if not isinstance(raw, (list, tuple)) or len(raw) < 2 or not isinstance(raw[1], (list, tuple)):
        raise WireError(f"batch {seq}: not a [ts, events, rank] list")
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else 0
    events = tuple(e for e in (_event(seq, x) for x in raw[1]) if e is not None)
    return Batch(seq, float(raw[0] or 0.0), events, rank)


def _seq(frame: bytes, signed: bool = False) -> int:
    if len(frame) != 8:
        raise WireError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=signed)


def _fields(seq: int, raw: Any) -> tuple[str, dict]:
    if isinstance(raw, dict):
        return str(raw.get("type", "")), raw
    if isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        names = _ARRAY_FIELDS.get(raw[0], ())
        return raw[0], dict(zip(names, raw[1:]))
    raise WireError(f"batch {seq}: an event is neither a map nor a tagged list: {raw!r:.80}")


def _event(seq: int, raw: Any) -> KvEvent | None:
    tag, f = _fields(seq, raw)
    if tag == "BlockStored":
        extra = f.get("extra_keys") or []
        first = extra[0] if extra else None
        salt = next((str(k) for k in first if isinstance(k, str)), None) if isinstance(first, (list, tuple)) else None
        return BlocksStored(tuple(_h(h) for h in f.get("block_hashes") or ()), _h(f.get("parent_block_hash")),
                            tuple(f.get("token_ids") or ()), int(f.get("block_size") or 0),
                            f.get("lora_name"), salt, f.get("medium"))
    if tag == "BlockRemoved":
        return BlocksRemoved(tuple(_h(h) for h in f.get("block_hashes") or ()), f.get("medium"))
    if tag == "AllBlocksCleared":
        return AllCleared()
    return None  # an event type a newer vLLM sends: not one the index needs


def _h(h: Any) -> Hashable | None:
    return tuple(h) if isinstance(h, list) else h
