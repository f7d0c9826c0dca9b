"""What a gateway process reports (the pure GatewayReport builder), the cap on open requests it
fits to its file descriptors, and their knobs; the report and /readyz of a running app are
tests/integration/test_gateway_report.py."""

from __future__ import annotations

import pytest

from gateway.config import GatewaySettings
from gateway.observe.report import EVIDENCE_WINDOW, Identity, gateway_report, report_ttl
from gateway.server.boot import FD_RESERVE, HEADROOM, connection_cap
from llmgw.state.demand_records import EndpointUse, ModelDemand

WHO = Identity("host:1", "host", 1, 100.0)


def test_report_holds_only_endpoints_with_something_to_say():
    now = 10_000.0
    r = gateway_report(
        WHO, now, 7, True,
        inflight={"busy": 2, "idle-recent": 0, "idle-old": 0, "gone-busy": 1},
        ok_at={"idle-recent": now - 30, "idle-old": now - EVIDENCE_WINDOW - 1, "busy": now - 1},
        fail_at={"failing": now - 5},
        model_inflight={"m": 3, "n": 0}, queued={"m": 4}, last_request_at={"m": now - 1, "n": now - 900})
    assert r.id == "host:1" and r.version == 7 and r.keys_loaded and r.at == now and r.started_at == 100.0
    assert r.endpoints == {
        "busy": EndpointUse(2, now - 1, None),
        "idle-recent": EndpointUse(0, now - 30, None),
        "gone-busy": EndpointUse(1, None, None),  # left the list, still in flight: must be seen
        "failing": EndpointUse(0, None, now - 5),
    }
    assert r.models == {"m": ModelDemand(3, 4, now - 1), "n": ModelDemand(0, 0, now - 900)}
    assert report_ttl(0.5) == 3.0 and report_ttl(1.0) == 6.0


@pytest.mark.parametrize("configured, fds, cap", [
    (10_000, 1_048_576, 10_000),
    (10_000, 20_000, (20_000 - FD_RESERVE - HEADROOM) // 2),
    (100, 1024, 100),
    (5_000, 1024, (1024 - FD_RESERVE - HEADROOM) // 2),
    (10, 10, 1),
])
def test_connection_cap_fits_the_fd_limit(configured, fds, cap):
    assert connection_cap(configured, fds) == cap


def test_new_knobs_are_validated():
    from llmgw.errors import ConfigError

    cfg = GatewaySettings.from_env({"LLMGW_GATEWAY_MAX_CONNECTIONS": "500", "LLMGW_GATEWAY_REPORT_INTERVAL": "0.2",
                                  "LLMGW_GATEWAY_START_WAIT": "0"})
    assert (cfg.max_connections, cfg.report_interval, cfg.start_wait) == (500, 0.2, 0)
    with pytest.raises(ConfigError, match="LLMGW_GATEWAY_MAX_CONNECTIONS"):
        GatewaySettings.from_env({"LLMGW_GATEWAY_MAX_CONNECTIONS": "0"})
