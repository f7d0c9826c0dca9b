"""Sim engine driver: command line, environment, metric styles."""

import sys

from llmgw.catalog import MetricMapping, Model, Profile
from llmgw.engines import get_engine
from llmgw.engines.base import LaunchContext
from harness.procs import wait_until


def ctx(**profile_kw) -> LaunchContext:
    p = Profile(name="sim", engine="sim", **profile_kw)
    m = Model(name="m", aliases=["m-alias"], profiles=[p])
    return LaunchContext(replica_id="r1", model=m, profile=p, host="127.0.0.1", port=9100)


def test_command_line():
    spec = get_engine("sim").command(ctx(capacity=3, args=["--speed", "4"], env={"X": "1"}))
    assert spec.argv == (sys.executable, "-m", "simengine", "--host", "127.0.0.1", "--port", "9100",
                         "--served-model-name", "m", "m-alias", "--max-seqs", "3", "--scheduling-policy", "priority",
                         "--speed", "4")
    assert spec.env == {"X": "1"} and spec.serves_http and spec.health_path == "/health"


def test_explicit_max_seqs_in_args_wins_over_capacity():
    argv = get_engine("sim").command(ctx(capacity=3, args=["--max-seqs", "7"])).argv
    assert argv.count("--max-seqs") == 1 and argv[-2:] == ("--max-seqs", "7")


def test_no_gpu_needed_and_gpu_env_when_given():
    a = get_engine("sim")
    assert a.refusals(Profile(name="s", engine="sim")) == []
    p = Profile(name="s", engine="sim", gpu={"class": "fake"})
    c = LaunchContext(replica_id="r", model=Model(name="m", profiles=[p]), profile=p, host="h", port=1, gpus=(0, 2))
    assert a.command(c).env["CUDA_VISIBLE_DEVICES"] == "0,2"


def test_metric_style_switches_default_mapping_and_token_counters():
    a = get_engine("sim")
    vllm = Profile(name="s", engine="sim")
    llama = Profile(name="s", engine="sim", args=["--metrics-style", "llamacpp"])
    assert a.effective_metrics(vllm).running == "vllm:num_requests_running"
    assert a.effective_metrics(llama).running == "llamacpp:requests_processing"
    assert a.token_metrics(llama) == ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total")
    own = Profile(name="s", engine="sim", args=["--metrics-style=llamacpp"],
                  metrics=MetricMapping(running="llamacpp:requests_processing", waiting="llamacpp:requests_deferred"))
    assert a.effective_metrics(own).kv_usage is None


def test_bad_sim_args_are_refused_with_the_reason():
    a = get_engine("sim")
    problems = a.refusals(Profile(name="s", engine="sim", args=["--speed", "fast", "--bogus"]))
    assert [p.path for p in problems] == ["args"]
    assert "'fast' is not a number" in problems[0].reason
    problems = a.refusals(Profile(name="s", engine="sim", args=["--bogus", "1"]))
    assert [str(p) for p in problems] == ["args: unknown simengine option(s): --bogus 1"]
    assert a.refusals(Profile(name="s", engine="sim", args=["--speed", "2", "--metrics-style=llamacpp"])) == []


# --- multi-node ------------------------------------------------------------------------------------

def multi_ctx(rank: int, master_addr: str | None = "10.0.0.5", master_port: int | None = 29611) -> LaunchContext:
    p = Profile(name="sim", engine="sim", nodes=2, gpu={"class": "h100", "count": 1})
    m = Model(name="m", profiles=[p])
    return LaunchContext(replica_id="r1", model=m, profile=p, host="127.0.0.1", port=9100, gpus=(0,),
                         node="b" if rank else "a", node_rank=rank, nnodes=2, master_addr=master_addr,
                         master_port=master_port)


def test_multi_node_head_serves_http_and_members_are_headless():
    a = get_engine("sim")
    assert a.supports_multi_node
    head, member = a.command(multi_ctx(0)), a.command(multi_ctx(1))
    tail = ("--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.5", "--master-port", "29611")
    assert head.argv[-len(tail):] == tail and head.serves_http and "--headless" not in head.argv
    assert member.argv[-len(tail) - 1:] == ("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.5",
                                            "--master-port", "29611", "--headless")
    assert not member.serves_http and member.env["CUDA_VISIBLE_DEVICES"] == "0"
    # Single-node replicas get none of it.
    assert "--nnodes" not in a.command(ctx()).argv


