"""The whole system on one machine (`llmgw up`, the Procfile): the process stack (`localstack`) and
the embedded Redis (`embedded_redis`)."""
