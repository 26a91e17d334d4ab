"""The `signature` of an Anthropic `thinking` block: proof that lmq wrote that thinking.

Anthropic's clients send an answer's thinking blocks back with the conversation (tool use needs
them), each with the opaque `signature` the API gave it. lmq's is an HMAC-SHA256 over the thinking
text under the gateway's `thinking_secret` (`LMQ_THINKING_SECRET`), base64: a block that comes back
changed, or signed by someone else, is refused (400) instead of being taken for the model's own
words. Every gateway of a deployment must share the secret for a block to verify on any of them;
unset, each gateway process draws a random one (blocks then verify only where they were made, and
not after a restart).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

DOMAIN = b"lmq-thinking-v1\x00"  # keeps these MACs apart from any other use of the secret
_process_secret = secrets.token_bytes(32)


def _key(secret: str) -> bytes:
    return secret.encode() if secret else _process_secret


def sign(secret: str, thinking: str) -> str:
    mac = hmac.new(_key(secret), DOMAIN + thinking.encode(), hashlib.sha256).digest()
    return base64.b64encode(mac).decode()


def verify(secret: str, thinking: str, signature: object) -> bool:
    return isinstance(signature, str) and hmac.compare_digest(sign(secret, thinking), signature)
