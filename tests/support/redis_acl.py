"""The Redis user that docs/deploy.md tells operators to create for lmq, read from the doc itself
so the two cannot drift: `create_lmq_user(admin_url)` makes it and returns a URL that logs in
as it."""

from __future__ import annotations

import pathlib
from urllib.parse import quote, urlsplit, urlunsplit

import redis

DEPLOY_DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "deploy.md"
PASSWORD_IN_DOC = "A_LONG_PASSWORD"
USER = "lmq"


def acl_setuser_line() -> str:
    """The one `ACL SETUSER lmq ...` line of docs/deploy.md."""
    lines = [
        line.strip() for line in DEPLOY_DOC.read_text().splitlines() if line.strip().startswith(f"ACL SETUSER {USER} ")
    ]
    assert len(lines) == 1, f"expected one ACL SETUSER {USER} line in {DEPLOY_DOC}, found {len(lines)}"
    return lines[0]


def user_url(url: str, username: str, password: str) -> str:
    """`url` (redis://host:port/db or unix:///path?db=) with a user and password in it."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{quote(username, safe='')}:{quote(password, safe='')}@{host}"))


def create_lmq_user(url: str, password: str = "lmq-test-password") -> str:
    """Runs the doc's ACL line on the server at `url` (as its admin) and returns `url` as user lmq."""
    args = acl_setuser_line().replace(PASSWORD_IN_DOC, password).split()
    with redis.Redis.from_url(url) as admin:
        admin.execute_command(*args)
    return user_url(url, USER, password)
