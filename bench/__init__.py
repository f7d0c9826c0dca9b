"""Benchmarks of llmgw: the gateway's hot path, routing against its peers, the control plane, the
simulator of fleets (fleetsim), each a module with a command line, run from the repository root as

    python -m bench.NAME [--help]

e.g. `python -m bench.fleetsim`, `python -m bench.routing --quick`. A few modules are helpers that the
benchmarks share and have no command line (conversations, peers, wrk, floor, litellm_peer). Real processes, ports and load
on loopback come from the top-level `harness` package; nothing here imports from tests/.
"""
