"""The OpenAI-compatible gateway (Flask, served by gunicorn): `gunicorn 'gateway:create_app()'`.

`create_app` is imported lazily: `gunicorn -c python:gateway.gunicorn_conf` imports this package in
the master before the config sets PROMETHEUS_MULTIPROC_DIR, and prometheus_client fixes its
single- or multi-process mode when first imported, so nothing here may import it early.
"""

__all__ = ["create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from gateway.app import create_app

        return create_app
    raise AttributeError(f"module 'gateway' has no attribute {name!r}")
