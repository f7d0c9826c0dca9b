"""Port choice: never a port a record holds or a process listens on; prefer the previous one."""

from __future__ import annotations

import socket

import pytest

from llmgw.proc.ports import can_bind
from llmgw.errors import NoFreePorts
from workers.agent.ports import choose_port


def test_lowest_free_port():
    assert choose_port((100, 105), {100, 101}, lambda p: p != 102) == 103


def test_prefers_previous_port_when_free():
    assert choose_port((100, 105), {100}, lambda p: True, prefer=104) == 104
    assert choose_port((100, 105), {104}, lambda p: True, prefer=104) == 100
    assert choose_port((100, 105), set(), lambda p: p != 104, prefer=104) == 100
    assert choose_port((100, 105), set(), lambda p: True, prefer=999) == 100


def test_exhausted_range():
    with pytest.raises(NoFreePorts) as e:
        choose_port((100, 101), {100}, lambda p: p != 101)
    # One line that says what to set (it is the failed launch's reason in the record and `llmgw up`).
    assert str(e.value).startswith("no free port in LLMGW_PORT_RANGE 100-101 ")
    assert "set LLMGW_PORT_RANGE=START-END" in str(e.value) and "\n" not in str(e.value)


def test_can_bind_sees_a_listening_socket():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert not can_bind("127.0.0.1", port)
    assert can_bind("127.0.0.1", port)
