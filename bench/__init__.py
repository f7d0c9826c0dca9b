"""Benchmarks of llmgw: the gateway's hot path, routing against its peers, the control plane, the
simulator of fleets (fleetsim), each a module with a command line, run from the repository root as

    python -m bench.NAME [--help]

e.g. `python -m bench.fleetsim`, `python -m bench.routing --quick`. A few modules are helpers that the
benchmarks share and have no command line: fleets (fleets and loads), traffic (bench/prefix.py's
conversations over shared system prompts and their streamed client), conversations (that traffic sized
to a fleet, and for the simulator), report (percentiles), peers, wrk, floor, litellm_peer, gpu_build and
tiny_gguf (bench.gpu_check's build and model; the check and bench.gpu_wheels, what it carries to a
lent GPU machine, are in docs/engines.md, "The GPU check"). Real
processes, ports and load on loopback come from the top-level `harness` package; nothing here imports
from tests/.
"""