def test_multi_node_without_head_address_is_refused_at_launch():
    from llmgw.engines.base import EngineUnavailable

    try:
        get_engine("sim").command(multi_ctx(1, master_addr=None))
    except EngineUnavailable as e:
        assert e.field == "nodes" and "no master address" in e.reason
    else:
        raise AssertionError("a member without the head's address must not launch")


def test_multi_node_profile_rules():
    from llmgw.catalog.validate import _profile_problems

    a = get_engine("sim")
    two = Profile(name="s", engine="sim", nodes=2, gpu={"class": "h100", "count": 1})
    assert a.refusals(two) == [] and _profile_problems(two, "p") == []
    # Still needs a GPU profile (the catalog's rule), and llmgw's own flags are refused in args.
    assert [p.path for p in _profile_problems(Profile(name="s", engine="sim", nodes=2), "p")] == ["p.nodes"]
    bad = a.refusals(Profile(name="s", engine="sim", args=["--headless", "--master-port=1"]))
    assert [str(p) for p in bad] == ["args: '--master-port' is set by llmgw for multi-node replicas",
                                     "args: '--headless' is set by llmgw for multi-node replicas"]


def test_simengine_multinode_flag_rules():
    from simengine.cli import check_args, multinode_problems

    assert check_args(["--join-timeout", "5"]) == []
    assert "must be at least 1" in check_args(["--nnodes", "0"])[0]
    assert multinode_problems(2, 0, False) == [] and multinode_problems(2, 1, True) == []
    assert "below --nnodes" in multinode_problems(2, 2, True)[0]
    assert "rank 0 is the head" in multinode_problems(2, 0, True)[0]
    assert "add --headless" in multinode_problems(3, 1, False)[0]


def test_rendezvous_ready_only_when_every_member_joined_and_member_exits_when_head_goes():
    import threading

    from simengine.multinode import Rendezvous, join

    lines: list[str] = []
    rv = Rendezvous("127.0.0.1", 0, 3, lines.append)
    stops = {r: threading.Event() for r in (1, 2)}
    codes: dict[int, int] = {}
    threads = {r: threading.Thread(target=lambda r=r: codes.__setitem__(
        r, join("127.0.0.1", rv.port, r, 5, stops[r], lines.append))) for r in (1, 2)}
    try:
        assert not rv.ready() and rv.waiting_for() == [1, 2]
        threads[1].start()
        wait_until(lambda: rv.waiting_for() == [2], 5, interval=0.01, what="rank 1 to join")
        assert not rv.ready()
        threads[2].start()
        wait_until(rv.ready, 5, interval=0.01, what="every rank to join")
        # A member asked to stop exits 0 and the head is not ready again until that rank rejoins.
        stops[2].set()
        threads[2].join(5)
        assert not threads[2].is_alive() and codes[2] == 0
        wait_until(lambda: rv.waiting_for() == [2], 5, interval=0.01, what="the head to notice rank 2 left")
        # The head goes away: the remaining member exits 1.
        rv.close()
        threads[1].join(5)
        assert not threads[1].is_alive() and codes[1] == 1
        assert any("closed the connection" in x or "lost the head" in x for x in lines)
    finally:
        for e in stops.values():
            e.set()
        rv.close()
        for t in threads.values():
            if t.ident is not None:  # started
                t.join(10)
    assert not any(t.is_alive() for t in threads.values()), "a member thread never exited"


def test_member_exits_1_when_it_cannot_join_in_time_and_bad_ranks_are_refused():
    import socket
    import threading

    from simengine.multinode import Rendezvous, join

    lines: list[str] = []
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert join("127.0.0.1", port, 1, 0.3, threading.Event(), lines.append) == 1
    assert "cannot join the head" in lines[-1]
    rv = Rendezvous("127.0.0.1", 0, 2, lines.append)
    try:
        assert join("127.0.0.1", rv.port, 5, 2, threading.Event(), lines.append) == 1
        assert "refused rank 5" in lines[-1] and not rv.ready()
    finally:
        rv.close()
