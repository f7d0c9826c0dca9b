"""A Hugging Face model's tokenizer and chat template, as vLLM applies them, for precise prefix routing.

vLLM turns a chat request into tokens by rendering the model's chat template (its
`tokenizer_config.json`: `chat_template`, a Jinja template, with `messages`,
`add_generation_prompt=True` and the special tokens) and encoding the text without adding special
tokens again; a completion's prompt string is encoded with them (the BOS a model wants). The gateway
does the same with the `tokenizers` library and a Jinja sandbox set up as transformers sets up its own
(trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `tojson`, `strftime_now`), so its
block hashes match the ones the engine's KV events describe.

A template the sandbox refuses, or a request it cannot render, gives None: routing then predicts the
match from what it sent, as it does for any engine it cannot tokenize for.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping

log = logging.getLogger("llmgw.tokenizer")

FILES = ("tokenizer.json", "tokenizer_config.json")
# Where transformers 4.43 and later save a chat template (save_pretrained; many hub repositories ship
# it so), instead of `chat_template` in tokenizer_config.json.
TEMPLATE_FILE = "chat_template.jinja"


class TokenizerUnavailable(RuntimeError):
    """The model's tokenizer could not be had (no tokenizer.json, a download refused, a bad template)."""


def _token_text(v: Any) -> str:
    if isinstance(v, dict):  # {"content": "<s>", ...}: an AddedToken as written by transformers
        return str(v.get("content", ""))
    return v if isinstance(v, str) else ""


def _template_text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in v if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return None


@dataclass
class ChatTokenizer:
    tokenizer: Any  # tokenizers.Tokenizer
    template: Any  # a compiled jinja2 Template, or None (chat requests then cannot be tokenized)
    special: dict[str, str]

    @classmethod
    def from_dir(cls, directory: Path) -> "ChatTokenizer":
        """The tokenizer of a model directory (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
        d = Path(directory)
        if not (d / FILES[0]).is_file():
            raise TokenizerUnavailable(f"{d}: no {FILES[0]}")
        template = d / TEMPLATE_FILE
        return cls.from_files(d / FILES[0], d / FILES[1], template if template.is_file() else None)

    @classmethod
    def from_files(cls, tokenizer_json: Path, config_json: Path | None,
                   template_file: Path | None = None) -> "ChatTokenizer":
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(tokenizer_json))
        except Exception as e:  # noqa: BLE001 - the library raises its own exception type
            raise TokenizerUnavailable(f"{tokenizer_json}: not a tokenizer ({e})") from None
        cfg: dict = {}
        if config_json is not None and config_json.exists():
            try:
                cfg = json.loads(config_json.read_text())
            except ValueError as e:
                raise TokenizerUnavailable(f"{config_json}: not JSON ({e})") from None
        special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        text = _template_text(cfg.get("chat_template"))
        if text is None and template_file is not None:
            text = template_file.read_text()
        return cls(tok, _compile(text) if text else None, special)

    def chat(self, messages: list[Any]) -> list[int] | None:
        if self.template is None:
            return None
        try:
            text = self.template.render(messages=messages, add_generation_prompt=True, **self.special)
        except Exception as e:  # noqa: BLE001 - a template raises what it likes (raise_exception)
            log.debug("chat template refused a request: %s", e)
            return None
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def prompt(self, prompt: Any) -> list[int] | None:
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True).ids
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        return None


def _compile(text: str):
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(text)
    except TemplateError as e:
        raise TokenizerUnavailable(f"the chat template does not compile: {e}") from None


def fetch(repo: str, revision: str | None, environ: Mapping[str, str]) -> ChatTokenizer:
    """The tokenizer of hub repository `repo`, downloaded into the Hugging Face cache (HF_ENDPOINT for
    a mirror, HF_TOKEN for a private repository, from the gateway's environment)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError

    kw = dict(repo_id=repo, revision=revision, endpoint=environ.get("HF_ENDPOINT") or None,
              token=environ.get("HF_TOKEN") or None)
    try:
        tok = Path(hf_hub_download(filename="tokenizer.json", **kw))
    except (EntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise TokenizerUnavailable(f"hf://{repo}: no tokenizer.json ({type(e).__name__}: {e})") from None
    try:
        cfg: Path | None = Path(hf_hub_download(filename="tokenizer_config.json", **kw))
    except (EntryNotFoundError, HfHubHTTPError, OSError):
        cfg = None
    template: Path | None = None
    if cfg is None or '"chat_template"' not in cfg.read_text(errors="replace"):
        try:
            template = Path(hf_hub_download(filename=TEMPLATE_FILE, **kw))
        except (EntryNotFoundError, HfHubHTTPError, OSError):
            template = None
    return ChatTokenizer.from_files(tok, cfg, template)
