"""vLLM's KV cache events from the simulated engine's prefix cache, on vLLM's wire.

Like vLLM's ZmqEventPublisher (vllm/distributed/kv_events.py): one PUB socket sends, per engine step
that changed the cache, a message of three frames: the topic, an 8-byte big-endian sequence number
(from 0), and a msgpack `KVEventBatch` [ts, events, data_parallel_rank]; a ROUTER socket answers a
replay request (an 8-byte big-endian start sequence) with every buffered batch from there on, each as
(sequence, payload), then (-1, b""). An endpoint with `*` is bound, any other connected (vLLM's rule);
the replay endpoint is bound.

Events are encoded as msgspec encodes vLLM's structs: in the `map` layout (vLLM since it dropped
`array_like` from its event structs) each event is a map whose first key is `type`; in the `array`
layout (earlier releases) a list with the tag first, then every field in order. pyzmq and msgpack
are imported only when events are enabled.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields

from simengine.prefix import Cleared, Event, Removed, Stored

LAYOUTS = ("map", "array")
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KvEventsConfig:
    """vLLM's --kv-events-config keys (and their defaults) that shape the wire."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    layout: str = "map"  # the simulator's own: which vLLM release's event layout

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"


def parse_config(text: str) -> KvEventsConfig:
    """--kv-events-config's JSON; raises ValueError with what is wrong."""
    try:
        data = json.loads(text)
    except ValueError:
        raise ValueError("--kv-events-config is not valid JSON") from None
    if not isinstance(data, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    known = {f.name: f.type for f in fields(KvEventsConfig)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"--kv-events-config: unknown key(s) {', '.join(unknown)}")
    cfg = KvEventsConfig(**data)
    if cfg.publisher not in ("zmq", "null"):
        raise ValueError(f"--kv-events-config: publisher must be zmq or null, not {cfg.publisher!r}")
    if cfg.layout not in LAYOUTS:
        raise ValueError(f"--kv-events-config: layout must be one of {', '.join(LAYOUTS)}")
    if not isinstance(cfg.buffer_steps, int) or cfg.buffer_steps < 1:
        raise ValueError("--kv-events-config: buffer_steps must be a positive integer")
    return cfg


def event_fields(e: Event, block_size: int) -> tuple[str, list[tuple[str, object]]]:
    """An event's tag and its encoded fields in vLLM's declaration order (fields with a default that
    vLLM leaves at it are left out, as msgspec's omit_defaults does)."""
    if isinstance(e, Stored):
        n = len(e.block_hashes)
        extra = [[e.salt] if i == 0 and e.salt else None for i in range(n)]
        return "BlockStored", [
            ("block_hashes", list(e.block_hashes)), ("parent_block_hash", e.parent_block_hash),
            ("token_ids", list(e.token_ids)), ("block_size", block_size), ("lora_id", None), ("medium", "GPU"),
            ("lora_name", None), ("extra_keys", extra), ("group_idx", 0), ("kv_cache_spec_kind", "full_attention")]
    if isinstance(e, Removed):
        return "BlockRemoved", [("block_hashes", list(e.block_hashes)), ("medium", "GPU"), ("group_idx", 0)]
    if isinstance(e, Cleared):
        return "AllBlocksCleared", []
    raise TypeError(f"not a KV event: {e!r}")


# Every field of vLLM's structs in order, for the array layout (msgspec writes them all there).
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def encode_batch(events: list[Event], ts: float, block_size: int, layout: str = "map", rank: int = 0) -> bytes:
    import msgpack

    out = []
    for e in events:
        tag, fs = event_fields(e, block_size)
        if layout == "map":
            out.append({"type": tag, **dict(fs)})
        else:
            values = dict(fs)
            out.append([tag, *(values.get(name) for name in _ARRAY_FIELDS[tag])])
    return msgpack.packb([float(ts), out, rank], use_bin_type=True)


class Publisher:
    """A thread that owns the ZMQ sockets: it sends queued batches and answers replay requests."""

    def __init__(self, cfg: KvEventsConfig, block_size: int, log=print):
        import zmq  # noqa: F401 - fail here, at start, when pyzmq is missing

        self.cfg, self.block_size, self._log = cfg, block_size, log
        self._queue: queue.Queue[list[Event] | None] = queue.Queue(maxsize=cfg.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._ready = threading.Event()
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="sim-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error

    def publish(self, events: list[Event]) -> None:
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self._log("kv events: queue full, a batch was dropped")

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context.instance()
        try:
            pub = ctx.socket(zmq.PUB)
            pub.set_hwm(self.cfg.hwm)
            ep = self.cfg.endpoint
            if "*" in ep or "::" in ep or ep.startswith(("ipc://", "inproc://")):
                pub.bind(ep)
            else:
                pub.connect(ep)
            replay = None
            if self.cfg.replay_endpoint:
                replay = ctx.socket(zmq.ROUTER)
                replay.bind(self.cfg.replay_endpoint)
        except zmq.ZMQError as e:
            self._error = OSError(f"cannot open the KV events sockets: {e}")
            self._ready.set()
            return
        self._ready.set()
        seq, topic = 0, self.cfg.topic.encode()
        try:
            while True:
                if replay is not None and replay.poll(0):
                    self._replay(replay)
                try:
                    events = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if events is None:
                    return
                payload = encode_batch(events, time.time(), self.block_size, self.cfg.layout)
                pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                seq += 1
        finally:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _replay(self, sock) -> None:
        frames = sock.recv_multipart()
        if len(frames) != 3:
            self._log(f"kv events: invalid replay request of {len(frames)} frames")
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                sock.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        sock.send_multipart((client, b"", END_SEQ, b""))
