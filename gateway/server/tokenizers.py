"""The tokenizers precise prefix routing matches prompts with, loaded off the request path.

An endpoint that publishes KV events names the tokenizer its engine uses (`EndpointInfo.tokenizer`,
a hub repository); the KV events thread loads each one once (`want`), and the request path only
looks up what is loaded: until then, or when a load failed (retried every `RETRY` seconds), that
endpoint's match is predicted from what was sent instead. The simulated engine's tokenizer is built in.
A tokenizer named by an absolute path is a model directory on the engine's node, read where this
gateway can read it (one machine; elsewhere the load fails and the match is predicted).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from llmgw import surface
from llmgw.engines import tokenize_prompt
from llmgw.engines.hftokens import ChatTokenizer, TokenizerUnavailable, fetch
from llmgw.state.records import EndpointInfo
from llmgw.weights.errors import SourceInvalid
from llmgw.weights.sources import HubSource, LocalPath, parse_source

log = logging.getLogger("llmgw.gateway")

RETRY = 300.0


class Tokenizers:
    def __init__(self, environ: Mapping[str, str], load: Callable[..., ChatTokenizer] = fetch,
                 clock: Callable[[], float] = time.monotonic):
        self.environ, self._load, self._clock = environ, load, clock
        self.loaded: dict[str, ChatTokenizer] = {}
        self.failed: dict[str, tuple[float, str]] = {}  # source -> (when, why)

    def want(self, sources: Iterable[str]) -> None:
        """Load the tokenizers not loaded yet (blocking: call it off the request path)."""
        for source in sources:
            if not source or source in self.loaded:
                continue
            failed = self.failed.get(source)
            if failed is not None and self._clock() - failed[0] < RETRY:
                continue
            try:
                hub = parse_source(source)
                if isinstance(hub, LocalPath) and hub.path.startswith("/"):
                    # A model directory on the engine's node, which this gateway may share (one machine).
                    self.loaded[source] = ChatTokenizer.from_dir(Path(hub.path))
                elif not isinstance(hub, HubSource):
                    raise TokenizerUnavailable(f"{source}: not a hub repository")
                else:
                    self.loaded[source] = self._load(hub.repo, hub.revision, self.environ)
                self.failed.pop(source, None)
                log.info("precise prefix routing: loaded the tokenizer of %s", source)
            except (TokenizerUnavailable, SourceInvalid) as e:
                self.failed[source] = (self._clock(), str(e))
                log.warning("precise prefix routing: no tokenizer for %s (%s); its endpoints' matches are "
                            "predicted from what was sent (retried in %gs)", source, e, RETRY)

    def tokenize(self, endpoint: EndpointInfo, op: str, body: Mapping[str, Any]) -> list[int] | None:
        """The tokens `endpoint`'s engine makes of this request's prompt; None: not known (yet)."""
        if not endpoint.tokenizer:
            return tokenize_prompt(endpoint.engine, op, body)
        tok = self.loaded.get(endpoint.tokenizer)
        if tok is None:
            return None
        if op == surface.CHAT:
            messages = body.get("messages")
            return tok.chat(messages) if isinstance(messages, list) else None
        if op == surface.COMPLETIONS:
            return tok.prompt(body.get("prompt"))
        return None
