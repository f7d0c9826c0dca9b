"""GPU health verdicts, read through a fake `pynvml` module and from nvidia-smi's text."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from llmgw.weights.gpuhealth import (XID_HOLD, Health, NvmlReader, Reading, parse_nvidia_smi, read_nvidia_smi,
                                     verdict, verdicts)


class NVMLError(Exception):
    def __init__(self, value):
        self.value = value

    def __str__(self):
        return {15: "GPU is lost", 3: "Not Supported", 999: "Unknown Error"}.get(self.value, f"NVML error {self.value}")


@dataclass
class FakeGpu:
    ecc: int | Exception = 0
    pending: int | Exception = 0
    remap: tuple | Exception = (0, 0, 0, 0)
    handle_error: Exception | None = None


@dataclass
class FakeNvml:
    """The parts of pynvml the reader calls, with the same names and error values."""

    gpus: list[FakeGpu] = field(default_factory=lambda: [FakeGpu(), FakeGpu()])
    events: list[tuple[int, int]] = field(default_factory=list)  # (device index, xid)
    calls: list[str] = field(default_factory=list)

    NVMLError = NVMLError
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_TIMEOUT = 10
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_ERROR_RESET_REQUIRED = 16
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_FEATURE_ENABLED = 1
    nvmlEventTypeXidCriticalError = 0x8

    def nvmlInit(self):
        self.calls.append("init")

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        if self.gpus[i].handle_error:
            raise self.gpus[i].handle_error
        return ("h", i)

    def nvmlDeviceGetIndex(self, h):
        return h[1]

    def _val(self, v):
        if isinstance(v, Exception):
            raise v
        return v

    def nvmlDeviceGetTotalEccErrors(self, h, etype, counter):
        assert (etype, counter) == (1, 0)  # uncorrected, volatile
        return self._val(self.gpus[h[1]].ecc)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        return self._val(self.gpus[h[1]].pending)

    def nvmlDeviceGetRemappedRows(self, h):
        return self._val(self.gpus[h[1]].remap)

    def nvmlEventSetCreate(self):
        return "set"

    def nvmlDeviceGetSupportedEventTypes(self, h):
        return 0xFF

    def nvmlDeviceRegisterEvents(self, h, types, event_set):
        assert types == self.nvmlEventTypeXidCriticalError
        self.calls.append(f"register {h[1]}")

    def nvmlEventSetWait(self, event_set, timeout_ms):
        if not self.events:
            raise NVMLError(self.NVML_ERROR_TIMEOUT)
        i, xid = self.events.pop(0)
        return SimpleNamespace(device=("h", i), eventType=self.nvmlEventTypeXidCriticalError, eventData=xid)

    def nvmlEventSetFree(self, event_set):
        self.calls.append("free")


@pytest.mark.parametrize("reading,reason", [
    (Reading(0), ""),
    (Reading(0, lost=True), "NVML cannot reach the GPU (GPU is lost: fallen off the bus?)"),
    (Reading(0, reset_required=True), "the GPU needs a reset (NVML: GPU requires restart)"),
    (Reading(0, ecc_uncorrected=3), "3 uncorrectable ECC errors since the GPU's last reset"),
    (Reading(0, ecc_uncorrected=1), "1 uncorrectable ECC error since the GPU's last reset"),
    (Reading(0, remap_failed=True), "row remapping failed: the memory has no spare rows left"),
    (Reading(0, remap_pending=True), "a row remap is pending: reset the GPU (or reboot) to apply it"),
    (Reading(0, retired_pages_pending=True), "a page retirement is pending: reset the GPU (or reboot) to apply it"),
    (Reading(0, xids=(79,)), "fatal Xid 79 (the GPU has fallen off the bus), healthy again 600s after the last one if it reads so"),
    (Reading(0, xids=(13, 31, 43, 45, 68, 109)), ""),  # the application's own faults
    (Reading(0, ecc_uncorrected=0, remap_pending=False, remap_failed=False, retired_pages_pending=False), ""),
])
def test_verdict_table(reading, reason):
    h = verdict(reading, None, now=100.0)
    assert h.healthy == (reason == "") and h.reason == reason


def test_a_fatal_xid_holds_then_clears_when_the_gpu_reads_healthy():
    h = verdict(Reading(0, xids=(48,)), None, now=100.0)
    assert not h.healthy and h.xid == 48 and h.xid_at == 100.0
    h = verdict(Reading(0), h, now=100.0 + XID_HOLD - 1)
    assert not h.healthy and "fatal Xid 48 (double-bit ECC error)" in h.reason
    h = verdict(Reading(0), h, now=100.0 + XID_HOLD)
    assert h.healthy and h.xid is None
    # A new Xid restarts the hold; ECC errors read now win the reason, the Xid stays remembered.
    h = verdict(Reading(0, xids=(95,), ecc_uncorrected=2), h, now=2000.0)
    assert not h.healthy and h.reason.startswith("2 uncorrectable") and h.xid == 95


def test_a_failed_read_keeps_the_last_verdict():
    bad = Health(0, False, "3 uncorrectable ECC errors since the GPU's last reset")
    assert verdict(Reading(0, error="Unknown Error"), bad, now=1.0).reason == bad.reason
    assert verdict(Reading(0, error="Unknown Error"), None, now=1.0).healthy


def test_nvml_reader_maps_each_failure():
    nvml = FakeNvml(gpus=[FakeGpu(), FakeGpu(ecc=2), FakeGpu(handle_error=NVMLError(15)),
                          FakeGpu(ecc=NVMLError(3), pending=NVMLError(3), remap=NVMLError(3)),
                          FakeGpu(remap=(0, 1, 1, 0)), FakeGpu(ecc=NVMLError(15))])
    r = NvmlReader(nvml)
    nvml.events = [(0, 79), (4, 13)]
    readings = r.read()
    assert readings[0] == Reading(0, ecc_uncorrected=0, retired_pages_pending=False, remap_pending=False,
                                  remap_failed=False, xids=(79,))
    assert readings[1].ecc_uncorrected == 2
    assert readings[2].lost
    assert readings[3] == Reading(3)  # a consumer card without ECC: nothing known, nothing wrong
    assert readings[4].remap_pending and readings[4].xids == (13,)
    assert readings[5].lost  # lost between two calls
    health = verdicts(readings, {}, now=5.0)
    assert [h.healthy for h in health.values()] == [False, False, False, True, False, False]
    assert health[0].reason.startswith("fatal Xid 79")
    assert r.read()[0].xids == ()  # events are drained once
    r.close()
    assert nvml.calls[0] == "init" and nvml.calls[-2:] == ["free", "shutdown"]


AMPERE = """
==============NVSMI LOG==============

