"""What the gateway shows and tells: Prometheus metrics, the console's traffic counts, saturation
events, the gateway report and cold-start demand for the control plane, the fleet view, and whether
Redis answers."""
