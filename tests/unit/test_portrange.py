"""Port ranges outside the kernel's ephemeral range (issue 57): the block `llmgw up` and the test
harness take (a pure choice over the range, the ports held and a probe), the one-line warning when a
range overlaps `net.ipv4.ip_local_port_range`, the one-line error that says what to set, and what
`llmgw up` makes of LLMGW_UP_PORT_RANGE and LLMGW_PORT_RANGE before it starts anything."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.cli.up import engine_port_range, port_warnings
from llmgw.errors import ConfigError, NoFreePorts
from llmgw.proc import ports
from llmgw.proc.portrange import choose_block, ephemeral_warning, overlap
from llmgw.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
EPHEMERAL = (32768, 60999)
FREE = lambda port: True  # noqa: E731 - a probe that refuses nothing


# --- the choice of a block ---------------------------------------------------------------------------
def test_blocks_are_aligned_and_the_draw_picks_where_the_search_begins():
    assert choose_block((1000, 1099), 10, (), FREE) == (1000, 1009)
    assert choose_block((1000, 1099), 10, (), FREE, start=3) == (1030, 1039)
    assert choose_block((1000, 1099), 10, (), FREE, start=13) == (1030, 1039)  # modulo the 10 blocks
    # A range that is not a whole number of blocks: its tail is never handed out.
    assert choose_block((1000, 1014), 10, (), FREE, start=1) == (1000, 1009)
    assert choose_block((1000, 1008), 10, (), FREE) is None


def test_a_block_with_a_held_or_refused_port_is_skipped_for_the_next():
    assert choose_block((1000, 1099), 10, {1005}, FREE) == (1010, 1019)
    assert choose_block((1000, 1099), 10, (), lambda p: p != 1019, start=1) == (1020, 1029)
    # The search wraps around: from the last block, the first is next.
    assert choose_block((1000, 1099), 10, {1095}, FREE, start=9) == (1000, 1009)


def test_no_block_free_is_none():
    assert choose_block((1000, 1019), 10, {1000}, lambda p: p != 1015) is None
    assert choose_block((1000, 1019), 10, range(1000, 1020), FREE) is None


def test_blocks_outside_the_ephemeral_range_first():
    rng = (32000, 33999)  # 8 blocks below the ephemeral range, 12 inside it
    assert choose_block(rng, 100, (), FREE, start=15, avoid=EPHEMERAL) == (32000, 32099)
    assert choose_block(rng, 100, (), FREE, start=5, avoid=EPHEMERAL) == (32500, 32599)
    # ... but a block that overlaps it still serves when no other is free.
    below = range(32000, 32768)
    assert choose_block(rng, 100, below, FREE, start=15, avoid=EPHEMERAL) == (33500, 33599)
    # The block straddling the boundary counts as overlapping.
    assert choose_block((32700, 32899), 100, (), FREE, avoid=EPHEMERAL) == (32700, 32799)
    assert choose_block((32600, 32899), 100, (), FREE, start=1, avoid=EPHEMERAL) == (32600, 32699)


def test_a_block_of_one_port():
    assert choose_block((5, 9), 1, {5, 6}, lambda p: p != 7) == (8, 8)


# --- the range check ---------------------------------------------------------------------------------
@pytest.mark.parametrize("rng,shared", [
    ((22000, 29999), 0), ((32767, 32767), 0), ((61000, 65000), 0),
    ((32000, 32768), 1), ((40000, 40099), 100), ((30000, 65000), 28232),
])
def test_overlap(rng, shared):
    assert overlap(rng, EPHEMERAL) == shared


def test_the_warning_is_one_line_naming_the_setting_and_the_kernels_range():
    assert ephemeral_warning("LLMGW_PORT_RANGE", (21000, 21999), EPHEMERAL) is None
    assert ephemeral_warning("LLMGW_PORT_RANGE", (21000, 21999), None) is None  # the kernel's range unknown
    text = ephemeral_warning("LLMGW_UP_PORT_RANGE", (30000, 40000), EPHEMERAL)
    assert text == ("LLMGW_UP_PORT_RANGE 30000-40000 overlaps the kernel's ephemeral port range 32768-60999 "
                    "(net.ipv4.ip_local_port_range) by 7233 ports: outgoing connections draw their local ports "
                    "there, and such a port refuses a bind; set LLMGW_UP_PORT_RANGE=START-END outside 32768-60999")


def test_no_free_ports_is_one_line_that_says_what_to_set():
    e = NoFreePorts("LLMGW_UP_PORT_RANGE", (22000, 29999), 100, EPHEMERAL)
    assert str(e) == ("no block of 100 free consecutive ports in LLMGW_UP_PORT_RANGE 22000-29999 (each is held, "
                      "or refuses a bind); set LLMGW_UP_PORT_RANGE=START-END to a range with free ports, outside "
                      "the kernel's ephemeral range 32768-60999 (net.ipv4.ip_local_port_range)")


# --- the shells --------------------------------------------------------------------------------------
def test_ephemeral_range_is_read_from_proc(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t40999\n")
    assert ports.ephemeral_range(str(f)) == (40000, 40999)
    assert ports.ephemeral_range(str(tmp_path / "missing")) is None
    f.write_text("garbage")
    assert ports.ephemeral_range(str(f)) is None


def _listen_on(port: int, lo: int, hi: int) -> socket.socket:
    """A listener on `port`, the other ports of lo-hi free (outside the harness's and `llmgw up`'s
    ranges, so no test beside this one takes them); skips when this machine holds one of them."""
    if not all(ports.can_bind("127.0.0.1", p) for p in range(lo, hi + 1)):
        pytest.skip(f"a port of {lo}-{hi} is held on this machine")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_free_port_range_skips_a_listening_port_and_fails_with_the_variable():
    with _listen_on(9900, 9900, 9909):
        # Two blocks of 5; the one with the listener is refused, whichever the draw starts from.
        for draw in (0, 1):
            assert ports.free_port_range(5, (9900, 9909), draw=draw) == (9905, 9909)
        with pytest.raises(NoFreePorts, match="^no free port in LLMGW_TEST_RANGE 9900-9900 "):
            ports.free_port_range(1, (9900, 9900), variable="LLMGW_TEST_RANGE")


def test_a_time_wait_of_an_outgoing_connection_refuses_the_bind_the_probe_tries():
    """Why the probe binds instead of asking: the local port of an outgoing connection, closed first
    by this side and so in TIME-WAIT, refuses a server's bind even with SO_REUSEADDR."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        c = socket.socket()
        c.bind(("127.0.0.1", 0))  # the local port this connection holds
        port = c.getsockname()[1]
        c.connect(srv.getsockname())
        accepted, _ = srv.accept()
        c.close()  # this side closes first: its end stays in TIME-WAIT for 60 s
        accepted.close()
        assert not ports.can_bind("127.0.0.1", port)


