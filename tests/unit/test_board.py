"""The gunicorn workers' board (gateway.server.board): what one worker reads of another's running
answers and queue heads, through one shared map, as two rows of it."""

from gateway.server.board import STALE, Board


def two_rows() -> tuple[Board, Board]:
    board = Board.create(2)
    one, two = board.for_row(0), board.for_row(1)
    one.adopt(101)
    two.adopt(102)
    return one, two


def test_what_the_other_workers_say_of_a_key_joining_a_queue():
    one, two = two_rows()
    assert one.elsewhere("m", "k-light", 10.0) == (False, None)
    two.list_answer(7, "m", "ep-a", 1, "k-light", 9.0)  # running there
    assert one.elsewhere("m", "k-light", 10.0) == (True, None)
    assert one.elsewhere("m", "k-heavy", 10.0) == (False, None) == one.elsewhere("other", "k-light", 10.0)
    assert two.elsewhere("m", "k-light", 10.0) == (False, None)  # a worker's own answers are its ledger's
    two.unlist_answer(7)
    assert one.elsewhere("m", "k-light", 10.0) == (False, None)
    two.publish_head("m", "k-light", 1, 5.0, 1, 9.5, 10.0)  # waiting there
    assert one.elsewhere("m", "k-light", 10.0) == (True, None)
    assert one.elsewhere("m", "k-heavy", 10.0) == (False, 5.0)  # another key's head: its counter, as published
    assert one.elsewhere("m", "k-light", 10.0 + STALE + 1) == (False, None)  # not refreshed: its worker is gone
    two.drop_head("m")
    assert one.elsewhere("m", "k-light", 10.0) == (False, None)
    two.publish_head("m", "k-heavy", 1, -1e12 + 11.0, 1, 9.5, 10.0)  # due soon: not a counter
    assert one.elsewhere("m", "k-light", 10.0) == (False, None)
