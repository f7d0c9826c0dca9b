"""Redis URLs: one Redis or a master behind Sentinel, read once, checked, and said again in Celery's words."""

from __future__ import annotations

import ssl

import pytest

from llmgw.errors import ConfigError
from llmgw.redisurl import Durability, RedisUrlInvalid, celery_conf, masked, parse
from llmgw.settings import Settings
from llmgw.state.store import connect


def test_a_sentinel_url_names_its_sentinels_master_db_and_password():
    t = parse("redis+sentinel://:p%40ss@s1:26379,s2:26380,s3/mymaster/2")
    assert t.sentinel and not t.tls
    assert t.sentinels == (("s1", 26379), ("s2", 26380), ("s3", 26379))  # 26379 when left out
    assert (t.master, t.db, t.password, t.username) == ("mymaster", 2, "p@ss", None)
    assert parse("redis+sentinel://127.0.0.1:1/m").db == 0
    assert parse("redis+sentinel://127.0.0.1:1/m/").db == 0
    assert parse("redis+sentinel://[::1]:5000,[::2]/m").sentinels == (("::1", 5000), ("::2", 26379))
    u = parse("redis+sentinel://app:pw@h:1/m?sentinel_password=s3cret&sentinel_username=watch")
    assert u.auth_kwargs() == {"username": "app", "password": "pw"}
    assert u.sentinel_auth_kwargs() == {"username": "watch", "password": "s3cret"}


def test_tls_options():
    t = parse("rediss+sentinel://h:1/m?ssl_ca_certs=/ca.crt&ssl_check_hostname=0")
    assert t.tls
    assert t.tls_kwargs() == {"ssl": True, "ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": "/ca.crt",
                              "ssl_check_hostname": False}
    assert parse("rediss+sentinel://h:1/m?ssl_cert_reqs=none").tls_kwargs()["ssl_cert_reqs"] == ssl.CERT_NONE
    assert parse("redis+sentinel://h:1/m").tls_kwargs() == {}


def test_plain_urls_are_redis_pys_own():
    for url in ("redis://:pw@h:6379/0", "rediss://h:6380/1?ssl_cert_reqs=required", "unix:///run/redis.sock?db=1",
                "REDIS://h:1/0"):
        t = parse(url)
        assert not t.sentinel and t.url == url
    assert parse("rediss://h:1/0").tls


@pytest.mark.parametrize("url,reason", [
    ("http://h:1/0", "is not a Redis URL: expected redis://, rediss://, unix://, redis+sentinel://"),
    ("h:6379", "is not a Redis URL"),
    ("redis+sentinel://:pw@/m", "no sentinel address"),
    ("redis+sentinel://:pw@h:1", "no master name"),
    ("redis+sentinel://:pw@h:1/", "no master name"),
    ("redis+sentinel://h:1/m/zero", "the database must be a whole number, got 'zero'"),
    ("redis+sentinel://h:1/m/0/x", "too many path parts"),
    ("redis+sentinel://h:port/m", "the port of 'h:port' must be a number from 1 to 65535"),
    ("redis+sentinel://h:70000/m", "must be a number from 1 to 65535"),
    ("redis+sentinel://h:1,,h2:2/m", "unreadable address ''"),
    ("redis+sentinel://[::1/m", "unreadable address"),
    ("redis+sentinel://h:1/m?ssl_ca_certs=/ca", "unknown option 'ssl_ca_certs' (the TLS options need rediss+sentinel://)"),
    ("redis+sentinel://h:1/m?socket_timeout=1", "unknown option 'socket_timeout'; known: sentinel_password"),
    ("rediss+sentinel://h:1/m?ssl_cert_reqs=maybe", "ssl_cert_reqs must be one of none, optional, required"),
    ("rediss+sentinel://h:1/m?ssl_check_hostname=yes", "ssl_check_hostname must be 1 or 0"),
])
def test_bad_urls_say_why_and_never_show_the_password(url, reason):
    with pytest.raises(RedisUrlInvalid) as e:
        parse(url)
    assert reason in str(e.value)
    assert "pw" not in str(e.value).replace("password", "")


