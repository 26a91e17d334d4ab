"""A start that cannot succeed ends soon with one line on stderr naming the problem, no
traceback, and a non-zero exit; `lmq serve` also ends when a part of it dies. The real CLI, as
subprocesses."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest
import redis

from lmq.redis_server import EmbeddedRedis, free_tcp_port
from lmq.serve import FatalError, check_redis
from protocol import CANCEL_CHANNEL, gateway_reply_channel
from tests.support.process_logs import wait_for_line
from tests.support.redis_acl import create_lmq_user, user_url

EXIT_WITHIN_S = 30
ROOT = pathlib.Path(__file__).resolve().parents[2]


def clean_environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMQ_") and k not in ("REDIS_URL", "PORT")}
    return {**env, **extra}


def lmq(args: list[str], cwd: pathlib.Path, timeout: float = EXIT_WITHIN_S, **env: str) -> subprocess.CompletedProcess:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "lmq", *args],
        cwd=cwd,
        env=clean_environment(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    result.seconds = time.monotonic() - started
    return result


def assert_fails_with(result: subprocess.CompletedProcess, *words: str) -> str:
    """Non-zero, no traceback, and the last line of stderr names the problem; returns that line."""
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("lmq: error: "), result.stderr
    for word in words:
        assert word in last, last
    return last


@pytest.fixture
def workdir(tmp_path: pathlib.Path) -> pathlib.Path:
    yield tmp_path
    assert not (tmp_path / ".lmq").exists(), "lmq serve must not litter the working directory"


# ---------------------------------------------------------------- settings: refused before anything starts


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"LMQ_MODEL": "/nonexistent/model.gguf"}, ["LMQ_MODEL", "/nonexistent/model.gguf"]),
        ({"LMQ_DTYPE": "bogus"}, ["LMQ_DTYPE", "bogus"]),
        ({"LMQ_QUANT": "bogus"}, ["LMQ_QUANT", "bogus"]),
        ({"LMQ_KV_MEMORY": "lots"}, ["LMQ_KV_MEMORY", "lots"]),
        ({"LMQ_LOG_LEVEL": "chatty"}, ["LMQ_LOG_LEVEL", "chatty"]),
        ({"LMQ_LOG_FORMAT": "xml"}, ["LMQ_LOG_FORMAT", "xml"]),
        ({"PORT": "eighty"}, ["PORT", "eighty"]),
    ],
    ids=["model", "dtype", "quant", "kv-memory", "log-level", "log-format", "port"],
)
def test_serve_refuses_a_bad_setting_at_once(workdir: pathlib.Path, env: dict[str, str], words: list[str]) -> None:
    result = lmq(["serve"], workdir, **{"PORT": str(free_tcp_port()), **env})
    assert_fails_with(result, *words)
    assert "listening" not in result.stdout and "embedded Redis" not in result.stdout, "refused before anything started"


def test_a_model_directory_without_config_is_refused(workdir: pathlib.Path) -> None:
    assert_fails_with(lmq(["worker", "--model", str(workdir)], workdir), "LMQ_MODEL", "config.json")


def test_a_flag_after_the_subcommand_is_checked_too(workdir: pathlib.Path) -> None:
    assert_fails_with(lmq(["gateway", "--log-level", "LOUD"], workdir), "--log-level", "LOUD")


def test_a_model_that_fails_to_load_stops_serve(workdir: pathlib.Path) -> None:
    broken = workdir / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    result = lmq(["serve", "--port", str(free_tcp_port())], workdir, LMQ_MODEL=str(broken))
    assert_fails_with(result, "cannot load the model", str(broken))


def test_a_kv_cache_too_large_for_the_machine(workdir: pathlib.Path, tiny_model_dir: pathlib.Path) -> None:
    env = dict(
        LMQ_MODEL=str(tiny_model_dir), LMQ_DTYPE="float32", LMQ_QUANT="none", LMQ_KV_MEMORY="1000TiB"
    )  # > 2^47 bytes
    result = lmq(["serve", "--port", str(free_tcp_port())], workdir, **env)
    assert_fails_with(result, "out of memory", "LMQ_KV_MEMORY")


# ---------------------------------------------------------------- Redis


@pytest.mark.parametrize("command", ["serve", "gateway", "worker"])
def test_a_redis_where_nothing_listens(workdir: pathlib.Path, command: str) -> None:
    url = f"redis://127.0.0.1:{free_tcp_port()}/0"
    result = lmq([command], workdir, REDIS_URL=url, PORT=str(free_tcp_port()))
    assert_fails_with(result, "cannot reach Redis", url)


@pytest.fixture(scope="module")
def locked_redis():
    """A Redis with a password, the ACL user of docs/deploy.md and a user that may only PING."""
    with EmbeddedRedis(port=free_tcp_port()) as server:
        lmq_user = create_lmq_user(server.url)
        with redis.Redis.from_url(server.url) as admin:
            admin.execute_command("ACL", "SETUSER", "pinger", "on", ">pw", "+ping", "~*")
            admin.config_set("requirepass", "secret")
        yield server.url, lmq_user


@pytest.mark.parametrize("command", ["serve", "gateway", "worker"])
def test_an_unauthorised_redis(workdir: pathlib.Path, locked_redis, command: str) -> None:
    url, lmq_user = locked_redis
    port = str(free_tcp_port())
    wrong = user_url(url, "", "wrong")
    last = assert_fails_with(lmq([command], workdir, REDIS_URL=wrong, PORT=port), "refused the login")
    assert "wrong" not in last, "the password is not shown"
    assert_fails_with(lmq([command], workdir, REDIS_URL=user_url(url, "lmq", "wrong"), PORT=port), "refused the login")
    assert_fails_with(lmq([command], workdir, REDIS_URL=url, PORT=port), "needs a password")
    assert_fails_with(
        lmq([command], workdir, REDIS_URL=user_url(url, "pinger", "pw"), PORT=port), "permission", "subscribe"
    )


def test_the_documented_acl_user_passes_the_check(locked_redis) -> None:
    _, lmq_user = locked_redis
    check_redis(lmq_user, (gateway_reply_channel("g1"), CANCEL_CHANNEL))
    with pytest.raises(FatalError, match="permission"):
        check_redis(lmq_user, ("elsewhere:channel",))


# ---------------------------------------------------------------- the port


def test_a_port_in_use(workdir: pathlib.Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = lmq(["serve", "--port", str(port)], workdir)
        assert_fails_with(result, f"127.0.0.1:{port}", "in use")
        assert "gateway listening" not in result.stdout, "printed only once the port is bound"


# ---------------------------------------------------------------- a part of `lmq serve` dies


def test_serve_exits_when_its_redis_dies(workdir: pathlib.Path, tmp_path_factory, tiny_model_dir: pathlib.Path) -> None:
    env = clean_environment(LMQ_MODEL=str(tiny_model_dir), LMQ_DTYPE="float32", LMQ_QUANT="none", LMQ_KV_MEMORY="4MiB")
    logs = tmp_path_factory.mktemp("logs")
    with (logs / "out").open("w") as out, (logs / "err").open("w") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "lmq", "serve", "--port", str(free_tcp_port())],
            cwd=workdir,
            env=env,
            stdout=out,
            stderr=err,
        )
    try:
        lines = wait_for_line(logs / "out", process, "lmq: ready", timeout=120)
        url = next(line.split(" at ", 1)[1].strip() for line in lines if "embedded Redis" in line)
        os.kill(redis.Redis.from_url(url).info("server")["process_id"], signal.SIGKILL)
        assert process.wait(timeout=EXIT_WITHIN_S) != 0
        stderr = (logs / "err").read_text()
        assert "Traceback" not in stderr
        assert stderr.strip().splitlines()[-1].startswith("lmq: error: the embedded Redis stopped"), stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
