"""Whether a request for a model scaled to zero waits for its cold start (pure); the gateway's side
with fake engines is tests/integration/test_gateway_coldstart.py."""

from gateway.routing.admission import Shed
from gateway.routing.admission import Hold, hold, retry_after


def test_hold_is_pure():
    assert hold(180, 0, 64) == Hold(180)
    assert hold(180, 64, 64) == Shed("the model is starting and 64 requests already wait for it", 30)
    assert retry_after(2) == 1 and retry_after(60) == 10
