"""GPU health: NVML (or `nvidia-smi -q`) readings turned into a verdict per GPU.

    readings = NvmlReader().read()         # or parse_nvidia_smi(text), from `nvidia-smi -q -d ECC,PAGE_RETIREMENT`
    health = verdicts(readings, previous, now)

A GPU is unhealthy, with the reason, when NVML reports it lost (`NVMLError_GpuIsLost`: fallen off the
bus) or in need of a reset, when it has uncorrectable ECC errors since its last reset (the volatile
count), when a page retirement or row remap is pending (it takes effect at the next reset) or row
remapping has failed, or after a critical Xid event that is not an application's own fault (NVIDIA's
device plugin ignores 13, 31, 43, 45, 68 and 109 the same way). An Xid is an event, not a state: its
verdict holds for `XID_HOLD` seconds after the last one, then the GPU is healthy again if it reads so.
The verdict is pure; the readers are thin and take the `pynvml` module (or a fake) and a runner.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping

XID_HOLD = 600.0
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
XID_NAMES = {
    48: "double-bit ECC error", 63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed", 74: "NVLink error", 79: "the GPU has fallen off the bus",
    92: "high single-bit ECC error rate", 94: "contained ECC error", 95: "uncontained ECC error",
    119: "GSP RPC timeout", 120: "GSP error", 140: "unrecovered ECC error",
}


@dataclass(frozen=True)
class Reading:
    """What one read of one GPU said; None: not supported or not reported by this GPU."""

    index: int
    lost: bool = False
    reset_required: bool = False
    ecc_uncorrected: int | None = None  # volatile: since the last reset
    retired_pages_pending: bool | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    xids: tuple[int, ...] = ()  # critical Xid events since the previous read
    error: str | None = None  # any other failure reading this GPU


@dataclass(frozen=True)
class Health:
    index: int
    healthy: bool
    reason: str = ""
    xid_at: float | None = None  # when the last fatal Xid was seen (held for XID_HOLD)
    xid: int | None = None


def verdict(r: Reading, previous: Health | None, now: float, hold: float = XID_HOLD) -> Health:
    fatal = [x for x in r.xids if x not in APPLICATION_XIDS]
    xid, xid_at = (fatal[-1], now) if fatal else ((previous.xid, previous.xid_at) if previous else (None, None))
    if xid_at is not None and now - xid_at >= hold:
        xid, xid_at = None, None
    keep = dict(xid=xid, xid_at=xid_at)
    if r.lost:
        return Health(r.index, False, "NVML cannot reach the GPU (GPU is lost: fallen off the bus?)", **keep)
    if r.reset_required:
        return Health(r.index, False, "the GPU needs a reset (NVML: GPU requires restart)", **keep)
    if r.ecc_uncorrected:
        return Health(r.index, False, f"{r.ecc_uncorrected} uncorrectable ECC error"
                                      f"{'s' if r.ecc_uncorrected != 1 else ''} since the GPU's last reset", **keep)
    if r.remap_failed:
        return Health(r.index, False, "row remapping failed: the memory has no spare rows left", **keep)
    if r.retired_pages_pending or r.remap_pending:
        what = "a page retirement" if r.retired_pages_pending else "a row remap"
        return Health(r.index, False, f"{what} is pending: reset the GPU (or reboot) to apply it", **keep)
    if xid is not None:
        return Health(r.index, False, f"fatal Xid {xid} ({XID_NAMES.get(xid, 'see NVIDIA Xid catalog')}), "
                                      f"healthy again {hold:g}s after the last one if it reads so", **keep)
    if r.error is not None and previous is not None and not previous.healthy:
        return replace(previous, **keep)  # a failed read proves nothing either way: keep the verdict
    return Health(r.index, True, **keep)


def verdicts(readings: Iterable[Reading], previous: Mapping[int, Health], now: float,
             hold: float = XID_HOLD) -> dict[int, Health]:
    return {r.index: verdict(r, previous.get(r.index), now, hold) for r in readings}


# --- NVML ---------------------------------------------------------------------------------------------
class NvmlReader:
    """Reads every GPU through `pynvml` (nvidia-ml-py); keeps one event set so Xid events between two
    reads are not lost. `nvml` is the module (a fake in tests)."""

    def __init__(self, nvml: Any = None):
        if nvml is None:
            import pynvml as nvml  # nvidia-ml-py, the `gpu` extra
        self.nvml = nvml
        nvml.nvmlInit()
        self.events = None
        try:
            self.events = nvml.nvmlEventSetCreate()
            for i in range(nvml.nvmlDeviceGetCount()):
                try:
                    h = nvml.nvmlDeviceGetHandleByIndex(i)
                    supported = nvml.nvmlDeviceGetSupportedEventTypes(h)
                    nvml.nvmlDeviceRegisterEvents(h, supported & nvml.nvmlEventTypeXidCriticalError, self.events)
                except nvml.NVMLError:
                    continue  # an old GPU without events, or a lost one: its reads will say so
        except nvml.NVMLError:
            self.events = None

    def close(self) -> None:
        try:
            if self.events is not None:
                self.nvml.nvmlEventSetFree(self.events)
        finally:
            self.nvml.nvmlShutdown()

    def read(self) -> list[Reading]:
        n = self.nvml
        xids = self._drain()
        out = []
        for i in range(n.nvmlDeviceGetCount()):
            out.append(self._one(i, tuple(xids.get(i, ()))))
        return out

    def _one(self, i: int, xids: tuple[int, ...]) -> Reading:
        n = self.nvml
        try:
            h = n.nvmlDeviceGetHandleByIndex(i)
        except n.NVMLError as e:
            return _lost_or_error(n, i, e, xids)
        fields: dict[str, Any] = {}
        calls = (
            ("ecc_uncorrected", lambda: n.nvmlDeviceGetTotalEccErrors(
                h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC)),
            ("retired_pages_pending", lambda: n.nvmlDeviceGetRetiredPagesPendingStatus(h) == n.NVML_FEATURE_ENABLED),
            ("remap", lambda: n.nvmlDeviceGetRemappedRows(h)),
        )
        for name, call in calls:
            try:
                fields[name] = call()
            except n.NVMLError as e:
                if _is(n, e, "NVML_ERROR_NOT_SUPPORTED"):
                    continue
                return _lost_or_error(n, i, e, xids)
        remap = fields.pop("remap", None)
        if remap is not None:  # (correctable rows, uncorrectable rows, pending, failure occurred)
            fields["remap_pending"], fields["remap_failed"] = bool(remap[2]), bool(remap[3])
        return Reading(i, xids=xids, **fields)

    def _drain(self) -> dict[int, list[int]]:
        n, out = self.nvml, {}
        if self.events is None:
            return out
        while True:
            try:
                ev = n.nvmlEventSetWait(self.events, 0)
            except n.NVMLError:  # NVML_ERROR_TIMEOUT: no more events (other errors: read the GPUs anyway)
                return out
            if ev.eventType & n.nvmlEventTypeXidCriticalError:
                try:
                    idx = n.nvmlDeviceGetIndex(ev.device)
                except n.NVMLError:
                    continue
                out.setdefault(idx, []).append(int(ev.eventData))


def _is(n: Any, e: Exception, const: str) -> bool:
    return getattr(e, "value", None) == getattr(n, const, object())


def _lost_or_error(n: Any, i: int, e: Exception, xids: tuple[int, ...]) -> Reading:
    if _is(n, e, "NVML_ERROR_GPU_IS_LOST"):
        return Reading(i, lost=True, xids=xids)
    if _is(n, e, "NVML_ERROR_RESET_REQUIRED"):
        return Reading(i, reset_required=True, xids=xids)
    return Reading(i, xids=xids, error=str(e))


# --- nvidia-smi ---------------------------------------------------------------------------------------
SMI_ARGS = ("nvidia-smi", "-q", "-d", "ECC,PAGE_RETIREMENT")


def parse_nvidia_smi(text: str) -> list[Reading]:
    """Readings from `nvidia-smi -q -d ECC,PAGE_RETIREMENT` (one `GPU <bus id>` block per GPU, in
    index order). Understands the older "Double Bit / Total" and the newer "DRAM/SRAM Uncorrectable"
    layouts; only the Volatile section's uncorrectable counts count."""
    blocks: list[list[str]] = []
    for line in text.splitlines():
        if re.match(r"^GPU [0-9A-Fa-f]{4,}:", line):
            blocks.append([])
        elif blocks:
            blocks[-1].append(line)
    return [_parse_block(i, lines) for i, lines in enumerate(blocks)]


