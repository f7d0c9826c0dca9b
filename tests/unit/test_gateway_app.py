"""The gateway's settings, its metrics in gunicorn's multiprocess mode, and Flask's own 404 and 405
answers in the OpenAI shape. The views' behaviour with fake engines is tests/integration/test_gateway_app.py."""

import pytest

from gateway.config import GatewaySettings
from llmgw.errors import ConfigError
from tests.support.gateway_app import (  # noqa: F401 - server, store: fixtures; the rest for other modules
    CHAT,
    NEVER_STALE,
    dead_url,
    endpoint,
    make_app,
    server,
    store,
    wall_clock,
)


def test_405_and_404_paths_are_openai_shaped(store):
    _, _, c = make_app(store, [])
    assert c.get(CHAT).status_code == 405 and c.get(CHAT).json["error"]["code"] == "method_not_allowed"
    assert c.get("/v1/nothing").json["error"]["code"] == "not_found"


def test_config_from_env_validates():
    cfg = GatewaySettings.from_env({"LLMGW_GATEWAY_POLICY": "round_robin", "LLMGW_GATEWAY_MAX_WAITING": "3",
                                  "LLMGW_GATEWAY_RETRIES": "1", "REDIS_URL": "redis://x:1/0"})
    assert cfg.routing.policy == "round_robin" and cfg.routing.max_waiting == 3 and cfg.retries == 1
    assert cfg.redis_url == "redis://x:1/0"
    with pytest.raises(ConfigError, match="LLMGW_GATEWAY_POLICY"):
        GatewaySettings.from_env({"LLMGW_GATEWAY_POLICY": "fastest"})
    with pytest.raises(ConfigError, match="LLMGW_GATEWAY_MAX_KV"):
        GatewaySettings.from_env({"LLMGW_GATEWAY_MAX_KV": "2"})
    with pytest.raises(ConfigError, match="LLMGW_GATEWAY_MAX_WAITING"):  # 0 would saturate every endpoint
        GatewaySettings.from_env({"LLMGW_GATEWAY_MAX_WAITING": "0"})
    with pytest.raises(ConfigError, match="LLMGW_GATEWAY_QUEUE_TIMEOUT"):
        GatewaySettings.from_env({"LLMGW_GATEWAY_QUEUE_TIMEOUT": "soon"})


def test_metrics_work_in_multiprocess_mode(tmp_path):
    """Under gunicorn with several workers, PROMETHEUS_MULTIPROC_DIR aggregates every worker's values."""
    import os
    import subprocess
    import sys

    code = (
        "from gateway.observe.metrics import Metrics\n"
        "a, b = Metrics(), Metrics()\n"
        "a.requests.labels('m', 'e', '200').inc(); b.requests.labels('m', 'e', '200').inc()\n"
        "a.redis_unavailable.set(1)\n"
        "print(a.render().decode())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert 'llmgw_gateway_requests_total{endpoint="e",model="m",status="200"} 2.0' in out.stdout
    assert "llmgw_gateway_redis_unavailable 1.0" in out.stdout