def test_settings_refuse_a_bad_url_naming_the_variable():
    with pytest.raises(ConfigError) as e:
        Settings.from_env({"REDIS_URL": "redis+sentinel://:secret@s1:26379,s2:26379"})
    assert e.value.variable == "LLMGW_REDIS_URL"
    assert "no master name" in str(e.value) and "secret" not in str(e.value)
    assert "***" in str(e.value)


def test_masked():
    assert masked("redis+sentinel://:pw@a:1,b:2/m/0") == "redis+sentinel://:***@a:1,b:2/m/0"
    assert masked("redis+sentinel://u:pw@a:1/m?sentinel_password=x&sentinel_username=w") == \
        "redis+sentinel://u:***@a:1/m?sentinel_password=***&sentinel_username=w"
    assert masked("redis://h:1/0") == "redis://h:1/0"
    assert masked("redis://u@h:1/0") == "redis://u@h:1/0"
    assert masked("rediss://:p@ss@h:1/0") == "rediss://:***@h:1/0"


def test_celery_conf_sentinel_and_plain():
    assert celery_conf("redis://:pw@h:1/0") == {"broker_url": "redis://:pw@h:1/0"}
    conf = celery_conf("redis+sentinel://:p%40ss@s1:26379,s2:26380/mymaster/3?sentinel_password=sp")
    assert conf["broker_url"] == "sentinel://:p%40ss@s1:26379/3;sentinel://:p%40ss@s2:26380/3"
    opts = conf["broker_transport_options"]
    assert opts["master_name"] == "mymaster" and opts["sentinel_kwargs"]["password"] == "sp"
    assert "broker_use_ssl" not in conf
    tls = celery_conf("rediss+sentinel://s1:1/m?ssl_ca_certs=/ca.crt")
    assert tls["broker_use_ssl"] == {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": "/ca.crt"}
    assert tls["broker_transport_options"]["sentinel_kwargs"]["ssl"] is True


def test_the_celery_app_and_the_kicker_use_the_sentinel_transport():
    from llmgw.settings import ControlSettings
    from llmgw.state.kicks import broker_app
    from workers.celery_app import create_celery_app

    url = "redis+sentinel://:pw@s1:26379,s2:26379/mymaster/0"
    app = create_celery_app(ControlSettings(redis_url=url))
    assert app.conf.broker_url.startswith("sentinel://:pw@s1:26379/0;")
    assert app.conf.broker_transport_options["master_name"] == "mymaster"
    assert app.conf.broker_transport_options["visibility_timeout"] == 300
    kick = broker_app(url)
    assert kick.conf.broker_url == app.conf.broker_url
    assert kick.conf.broker_transport_options["master_name"] == "mymaster"


def test_durability_defaults_by_url():
    assert Durability.of("redis+sentinel://h:1/m", None, 2.0) == Durability(1, 2.0)
    assert Durability.of("redis://h:1/0", None, 2.0) == Durability(0, 2.0)
    assert Durability.of("redis://h:1/0", 2, 0.5) == Durability(2, 0.5)
    assert Durability.of("redis+sentinel://h:1/m", 0, 2.0) == Durability(0, 2.0)
    s = Settings.from_env({"REDIS_URL": "redis+sentinel://h:1/m", "LLMGW_REDIS_WAIT_TIMEOUT": "0.5"})
    assert s.durability == Durability(1, 0.5)


def test_connect_through_sentinel_follows_the_master_and_closes_the_sentinels_too():
    r = connect("rediss+sentinel://u:pw@127.0.0.1:1,127.0.0.2:2/mymaster/4?ssl_ca_certs=/ca.crt&sentinel_password=sp")
    pool = r.connection_pool
    assert pool.service_name == "mymaster" and pool.is_master
    assert pool.connection_class.__name__ == "SentinelManagedSSLConnection"
    kw = pool.connection_kwargs
    assert (kw["db"], kw["username"], kw["password"], kw["ssl_ca_certs"]) == (4, "u", "pw", "/ca.crt")
    sentinels = pool.sentinel_manager.sentinels
    assert [s.connection_pool.connection_kwargs["port"] for s in sentinels] == [1, 2]
    assert sentinels[0].connection_pool.connection_kwargs["password"] == "sp"
    closed = []
    for s in sentinels:
        s.close = lambda s=s: closed.append(s)
    r.close()
    assert closed == sentinels
    with pytest.raises(ValueError):
        connect("redis+sentinel://h:1")
