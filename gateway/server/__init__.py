"""The gateway process under gunicorn: how a worker boots (`boot`), the in-flight table its sibling
workers share (`siblings`), and the background loops that read Redis and report (`pollers`,
`background`). gunicorn's settings and hooks are `gateway/gunicorn_conf.py`, the file every
deployment names."""
