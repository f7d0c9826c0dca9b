"""Processes and ports on this machine: the process table read from /proc (`proctable`) and local
TCP ports (`ports`). Shared by the node agent, `llmgw up` and the test harness."""
