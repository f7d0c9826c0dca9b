"""bench/prefix.py's traffic, shared with bench/conversations.py (and through it bench/fleetsim.py and
bench/routing.py): conversations of 3-8 turns over 24 shared system prompts, one-shot prompts mixed
in (`workload`), the floor no router can take a request's first token under (`floor`), and the
client that sends them, streamed, turn after turn (`chat`, `run_traffic`).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass, field, replace

from simengine.core import SimConfig
from simengine.tokens import chat_tokens

CHAT = "/v1/chat/completions"
CLIENT_TIMEOUT = 60.0  # seconds, as many HTTP clients: an answer later than that counts as an error
TOPICS = ("billing", "shipping", "returns", "accounts", "security", "pricing", "support", "legal", "travel",
          "health", "energy", "banking", "retail", "media", "games", "school", "farming", "housing", "transit",
          "insurance", "telecom", "payroll", "hiring", "weather")
FILLER = ("policy", "customer", "request", "answer", "always", "never", "polite", "precise", "context", "detail",
          "example", "refund", "account", "order", "number", "agent", "support", "escalate", "summary", "tone")


# --- the traffic ------------------------------------------------------------------------------------
def words(rng: random.Random, tokens: int) -> str:
    """Text of about `tokens` of the sim's tokens (four bytes each)."""
    out, n = [], 0
    while n < 4 * tokens:
        w = rng.choice(FILLER)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


def system_prompts(seed: int, n: int = 24) -> list[str]:
    rng = random.Random(seed)
    return [f"You are the {TOPICS[i % len(TOPICS)]} assistant number {i}. " + words(rng, rng.randint(300, 2500))
            for i in range(n)]


@dataclass
class Conversation:
    start: float
    system: str
    turns: int
    one_shot: bool = False
    user: list[str] = field(default_factory=list)
    max_tokens: list[int] = field(default_factory=list)
    think: list[float] = field(default_factory=list)


def workload(n: int, rate: float, mix: float, seed: int) -> list[Conversation]:
    """`n` conversations starting as a Poisson process at `rate`, and one-shot requests making up
    `mix` of all requests, at random times over the same span."""
    rng, prompts = random.Random(seed), system_prompts(seed)
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        turns = rng.randint(3, 8)
        out.append(Conversation(t, rng.choice(prompts), turns, user=[words(rng, rng.randint(10, 60)) for _ in range(turns)],
                                max_tokens=[rng.randint(16, 64) for _ in range(turns)],
                                think=[rng.uniform(0.3, 1.5) for _ in range(turns)]))
    requests = sum(c.turns for c in out)
    for _ in range(int(requests * mix / max(1e-9, 1 - mix))):
        out.append(Conversation(rng.uniform(0, t), words(rng, rng.randint(100, 1500)), 1, one_shot=True,
                                user=[words(rng, rng.randint(10, 60))], max_tokens=[rng.randint(16, 64)], think=[0.0]))
    return sorted(out, key=lambda c: c.start)


def floor(convs: list[Conversation], sim: SimConfig) -> list[float]:
    """Each request's time to first token with no queue anywhere: the prefill no router can avoid,
    on an idle engine of the fleet's fastest, plus its one decode step. A one-shot prompt and the
    first conversation over each system prompt compute their whole prompt, a later conversation's
    first turn only its own message (its system prompt held where it goes), a later turn its new
    message and the last block of the previous answer. A router's TTFT percentiles cannot go below
    these: the gap between them is what routing can still win."""
    def tokens(*messages: str) -> int:
        return len(chat_tokens([{"role": "user", "content": m} for m in messages]))

    seen, out = set(), []
    for c in sorted(convs, key=lambda c: c.start):
        for i in range(c.turns):
            if c.one_shot or (i == 0 and c.system not in seen):
                need = tokens(c.system, c.user[i])
            else:
                need = tokens(c.user[i]) + (16 if i else 0)
            out.append(sim.prefill_seconds(need) + sim.decode_seconds(1))
        if not c.one_shot:
            seen.add(c.system)
    return out


