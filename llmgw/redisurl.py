"""What a Redis URL names, read once and checked: one Redis, or a master that Sentinel watches.

    redis://[[user]:password@]host[:port][/db][?options]              one Redis (redis-py reads it)
    rediss://...                                                      the same over TLS
    unix://[[user]:password@]/path/to/redis.sock[?db=N]               one Redis on a local socket
    redis+sentinel://[[user]:password@]host:port[,host:port...]/MASTER[/DB][?options]
    rediss+sentinel://...                                             the same, TLS to the sentinels and to Redis

With Sentinel, the hosts are the sentinels (port 26379 when left out) and MASTER is the name they
watch (`sentinel monitor MASTER ...`); every llmgw process asks them where the master is on each new
connection, so it follows a failover. The password (and user) authenticate to the master and its
replicas. Options of a Sentinel URL: `sentinel_password` and `sentinel_username` when the sentinels
require their own (`requirepass` in sentinel.conf), and with TLS `ssl_cert_reqs` (none, optional,
required: the default), `ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`, `ssl_check_hostname` (1 or 0).

Pure: no Redis here. `llmgw.state.store.connect` builds the client from a `RedisTarget`, and
`celery_conf` says the same thing in Celery's words (its `sentinel://` transport). docs/store.md has
the whole story.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, quote, unquote

SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS
PLAIN_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_PORT = 26379
TLS_OPTIONS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname")
SENTINEL_OPTIONS = ("sentinel_password", "sentinel_username")
CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}

# A sentinel that does not answer is skipped for the next one: short timeouts, so a dead one costs little.
SENTINEL_SOCKET_TIMEOUT = 2.0
SENTINEL_CONNECT_TIMEOUT = 1.0


class RedisUrlInvalid(ValueError):
    """A Redis URL that names nothing llmgw can connect to; the message says why (never the password)."""


@dataclass(frozen=True)
class RedisTarget:
    """What a Redis URL names. `sentinels` is empty for one Redis (then `url` is handed to redis-py as
    it is); otherwise the master `master` is found through the sentinels."""

    url: str
    sentinels: tuple[tuple[str, int], ...] = ()
    master: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    options: dict[str, str] = field(default_factory=dict)  # TLS and sentinel options, as given

    @property
    def sentinel(self) -> bool:
        return bool(self.sentinels)

    def tls_kwargs(self) -> dict:
        """redis-py's keyword arguments for this URL's TLS (empty without TLS)."""
        if not self.tls:
            return {}
        kw: dict = {"ssl": True, "ssl_cert_reqs": CERT_REQS[self.options.get("ssl_cert_reqs", "required")]}
        for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
            if self.options.get(name):
                kw[name] = self.options[name]
        if "ssl_check_hostname" in self.options:
            kw["ssl_check_hostname"] = self.options["ssl_check_hostname"] == "1"
        return kw

    def auth_kwargs(self) -> dict:
        """The master's (and replicas') credentials."""
        return {k: v for k, v in (("username", self.username), ("password", self.password)) if v}

    def sentinel_auth_kwargs(self) -> dict:
        """The sentinels' own credentials, when they require them."""
        o = self.options
        return {k: o[f"sentinel_{k}"] for k in ("username", "password") if o.get(f"sentinel_{k}")}


