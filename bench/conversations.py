"""Conversation workloads for bench/fleetsim.py and bench/routing.py: bench/prefix.py's traffic
(multi-turn sessions over shared system prompts, one-shot requests mixed in), sized to a share of a
fleet's capacity, and the prompt-token hit ratio read from the engines' own counters in either make.

    conversations  every request is a turn of a session (3-8 turns, each resending the history)
    mix            the same, with MIX of the requests one-shot prompts that share nothing

The sessions are bench/prefix.py's `workload()` (in bench/traffic.py: imported, not copied, so the
benchmarks measure the same traffic); for the simulator each turn is also turned into the tokens the
sim engine's chat template makes of it, with an answer fixed in advance, so a session's history does
not depend on which engine answered and the same seed gives the same run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from bench.fleets import Dist
from bench import traffic
from simengine import tokens as tok

WORKLOADS = ("random", "conversations", "mix")  # random: the benchmarks' original traffic
MAKES = ("vllm", "llamacpp")  # the engine the sim engines stand for (simengine --metrics-style)
MIX = 0.2  # share of one-shot requests in the `mix` workload (bench/prefix.py's default --mix)


@dataclass(frozen=True)
class Turn:
    messages: tuple[dict, ...]  # the chat request's messages, as bench/prefix.py's client sends them
    tokens: tuple[int, ...]  # the prompt as the sim engine's chat template makes it, history included
    output: tuple[int, ...]  # the answer's tokens (max_tokens of them)
    think: float  # seconds after the answer before the next turn is sent


@dataclass(frozen=True)
class Session:
    start: float
    turns: tuple[Turn, ...]
    one_shot: bool = False


def mix_of(workload: str) -> float:
    if workload not in WORKLOADS or workload == "random":
        raise ValueError(f"not a conversation workload: {workload!r} (choose from conversations, mix)")
    return MIX if workload == "mix" else 0.0


def conversations(workload: str, requests_per_s: float, seconds: float, seed: int) -> list[Any]:
    """bench/prefix.py's conversations (its `Conversation`s), started over `seconds` so that all
    requests, every turn and one-shot counted, arrive at about `requests_per_s` on average."""
    if requests_per_s <= 0 or seconds <= 0:
        raise ValueError("the request rate and the length must be positive")
    mix = mix_of(workload)
    # Requests per conversation started, from a sample of the generator itself (turns, one-shots).
    sample = traffic.workload(200, 1.0, mix, seed)
    per_conversation = sum(c.turns for c in sample) / 200
    rate = requests_per_s / per_conversation
    return traffic.workload(max(1, round(rate * seconds)), rate, mix, seed)


def answer(seed: int, conversation: int, turn: int, n: int) -> tuple[str, tuple[int, ...]]:
    """A sim-engine-like answer of `n` four-byte words: its text, and its tokens (one per word)."""
    words = tok.answer_words(f"{seed}:{conversation}:{turn}")
    out = [next(words) for _ in range(n)]
    return "".join(out), tuple(tok.word_token(w) for w in out)


def sessions(convs: list[Any], seed: int) -> list[Session]:
    """Each conversation's turns as tokens: the system prompt, then user turn i, then (from the
    second turn on) the answers before it, as bench/prefix.py's client resends them."""
    out = []
    for j, c in enumerate(convs):
        messages: list[dict] = [{"role": "system", "content": c.system}]
        turns = []
        for i in range(c.turns):
            messages.append({"role": "user", "content": c.user[i]})
            text, output = answer(seed, j, i, c.max_tokens[i])
            turns.append(Turn(tuple(messages), tuple(tok.chat_tokens(messages)), output, c.think[i]))
            messages = messages + [{"role": "assistant", "content": text}]
        out.append(Session(c.start, tuple(turns), c.one_shot))
    return out


def sized_fleet(fleet, sess: list[Session]):
    """`fleet` with prompt and output lengths the workload's means, so its capacity (with no cache
    hit) is the conversations' own."""
    turns = [t for s in sess for t in s.turns]
    prompt = sum(len(t.tokens) for t in turns) / len(turns)
    output = sum(len(t.output) for t in turns) / len(turns)
    return replace(fleet, prompt=Dist("const", prompt), output=Dist("const", output))


def sized(fleet, workload: str, fraction: float, seconds: float, seed: int) -> tuple[Any, list[Any]]:
    """The conversations at `fraction` of the fleet's capacity for them, and the fleet sized to them.
    The capacity depends on the lengths, which depend on the traffic: sized on a first draw at the
    fleet's own capacity, then drawn again at the rate that capacity gives."""
    first = conversations(workload, fraction * fleet.capacity(), seconds, seed)
    fitted = sized_fleet(fleet, sessions(first, seed))
    return fitted, conversations(workload, fraction * fitted.capacity(), seconds, seed)


# --- the engines' own counters -----------------------------------------------------------------------
_VLLM = re.compile(r"^vllm:prefix_cache_(hits|queries)_total(?:\{[^}]*\})? (\S+)$", re.M)
_LLAMACPP = re.compile(r"^llamacpp:(prompt_tokens_cached_total|prompt_tokens_total) (\S+)$", re.M)


def metrics_counters(text: str, make: str) -> tuple[float, float]:
    """(prompt tokens found cached, prompt tokens looked up) from one engine's /metrics: vLLM's
    prefix-cache counters, or llama-server's (its prompt_tokens_total leaves the cached ones out)."""
    if make == "llamacpp":
        got = {m.group(1): float(m.group(2)) for m in _LLAMACPP.finditer(text)}
        cached = got.get("prompt_tokens_cached_total", 0.0)
        return cached, cached + got.get("prompt_tokens_total", 0.0)
    got = {m.group(1): float(m.group(2)) for m in _VLLM.finditer(text)}
    return got.get("hits", 0.0), got.get("queries", 0.0)


def core_counters(core, make: str) -> tuple[float, float]:
    """The same two numbers from a simulated engine's state (simengine.core.SimCore), as its
    /metrics would show them."""
    if make == "llamacpp" or core.prefix is None:
        return float(core.prompt_cached_total), float(core.prompt_tokens_total)
    return float(core.prefix.hits), float(core.prefix.queries)


def hit_ratio(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> float:
    """The fleet's share of prompt tokens found cached between two readings (Δhits / Δqueries)."""
    hits = sum(after[n][0] - before.get(n, (0.0, 0.0))[0] for n in after)
    queries = sum(after[n][1] - before.get(n, (0.0, 0.0))[1] for n in after)
    return hits / queries if queries > 0 else 0.0
