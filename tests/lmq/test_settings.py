"""Every setting is a flag and an environment variable: flag over environment over default."""

import argparse

import pytest

from gateway.config import GatewayConfig
from lmq.checks import check_gateway, check_worker
from lmq.cli import log_settings, parse_args
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


@pytest.mark.parametrize(
    "argv",
    [
        ["--log-level", "debug", "--log-format", "json", "serve"],
        ["serve", "--log-level", "DEBUG", "--log-format", "json"],
        ["--log-level", "INFO", "worker", "--log-level", "debug", "--log-format", "JSON"],
    ],
)
def test_log_flags_go_before_or_after_the_subcommand(argv):
    args = parse_args(argv)
    assert log_settings(args, {}) == ("DEBUG", "json")
    assert build(WorkerConfig, args, {}).log_format.lower() == "json"


def test_log_settings_read_the_environment_and_refuse_nonsense():
    args = parse_args(["gateway"])
    assert log_settings(args, {}) == ("INFO", "text")
    assert log_settings(args, {"LMQ_LOG_LEVEL": "warn", "LMQ_LOG_FORMAT": "json"}) == ("WARNING", "json")
    assert log_settings(parse_args(["gateway", "--log-level", "ERROR"]), {"LMQ_LOG_LEVEL": "DEBUG"})[0] == "ERROR"
    with pytest.raises(ValueError, match=r"LMQ_LOG_LEVEL \(--log-level\)"):
        log_settings(args, {"LMQ_LOG_LEVEL": "loud"})
    with pytest.raises(ValueError, match=r"LMQ_LOG_FORMAT \(--log-format\)"):
        log_settings(args, {"LMQ_LOG_FORMAT": "xml"})


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(dtype="bogus"), r"LMQ_DTYPE \(--dtype\) must be one of auto, float32, bfloat16, float16, not 'bogus'"),
        (dict(quant="int3"), r"LMQ_QUANT \(--quant\)"),
        (dict(cpu_steps="fast"), r"LMQ_CPU_STEPS \(--cpu-steps\) must be one of native, invariant, torch, not 'fast'"),
        (dict(kv_memory="lots"), r"LMQ_KV_MEMORY \(--kv-memory\) must be a size"),
        (dict(kv_memory="0GiB"), r"LMQ_KV_MEMORY \(--kv-memory\) must be more than 0"),
        (
            dict(model="/nonexistent/model.gguf"),
            r"LMQ_MODEL \(--model\): no such file or directory: /nonexistent/model.gguf",
        ),
        (dict(max_seqs=0), r"LMQ_MAX_SEQS \(--max-seqs\) must be at least 1"),
        (dict(metrics_port=70000), r"LMQ_METRICS_PORT \(--metrics-port\) must be between 0 and 65535"),
        (dict(log_format="xml"), r"LMQ_LOG_FORMAT"),
    ],
)
def test_worker_settings_are_checked_before_anything_starts(settings, message):
    with pytest.raises(ValueError, match=message):
        check_worker(WorkerConfig(**settings))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(port=0), r"PORT \(--port\) must be between 1 and 65535"),
        (dict(request_timeout=0.0), r"LMQ_REQUEST_TIMEOUT \(--request-timeout\) must be more than 0"),
        (
            dict(api_keys_file="/nonexistent/keys"),
            r"LMQ_API_KEYS_FILE \(--api-keys-file\): cannot read /nonexistent/keys",
        ),
        (dict(log_level="chatty"), r"LMQ_LOG_LEVEL"),
        (dict(rate_limit_tokens=-1), r"LMQ_RATE_LIMIT_TOKENS \(--rate-limit-tokens\) must be"),
        (dict(max_queue_per_key=-1), r"LMQ_MAX_QUEUE_PER_KEY \(--max-queue-per-key\) must be"),
        (dict(batch_in_flight=0), r"LMQ_BATCH_IN_FLIGHT \(--batch-in-flight\) must be"),
        (dict(batch_window_seconds=0.0), r"LMQ_BATCH_WINDOW_SECONDS \(--batch-window-seconds\) must be more than 0"),
    ],
)
def test_gateway_settings_are_checked_before_anything_starts(settings, message):
    with pytest.raises(ValueError, match=message):
        check_gateway(GatewayConfig(**settings))


def test_the_defaults_pass_the_checks():
    check_gateway(GatewayConfig())
    check_worker(WorkerConfig())


@pytest.mark.parametrize("cpu_steps", ["native", "invariant", "torch"])
def test_every_cpu_steps_mode_passes_the_checks(cpu_steps):
    check_worker(WorkerConfig(cpu_steps=cpu_steps))