# --- the client -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Result:
    status: int
    ttft: float | None
    latency: float
    server: str
    text: str
    predicted: tuple[float, float] | None = None  # llmgw's X-LLMGW-Prefix: (matched, prompt) tokens
    reused: tuple[float, float] | None = None  # llama-server's timings: (cache_n, prompt tokens)
    moved: bool | None = None  # a later turn served by another engine than its previous turn (None: a first turn)
    turn: int = 0  # its turn in the conversation (0: the first)
    one_shot: bool = False
    prompt_bytes: int = 0  # the messages' text it sent
    note: str = ""  # the rest of llmgw's X-LLMGW-Prefix (its expected cost, backlog, rule)
    started: float = 0.0  # when it was sent (monotonic seconds)


_PREFIX = re.compile(rb"(?i)\r\nx-llmgw-prefix: matched=(\d+)/(\d+)([^\r]*)")
_CONTENT = re.compile(r'"(?:content|text)": ?"(?!")')


async def chat(host: str, port: int, body: dict, timeout: float) -> Result:
    """One streamed chat request; the answer's text, time to its first content token, its engine."""
    start = time.monotonic()
    status, ttft, server, text, predicted, reused, note = 0, None, "", [], None, None, ""
    writer = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            raw = json.dumps(body).encode()
            writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                         b"Connection: close\r\n\r\n%s" % (CHAT.encode(), host.encode(), len(raw), raw))
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            if m := _PREFIX.search(head):
                predicted = (float(m.group(1)), float(m.group(2)))
                note = m.group(3).decode(errors="replace").strip("; ")
            buf = b""
            while chunk := await reader.read(65536):
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if not line.startswith(b"data: {"):
                        continue
                    event = json.loads(line[6:])
                    server = server or event.get("system_fingerprint") or ""
                    if isinstance(t := event.get("timings"), dict):
                        reused = (float(t.get("cache_n") or 0), float(t.get("cache_n") or 0) + float(t.get("prompt_n") or 0))
                    for choice in event.get("choices") or []:
                        piece = (choice.get("delta") or {}).get("content") or ""
                        if piece and ttft is None:
                            ttft = time.monotonic() - start
                        text.append(piece)
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, IndexError):
        status = 0 if status == 200 else status
    finally:
        if writer is not None:
            writer.close()
    return Result(status, ttft, time.monotonic() - start, server, "".join(text), predicted, reused, note=note,
                  started=start)


def run_traffic(urls: str | list[str], convs: list[Conversation]) -> list[Result]:
    """The conversations, each request to the next of `urls` in turn (round robin, per request)."""
    addresses = [(u.split("//", 1)[1].split(":")[0], int(u.rsplit(":", 1)[1])) for u in
                 ([urls] if isinstance(urls, str) else urls)]
    sent = [0]

    def address() -> tuple[str, int]:
        sent[0] += 1
        return addresses[sent[0] % len(addresses)]

    async def conversation(t0: float, c: Conversation, out: list[Result]) -> None:
        await asyncio.sleep(max(0.0, t0 + c.start - time.monotonic()))
        messages = [{"role": "system", "content": c.system}]
        previous = ""
        for i in range(c.turns):
            messages.append({"role": "user", "content": c.user[i]})
            host, port = address()
            r = await chat(host, port, {"model": "m", "stream": True, "max_tokens": c.max_tokens[i],
                                             "messages": messages}, CLIENT_TIMEOUT)
            r = replace(r, turn=i, one_shot=c.one_shot, prompt_bytes=sum(len(m["content"]) for m in messages))
            if i and r.status == 200:
                r = replace(r, moved=r.server != previous)
            previous = r.server
            out.append(r)
            if r.status != 200:
                return  # a conversation whose turn failed ends there
            messages = messages + [{"role": "assistant", "content": r.text}]
            await asyncio.sleep(c.think[i])

    async def main() -> list[Result]:
        out: list[Result] = []
        t0 = time.monotonic()
        await asyncio.gather(*(conversation(t0, c, out) for c in convs))
        return out

    return asyncio.run(main())
