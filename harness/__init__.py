"""Processes, ports and load for tests and benchmarks: a real local fleet on loopback.

Shared by tests/ and bench/ (neither imports the other): `procs` (processes, free ports, waiting),
`cluster` (Redis, the control plane, agents, gateways and engines started on loopback), `sentinel`
(a Sentinel-managed Redis), `loadgen` (open-loop load), `fakehub` (a loopback Hugging Face hub) and
`needs` (what a run needs that `make install` does not bring). Nothing here imports from tests/.
"""