def _parse_block(index: int, lines: list[str]) -> Reading:
    path: list[tuple[int, str]] = []
    unc, fields = 0, {}
    seen_unc = False
    for line in lines:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        key, sep, value = line.strip().partition(":")
        key, value = key.strip(), value.strip()
        while path and path[-1][0] >= indent:
            path.pop()
        if not sep or (not value and not key.endswith(")")):
            path.append((indent, key))
            continue
        sections = [p for _, p in path]
        n = _int(value)
        if "Volatile" in sections and n is not None and (
                "Uncorrectable" in key or ("Double Bit" in sections and key == "Total")):
            unc += n
            seen_unc = True
        elif "Retired Pages" in sections and key.startswith("Pending"):
            fields["retired_pages_pending"] = _yes(value)
        elif "Remapped Rows" in sections and key == "Pending":
            fields["remap_pending"] = _yes(value)
        elif "Remapped Rows" in sections and key.startswith("Remapping Failure"):
            fields["remap_failed"] = _yes(value)
    return Reading(index, ecc_uncorrected=unc if seen_unc else None, **fields)


def _int(v: str) -> int | None:
    return int(v) if v.isdigit() else None


def _yes(v: str) -> bool | None:
    return {"yes": True, "no": False}.get(v.lower())


def read_nvidia_smi(run: Callable[..., Any] = subprocess.run, timeout: float = 20.0) -> list[Reading] | None:
    """The fallback reader: None when nvidia-smi is absent or fails (no verdict rather than a wrong one)."""
    try:
        p = run(list(SMI_ARGS), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    if p.returncode != 0:
        return None
    return parse_nvidia_smi(p.stdout)
