"""The OpenAI-compatible gateway (Flask, served by gunicorn): `gunicorn 'gateway:create_app()'`."""

from gateway.app import create_app

__all__ = ["create_app"]
