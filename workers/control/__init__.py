"""The control plane: reconcile, placement and publishing (docs/control-plane.md)."""
