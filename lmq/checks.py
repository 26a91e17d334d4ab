"""Settings that cannot work are refused before anything starts: a ValueError naming the setting
(its env var and flag), which the CLI prints as one line."""

from __future__ import annotations

import os

from gateway.config import GatewayConfig
from protocol.cluster_url import is_cluster_url, parse_cluster_url
from protocol.sentinel_url import is_sentinel_url, parse_sentinel_url
from worker.config import CPU_STEPS, DTYPES, QUANTS, WorkerConfig, parse_kv_memory

from .logs import check_format, check_level
from .settings import at_least, setting_name


def check_gateway(config: GatewayConfig) -> None:
    """Refuse settings that cannot work, before anything starts (ValueError naming the setting)."""
    check_level(config.log_level)
    check_format(config.log_format)
    check_redis_url(GatewayConfig, config.redis_url)
    at_least(config, "port", 1, 65535)
    for name in ("request_timeout", "pickup_timeout", "resume_timeout", "keepalive_seconds", "admission_wait"):
        if not getattr(config, name) > 0:
            raise ValueError(f"{setting_name(GatewayConfig, name)} must be more than 0, not {getattr(config, name)!r}")
    at_least(config, "max_body_bytes", 1)
    at_least(config, "max_queue", 0)
    at_least(config, "max_queue_per_key", 0)
    at_least(config, "retry_after", 0)
    at_least(config, "default_max_tokens", 1)
    at_least(config, "rate_limit_requests", 0)
    at_least(config, "rate_limit_tokens", 0)
    at_least(config, "batch_max_items", 1)
    at_least(config, "batch_max_bytes", 1)
    at_least(config, "batch_in_flight", 1)
    if not config.batch_window_seconds > 0:
        raise ValueError(
            f"{setting_name(GatewayConfig, 'batch_window_seconds')} must be more than 0, not {config.batch_window_seconds!r}"
        )
    try:
        _ = config.sampling_default_fields  # the property validates
    except ValueError as exc:
        raise ValueError(f"{setting_name(GatewayConfig, 'sampling_defaults')}: {exc}") from None
    if config.api_keys_file and not os.access(config.api_keys_file, os.R_OK):
        raise ValueError(f"{setting_name(GatewayConfig, 'api_keys_file')}: cannot read {config.api_keys_file}")


def check_worker(config: WorkerConfig) -> None:
    """Refuse settings that cannot work before the model loads (ValueError naming the setting)."""

    def name(field_name: str) -> str:
        return setting_name(WorkerConfig, field_name)

    check_level(config.log_level)
    check_format(config.log_format)
    check_redis_url(WorkerConfig, config.redis_url)
    if config.model and not os.path.exists(config.model):
        raise ValueError(f"{name('model')}: no such file or directory: {config.model}")
    if config.model and os.path.isdir(config.model) and not os.path.isfile(os.path.join(config.model, "config.json")):
        raise ValueError(
            f"{name('model')}: {config.model} is a directory without config.json (a Hugging Face model directory has it)"
        )
    if config.dtype not in DTYPES:
        raise ValueError(f"{name('dtype')} must be one of {', '.join(DTYPES)}, not {config.dtype!r}")
    if config.quant not in QUANTS:
        raise ValueError(f"{name('quant')} must be one of {', '.join(QUANTS)}, not {config.quant!r}")
    if config.cpu_steps not in CPU_STEPS:
        raise ValueError(f"{name('cpu_steps')} must be one of {', '.join(CPU_STEPS)}, not {config.cpu_steps!r}")
    try:
        kv_bytes = parse_kv_memory(config.kv_memory)
    except ValueError:
        raise ValueError(
            f"{name('kv_memory')} must be a size such as 512MiB or 4GiB, or auto, not {config.kv_memory!r}"
        ) from None
    if kv_bytes == 0:
        raise ValueError(f"{name('kv_memory')} must be more than 0")
    for field_name in ("page_size", "max_seqs", "step_tokens", "claim_idle_ms", "max_attempts"):
        at_least(config, field_name, 1)
    at_least(config, "threads", 0)
    at_least(config, "grace_seconds", 0)
    at_least(config, "metrics_port", 0, 65535)


def check_redis_url(settings_class: type, url: str) -> None:
    """A Sentinel or Cluster URL lmq cannot read (protocol/sentinel_url.py, protocol/cluster_url.py)
    is refused here; any other URL is redis-py's to read, at the start-up PING (lmq/serve.py: check_redis)."""
    parse = parse_sentinel_url if is_sentinel_url(url) else parse_cluster_url if is_cluster_url(url) else None
    if parse is not None:
        try:
            parse(url)
        except ValueError as exc:
            raise ValueError(f"{setting_name(settings_class, 'redis_url')}: {exc}") from None