def masked(url: str) -> str:
    """`url` with its password (and a sentinel password option) replaced by `***`, for messages."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority, slash, tail = rest.partition("/")
    if "@" in authority:
        userinfo, _, hosts = authority.rpartition("@")
        user, colon, _pw = userinfo.partition(":")
        authority = f"{user}:***@{hosts}" if colon else authority
    path, q, query = (slash + tail).partition("?")
    if q:
        query = "&".join(f"{k}=***" if k == "sentinel_password" else f"{k}={v}"
                         for k, v in parse_qsl(query, keep_blank_values=True))
    return f"{scheme}://{authority}{path}{q}{query}"


def parse(url: str) -> RedisTarget:
    """Read `url`; raises RedisUrlInvalid saying what is wrong with it (the password masked)."""
    scheme, sep, _ = url.partition("://")
    scheme = scheme.lower()
    if not sep or (scheme not in PLAIN_SCHEMES and scheme not in SENTINEL_SCHEMES):
        raise RedisUrlInvalid(
            f"{masked(url)!r} is not a Redis URL: expected redis://, rediss://, unix://, redis+sentinel:// "
            "or rediss+sentinel://")
    if scheme in PLAIN_SCHEMES:
        return RedisTarget(url=url, tls=scheme == "rediss")
    return _parse_sentinel(url, scheme)


def _parse_sentinel(url: str, scheme: str) -> RedisTarget:
    shown = masked(url)

    def bad(reason: str) -> RedisUrlInvalid:
        return RedisUrlInvalid(f"{shown}: {reason}; expected {scheme}://[:password@]host:port[,host:port...]"
                               "/MASTER[/DB]")

    rest = url.split("://", 1)[1]
    rest, _, query = rest.partition("?")
    if "#" in query or "#" in rest:
        raise bad("a '#' must be written %23")
    authority, slash, path = rest.partition("/")
    username = password = None
    if "@" in authority:
        userinfo, _, authority = authority.rpartition("@")
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon and pw else None
    sentinels = tuple(_host_port(h, bad) for h in authority.split(",")) if authority else ()
    if not sentinels:
        raise bad("no sentinel address")
    parts = path.split("/") if slash else []
    if parts and parts[-1] == "":  # a trailing slash
        parts.pop()
    if not parts or not parts[0]:
        raise bad("no master name (the name the sentinels monitor) after the addresses")
    if len(parts) > 2:
        raise bad(f"too many path parts {'/' + path!r}")
    master = unquote(parts[0])
    db = 0
    if len(parts) == 2:
        if not parts[1].isdigit():
            raise bad(f"the database must be a whole number, got {parts[1]!r}")
        db = int(parts[1])
    options: dict[str, str] = {}
    tls = SENTINEL_SCHEMES[scheme]
    allowed = SENTINEL_OPTIONS + (TLS_OPTIONS if tls else ())
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in allowed:
            extra = " (the TLS options need rediss+sentinel://)" if name in TLS_OPTIONS else ""
            raise bad(f"unknown option {name!r}{extra}; known: {', '.join(allowed)}")
        options[name] = value
    reqs = options.get("ssl_cert_reqs")
    if reqs is not None and reqs not in CERT_REQS:
        raise bad(f"ssl_cert_reqs must be one of {', '.join(CERT_REQS)}, got {reqs!r}")
    check = options.get("ssl_check_hostname")
    if check is not None and check not in ("0", "1"):
        raise bad(f"ssl_check_hostname must be 1 or 0, got {check!r}")
    return RedisTarget(url=url, sentinels=sentinels, master=master, db=db, username=username, password=password,
                       tls=tls, options=options)


def _host_port(text: str, bad) -> tuple[str, int]:
    text = text.strip()
    if text.startswith("["):  # [IPv6]:port
        host, close, after = text[1:].partition("]")
        if not close or not host:
            raise bad(f"unreadable address {text!r}")
        port_text = after[1:] if after.startswith(":") else ("" if not after else None)
    else:
        host, colon, port_text = text.partition(":")
        if not colon:
            port_text = ""
    if port_text is None or not host:
        raise bad(f"unreadable address {text!r}")
    if port_text == "":
        return host, SENTINEL_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise bad(f"the port of {text!r} must be a number from 1 to 65535")
    return host, int(port_text)


def check(url: str) -> str:
    """`url` if it is a Redis URL llmgw can read (a settings validator); raises ValueError otherwise."""
    parse(url)
    return url


# --- Celery's words for the same Redis -------------------------------------------------------------
def celery_conf(url: str) -> dict:
    """The Celery settings that make its broker the Redis `url` names: `broker_url`, and for Sentinel
    the `sentinel://` transport's URL list, `broker_transport_options` (`master_name`, the sentinels'
    own connection options) and, with TLS, `broker_use_ssl`. A plain URL is Celery's own business."""
    t = parse(url)
    if not t.sentinel:
        return {"broker_url": url}
    auth = ""
    if t.username or t.password:
        auth = quote(t.username or "", safe="") + (f":{quote(t.password, safe='')}" if t.password else "") + "@"
    hosts = [f"[{h}]" if ":" in h else h for h, _p in t.sentinels]
    broker_url = ";".join(f"sentinel://{auth}{h}:{p}/{t.db}" for h, (_h, p) in zip(hosts, t.sentinels))
    sentinel_kwargs: dict = {"socket_timeout": SENTINEL_SOCKET_TIMEOUT,
                             "socket_connect_timeout": SENTINEL_CONNECT_TIMEOUT,
                             **t.sentinel_auth_kwargs(), **t.tls_kwargs()}
    conf: dict = {"broker_url": broker_url,
                  "broker_transport_options": {"master_name": t.master, "sentinel_kwargs": sentinel_kwargs}}
    if t.tls:
        conf["broker_use_ssl"] = {k: v for k, v in t.tls_kwargs().items() if k != "ssl"}
    return conf


# --- writes that must not be lost ------------------------------------------------------------------
@dataclass(frozen=True)
class Durability:
    """How a write that must not be lost (a catalog apply, an API key's creation, change or revocation)
    is confirmed: the store sends WAIT on the connection that wrote it until `replicas` replicas hold
    it, at most `timeout` seconds. 0 replicas: no WAIT (one Redis has nobody to wait for)."""

    replicas: int = 0
    timeout: float = 2.0

    @classmethod
    def of(cls, url: str, replicas: int | None, timeout: float) -> "Durability":
        """`replicas` as set, else 1 for a Sentinel URL (Sentinel promotes the replica that has the most
        of the master's writes, so one acknowledgement is enough) and 0 for one Redis."""
        if replicas is None:
            replicas = 1 if parse(url).sentinel else 0
        return cls(replicas, timeout)
