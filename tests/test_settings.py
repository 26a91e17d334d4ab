"""Every setting is a flag and an environment variable: flag over environment over default."""

import argparse

import pytest

from gateway.config import GatewayConfig
from lmq.settings import add_flags, build
from worker.config import WorkerConfig


def parse(settings_class, argv):
    parser = argparse.ArgumentParser()
    add_flags(parser, settings_class)
    return parser.parse_args(argv)


def test_flag_beats_environment_beats_default():
    environ = {"LMQ_KV_MEMORY": "2GiB", "LMQ_MAX_SEQS": "8", "REDIS_URL": "redis://example:6379/1"}
    config = build(WorkerConfig, parse(WorkerConfig, ["--max-seqs", "4"]), environ)
    assert config.max_seqs == 4
    assert config.kv_memory == "2GiB"
    assert config.redis_url == "redis://example:6379/1"
    assert config.page_size == WorkerConfig().page_size


def test_port_reads_plain_port_and_numbers_are_parsed():
    config = build(GatewayConfig, parse(GatewayConfig, []), {"PORT": "9001", "LMQ_REQUEST_TIMEOUT": "12.5"})
    assert (config.port, config.request_timeout) == (9001, 12.5)


def test_a_malformed_environment_value_is_refused():
    with pytest.raises(ValueError, match="PORT='eighty' is not a valid int"):
        build(GatewayConfig, parse(GatewayConfig, []), {"PORT": "eighty"})
