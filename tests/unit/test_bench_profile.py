"""bench/profile_gateway.py's reading of py-spy's raw output: each function's share of the samples."""

from bench.profile_gateway import shares


def test_shares_count_a_function_once_per_stack_and_its_own_time_at_the_top(tmp_path):
    raw = tmp_path / "spy.txt"
    raw.write_text("run (a.py:1);relay (b.py:2);recv (c.py:3) 6\n"
                   "run (a.py:1);relay (b.py:9);relay (b.py:4) 2\n"
                   "run (a.py:1) 2\n"
                   "a line py-spy did not finish\n")
    out = shares(raw, top=3)
    assert out[0] == "10 samples; inclusive:"
    assert out[1:4] == ["  100.0%  run (a.py)", "   80.0%  relay (b.py)", "   60.0%  recv (c.py)"]
    assert out[4] == "self:" and out[5] == "   60.0%  recv (c.py)"
    assert set(out[6:8]) == {"   20.0%  relay (b.py)", "   20.0%  run (a.py)"}