# --- what `llmgw up` makes of its settings -----------------------------------------------------------
def test_up_port_range_setting():
    assert Settings.from_env({}).up_port_range == (22000, 29999)
    assert Settings.from_env({"LLMGW_UP_PORT_RANGE": "40000-40999"}).up_port_range == (40000, 40999)
    with pytest.raises(ConfigError, match="^LLMGW_UP_PORT_RANGE: expected START-END, got '22000'$"):
        Settings.from_env({"LLMGW_UP_PORT_RANGE": "22000"})


def test_up_reads_the_engines_range_and_warns_of_each_overlapping_range_it_uses():
    assert engine_port_range({}) is None and engine_port_range({"LLMGW_PORT_RANGE": ""}) is None
    assert engine_port_range({"LLMGW_PORT_RANGE": "21000-21099"}) == (21000, 21099)
    with pytest.raises(ConfigError, match="^LLMGW_PORT_RANGE: expected START-END"):
        engine_port_range({"LLMGW_PORT_RANGE": "soon"})
    inside = (40000, 40999)
    assert port_warnings((22000, 29999), None, True, EPHEMERAL) == []
    (w,) = port_warnings(inside, None, True, EPHEMERAL)
    assert w.startswith("LLMGW_UP_PORT_RANGE 40000-40999 overlaps")
    (w,) = port_warnings((22000, 29999), inside, True, EPHEMERAL)
    assert w.startswith("LLMGW_PORT_RANGE 40000-40999 overlaps")
    # Redis given and the engines' range given: LLMGW_UP_PORT_RANGE is not used, so not warned of.
    assert port_warnings(inside, (21000, 21099), False, EPHEMERAL) == []


def test_up_with_no_free_ports_says_what_to_set_in_one_line(tmp_path):
    """A range with no free block of 100 (one of its 100 ports is held): `llmgw up` exits with one
    line naming LLMGW_UP_PORT_RANGE, having started nothing (no traceback)."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "LLMGW_REDIS_URL", "LLMGW_PORT_RANGE")}
    env.update(LLMGW_UP_PORT_RANGE="9800-9899", PYTHONPATH=str(ROOT))
    with _listen_on(9850, 9800, 9899):
        run = subprocess.run([sys.executable, "-m", "llmgw", "up", "--port", str(ports.free_port()), "--state-dir",
                              str(tmp_path / "state")], capture_output=True, text=True, timeout=60, env=env,
                             cwd=tmp_path)
    assert run.returncode != 0
    assert "Traceback" not in run.stderr + run.stdout
    assert run.stderr.startswith("llmgw: no block of 100 free consecutive ports in LLMGW_UP_PORT_RANGE 9800-9899 "
                                 "(each is held, or refuses a bind); set LLMGW_UP_PORT_RANGE=START-END to a range "
                                 "with free ports, outside the kernel's ephemeral range"), run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert not (tmp_path / "state" / "logs" / "redis.log").exists()
