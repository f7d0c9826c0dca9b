"""Gateway app factory (stub until the gateway lands)."""

from flask import Flask


def create_app(config=None) -> Flask:
    app = Flask("llmgw.gateway")

    @app.get("/healthz")
    def healthz():
        return {"ok": True}

    return app