Timestamp                                 : Wed Jun  7 19:32:16 2023
Driver Version                            : 510.73.08
Attached GPUs                             : 2
GPU 00000000:10:1C.0
    ECC Mode
        Current                           : Enabled
        Pending                           : Enabled
    ECC Errors
        Volatile
            SRAM Correctable              : 0
            SRAM Uncorrectable            : 0
            DRAM Correctable              : 177
            DRAM Uncorrectable            : 0
        Aggregate
            SRAM Correctable              : 0
            SRAM Uncorrectable            : 0
            DRAM Correctable              : 177
            DRAM Uncorrectable            : 4
    Retired Pages
        Single Bit ECC                    : N/A
        Double Bit ECC                    : N/A
        Pending Page Blacklist            : N/A
    Remapped Rows
        Correctable Error                 : 1
        Uncorrectable Error               : 0
        Pending                           : Yes
        Remapping Failure Occurred        : No
        Bank Remap Availability Histogram
            Max                           : 639 bank(s)
            High                          : 1 bank(s)

GPU 00000000:20:1C.0
    ECC Errors
        Volatile
            SRAM Correctable              : 0
            SRAM Uncorrectable Parity     : 1
            SRAM Uncorrectable SEC-DED    : 0
            DRAM Correctable              : 0
            DRAM Uncorrectable            : 2
        Aggregate
            DRAM Uncorrectable            : 9
    Retired Pages
        Pending Page Blacklist            : No
    Remapped Rows                         : N/A
"""

VOLTA = """
GPU 00000000:3B:00.0
    ECC Errors
        Volatile
            Single Bit
                Device Memory             : 5
                Total                     : 5
            Double Bit
                Device Memory             : 1
                Register File             : 0
                Total                     : 1
        Aggregate
            Double Bit
                Total                     : 7
    Retired Pages
        Single Bit ECC                    : 2
        Double Bit ECC                    : 1
        Pending Page Blacklist            : Yes
GPU 00000000:5E:00.0
    ECC Errors
        Volatile
            SRAM Correctable              : N/A
            DRAM Uncorrectable            : N/A
    Retired Pages
        Pending Page Blacklist            : N/A
"""


def test_parse_nvidia_smi_layouts():
    a, b = parse_nvidia_smi(AMPERE)
    assert a == Reading(0, ecc_uncorrected=0, remap_pending=True, remap_failed=False, retired_pages_pending=None)
    assert b == Reading(1, ecc_uncorrected=3, retired_pages_pending=False)  # aggregate counts do not count
    v, consumer = parse_nvidia_smi(VOLTA)
    assert v == Reading(0, ecc_uncorrected=1, retired_pages_pending=True)
    assert consumer == Reading(1)
    assert [verdict(r, None, 0).healthy for r in (a, b, v, consumer)] == [False, False, False, True]


def test_read_nvidia_smi_without_the_tool_gives_no_verdict():
    def missing(*a, **kw):
        raise FileNotFoundError("nvidia-smi")
    assert read_nvidia_smi(missing) is None
    failed = lambda *a, **kw: subprocess.CompletedProcess(a[0], 9, "", "NVIDIA-SMI has failed")  # noqa: E731
    assert read_nvidia_smi(failed) is None
    ok = lambda *a, **kw: subprocess.CompletedProcess(a[0], 0, VOLTA, "")  # noqa: E731
    assert len(read_nvidia_smi(ok)) == 2
