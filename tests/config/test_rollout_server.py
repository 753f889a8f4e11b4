"""``rollout.vllm_mode`` / ``vllm_server_url`` / ``vllm_server_timeout`` (a vLLM server as the
rollout engine, docs/engines.md): their defaults leave today's colocated engine as it was, bad
values are refused naming the key, and TRL's server fields map to them."""

from __future__ import annotations

import re

import pytest

from peergrade.config import ConfigError, load_config

SERVER = [("rollout.engine", "vllm"), ("rollout.vllm_mode", "server")]


def test_defaults_are_the_colocated_engine():
    r = load_config(None).rollout
    assert (r.vllm_mode, r.vllm_server_url, r.vllm_server_timeout) == ("colocate", None, 240.0)


def test_a_server_url_and_timeout_are_taken():
    cfg = load_config(
        None,
        [
            *SERVER,
            ("rollout.vllm_server_url", "http://10.0.0.5:8000"),
            ("rollout.vllm_server_timeout", 30),
        ],
    )
    assert cfg.rollout.vllm_server_url == "http://10.0.0.5:8000"
    assert cfg.rollout.vllm_server_timeout == 30.0


@pytest.mark.parametrize(
    "overrides, names",
    [
        ([("rollout.vllm_mode", "remote")], "rollout.vllm_mode: 'remote' is not allowed"),
        ([("rollout.vllm_server_url", "localhost:8000")], "rollout.vllm_server_url must be"),
        ([("rollout.vllm_server_url", "ftp://h:1")], "rollout.vllm_server_url must be"),
        ([("rollout.vllm_server_timeout", 0)], "rollout.vllm_server_timeout must be > 0"),
        ([("harness.fn", "x.py:run")], "a harness (harness.fn) needs rollout.vllm_mode colocate"),
    ],
)
def test_bad_server_settings_are_refused_naming_the_key(overrides, names):
    with pytest.raises(ConfigError, match=re.escape(names)):
        load_config(None, SERVER + overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        [("rollout.vllm_server_url", "http://h:1")],  # the own kernel
        [("rollout.engine", "vllm"), ("rollout.vllm_server_url", "http://h:1")],  # colocate
    ],
)
def test_a_server_url_without_server_mode_is_refused(overrides):
    with pytest.raises(ConfigError, match="rollout.vllm_server_url http://h:1 is used by"):
        load_config(None, overrides)


def test_trl_server_fields_map_to_the_server_keys():
    from peergrade.api import GRPOConfig

    c = GRPOConfig(max_steps=2, use_vllm=True, vllm_mode="server", vllm_server_timeout=60)
    r = c.to_config().rollout  # no vLLM needed here: the server is another process
    assert (r.engine, r.vllm_mode, r.vllm_server_url) == ("vllm", "server", "http://127.0.0.1:8000")
    assert r.vllm_server_timeout == 60.0
    c = GRPOConfig(max_steps=2, use_vllm=True, vllm_mode="server", vllm_server_host="10.1.2.3")
    assert c.to_config().rollout.vllm_server_url == "http://10.1.2.3:8000"
    url = "http://gpu-box:9000"
    c = GRPOConfig(max_steps=2, use_vllm=True, vllm_mode="server", vllm_server_base_url=url)
    assert c.to_config().rollout.vllm_server_url == url
    off = GRPOConfig(max_steps=2, vllm_mode="server", vllm_server_port=9001).to_config()
    assert off.rollout.engine == "peergrade" and off.rollout.vllm_server_url is None
