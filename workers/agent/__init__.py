"""The node agent: turns the replica records placed on this node into supervised engine processes.

See docs/agent.md. `step.AgentStep` starts it inside a node worker; `loop.Agent` is the loop;
`supervisor.decide` holds its rules.
"""
