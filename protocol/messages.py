"""The messages of the lmq protocol, version 1, with strict validation.

Requests travel in `lmq:req:<model>` (field `msg`), events on the request's reply address,
cancellations on `lmq:cancel`, heartbeats in `lmq:worker:<id>`. docs/protocol.md documents
every field; this module is the executable form of that page.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .codec import MAX_MESSAGE_BYTES, decode_map, encode, salvage_fields
from .errors import ProtocolError

VERSION = 1

MAX_ID_LENGTH = 128
MAX_MESSAGES = 1024
MAX_TEXT_CHARS = 512 * 1024
MAX_PROMPT_IDS = 128 * 1024
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 1024
MAX_TOKENS_LIMIT = 1 << 20
ROLES = ("system", "user", "assistant", "tool", "developer")
REPLY_KINDS = ("pubsub", "spubsub", "stream")  # spubsub: sharded pub/sub (Redis 7+), docs/protocol.md
PRIORITIES = ("interactive", "batch")
TASKS = ("generate", "tokenize", "detokenize")
CONSTRAINT_TYPES = ("json_object", "json_schema", "regex", "lark", "tool_calls")
MAX_TOOLS = 128
MAX_LOGPROBS = 20
# The fields that shape the distribution a token is drawn from. A request that sets any of them gets
# that distribution: the ones it leaves out are neutral, not the server's defaults (see parse_sampling).
DISTRIBUTION_FIELDS = ("temperature", "top_p", "top_k", "min_p")
NEUTRAL = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
}  # workers serve interactive work first; batch work uses spare capacity

_SAFE = re.compile(r"^[A-Za-z0-9_.:\-]+$")
# The reply addresses a producer may name inside lmq's own namespace (`lmq:`, protocol/keys.py): a
# gateway's reply channel and its own reply keys (`lmq:reply:...`), a batch item's reply stream
# (`lmq:batch:<id>:reply:<index>.<attempt>`), each with or without a shard's hash tag. Any other
# `lmq:` key is lmq's state (request streams, progress, heartbeats, ...), which a reply must not write.
LMQ_NAMESPACE = "lmq:"
_LMQ_REPLY = re.compile(r"^lmq:(\{[^{}]+\}:)?(reply:.+|batch:[A-Za-z0-9_\-]+:reply:[0-9]+\.[0-9]+)$")
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
_DIGEST = re.compile(r"^[0-9a-f]{64}$")
MAX_TEMPLATE_KWARGS = 32
_TEMPLATE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")
TEMPLATE_NAMES_SET_BY_WORKER = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "documents")
MIN_TOKEN_CHARS = 16  # a cancel token short enough to guess would protect nothing


@dataclass(frozen=True)
class SamplingParams:
    """Defaults follow llama.cpp's server: a small model sampled from its full distribution at
    temperature 1 rambles, and these keep an answer on topic while leaving it varied. They apply only
    to a request that sets none of DISTRIBUTION_FIELDS (see parse_sampling)."""

    max_tokens: int = 256
    temperature: float = 0.8  # 0 = greedy
    top_p: float = 0.95
    top_k: int = 40  # 0 = off
    min_p: float = 0.05
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass(frozen=True)
class Reply:
    """Where a request's events go: a pub/sub channel, or a Redis stream (durable, replayable)."""

    kind: str
    key: str


@dataclass(frozen=True)
class Request:
    id: str
    model: str
    reply: Reply
    sampling: SamplingParams
    deadline: float  # unix seconds; the worker drops the request with `timeout` after it
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    truncate: bool = False  # keep the most recent tokens instead of failing a too-long prompt
    trace: str | None = None  # W3C traceparent of the producer's span: the worker's spans continue its trace
    priority: str = "interactive"  # one of PRIORITIES
    task: str = "generate"  # or "tokenize" / "detokenize": answered with one `done`, nothing generated
    tools: list[dict[str, Any]] | None = None  # function definitions, given to the chat template
    constraint: dict[str, Any] | None = None  # the output must match this grammar (structured output)
    logprobs: int | None = None  # report each token's logprob and this many alternatives (0-20)
    continue_final: bool = False  # continue the last (assistant) message instead of starting a new turn
    announce: bool = False  # send a `started` event when a worker admits the request
    cancel_digest: str | None = None  # hex SHA-256 of the token a cancel must present (see cancel_digest())
    # Thinking models: the most tokens a thinking block may hold before the worker closes it (0: at once).
    reasoning_budget: int | None = None
    template_kwargs: dict[str, Any] | None = None  # extra chat-template variables, e.g. {"enable_thinking": False}

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["v"] = VERSION
        data["sampling"]["logit_bias"] = {str(k): v for k, v in self.sampling.logit_bias.items()}
        return {k: v for k, v in data.items() if v is not None}

    def encode(self) -> bytes:
        return encode(self.to_dict())


# ---------------------------------------------------------------- validation helpers


def _fail(field_name: str, problem: str) -> ProtocolError:
    return ProtocolError("bad_request", f"{field_name}: {problem}")


def _int(data: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = data.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(name, "must be an integer")
    if not lo <= value <= hi:
        raise _fail(name, f"must be between {lo} and {hi}")
    return value


def _float(data: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = data.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(name, "must be a finite number")
    if not lo <= value <= hi:
        raise _fail(name, f"must be between {lo} and {hi}")
    return float(value)


def _bool(data: dict, name: str, default: bool) -> bool:
    value = data.get(name, default)
    if not isinstance(value, bool):
        raise _fail(name, "must be true or false")
    return value


def _str(value: Any, name: str, max_chars: int) -> str:
    if not isinstance(value, str):
        raise _fail(name, "must be a string")
    if len(value) > max_chars:
        raise ProtocolError("too_large", f"{name}: longer than {max_chars} characters")
    return value


def _safe_name(value: Any, name: str) -> str:
    value = _str(value, name, MAX_ID_LENGTH)
    if not _SAFE.match(value):
        raise _fail(name, "must be 1-128 characters of letters, digits, '_', '.', ':', '-'")
    return value


def _list(value: Any, name: str, max_items: int) -> list:
    if not isinstance(value, list):
        raise _fail(name, "must be a list")
    if len(value) > max_items:
        raise ProtocolError("too_large", f"{name}: more than {max_items} items")
    return value


def _token_ids(value: Any, name: str, max_items: int) -> list[int]:
    ids = _list(value, name, max_items)
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 31 for i in ids):
        raise _fail(name, "must be a list of non-negative token ids")
    return ids


_DEFAULT = SamplingParams()


def parse_sampling(data: Any) -> SamplingParams:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise _fail("sampling", "must be a map")
    bias = data.get("logit_bias", {})
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise _fail("sampling.logit_bias", f"must be a map of at most {MAX_LOGIT_BIAS} token ids to numbers")
    logit_bias: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise _fail("sampling.logit_bias", f"key {key!r} is not a token id") from None
        if (
            not 0 <= token < 1 << 31
            or isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not -100 <= value <= 100
        ):
            raise _fail("sampling.logit_bias", "values must be numbers between -100 and 100 on token ids >= 0")
        logit_bias[token] = float(value)
    stop = _list(data.get("stop", []), "sampling.stop", MAX_STOP_STRINGS)
    for s in stop:
        _str(s, "sampling.stop", MAX_STOP_CHARS)
    if any(s == "" for s in stop):
        raise _fail("sampling.stop", "stop strings must not be empty")
    # Defaults for a request that leaves the distribution alone; neutral values beside explicit ones.
    base = NEUTRAL if any(data.get(name) is not None for name in DISTRIBUTION_FIELDS) else asdict(_DEFAULT)
    return SamplingParams(
        max_tokens=_int(data, "max_tokens", _DEFAULT.max_tokens, 1, MAX_TOKENS_LIMIT),
        temperature=_float(data, "temperature", base["temperature"], 0.0, 100.0),
        top_p=_float(data, "top_p", base["top_p"], 0.0, 1.0),
        top_k=_int(data, "top_k", base["top_k"], 0, 1 << 20),
        min_p=_float(data, "min_p", base["min_p"], 0.0, 1.0),
        seed=_int(data, "seed", None, -(1 << 63), (1 << 64) - 1),
        presence_penalty=_float(data, "presence_penalty", _DEFAULT.presence_penalty, -2.0, 2.0),
        frequency_penalty=_float(data, "frequency_penalty", _DEFAULT.frequency_penalty, -2.0, 2.0),
        repetition_penalty=_float(data, "repetition_penalty", _DEFAULT.repetition_penalty, 0.01, 10.0),
        logit_bias=logit_bias,
        stop=list(stop),
        stop_token_ids=_token_ids(data.get("stop_token_ids", []), "sampling.stop_token_ids", 64),
        ignore_eos=_bool(data, "ignore_eos", _DEFAULT.ignore_eos),
    )


def parse_reply(data: Any) -> Reply:
    if not isinstance(data, dict):
        raise _fail("reply", "must be a map with `kind` and `key`")
    kind = data.get("kind")
    if kind not in REPLY_KINDS:
        raise _fail("reply.kind", f"must be one of {', '.join(REPLY_KINDS)}")
    key = _str(data.get("key"), "reply.key", 256)
    if not key:
        raise _fail("reply.key", "must not be empty")
    if key.startswith(LMQ_NAMESPACE) and not _LMQ_REPLY.match(key):
        raise ProtocolError(
            "reply_denied",
            f"reply.key: {key!r} lies in lmq's own namespace; use a key outside `lmq:` or under `lmq:reply:` (docs/protocol.md)",
        )
    return Reply(kind=kind, key=key)


def _parse_messages(value: Any) -> list[dict[str, Any]]:
    messages = _list(value, "messages", MAX_MESSAGES)
    if not messages:
        raise _fail("messages", "must not be empty")
    parsed = [_parse_message(message, f"messages[{i}]") for i, message in enumerate(messages)]
    if sum(len(message["content"]) for message in parsed) > MAX_TEXT_CHARS:
        raise ProtocolError("too_large", f"messages: more than {MAX_TEXT_CHARS} characters in all")
    return parsed


def _parse_message(message: Any, where: str) -> dict[str, Any]:
    """`{role, content}`; an assistant message may add `tool_calls`, a tool message `tool_call_id` and `name`."""
    if not isinstance(message, dict):
        raise _fail(where, "must be a map with `role` and `content`")
    role = message.get("role")
    if role not in ROLES:
        raise _fail(f"{where}.role", f"must be one of {', '.join(ROLES)}")
    content = message.get("content")
    parsed: dict[str, Any] = {
        "role": role,
        "content": "" if content is None else _str(content, f"{where}.content", MAX_TEXT_CHARS),
    }
    if message.get("tool_calls") is not None:
        if role != "assistant":
            raise _fail(f"{where}.tool_calls", "only assistant messages carry tool calls")
        calls = _list(message["tool_calls"], f"{where}.tool_calls", MAX_TOOLS)
        parsed["tool_calls"] = [_parse_tool_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls)]
    elif content is None:
        raise _fail(f"{where}.content", "must be a string")
    for name in ("tool_call_id", "name"):
        if message.get(name) is not None:
            parsed[name] = _str(message[name], f"{where}.{name}", 256)
    return parsed


def _parse_tool_call(call: Any, where: str) -> dict[str, Any]:
    """`{id, type: "function", function: {name, arguments}}`, arguments a map (or a string the model wrote)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise _fail(where, 'must be a map `{id, type: "function", function: {name, arguments}}`')
    arguments = function.get("arguments", {})
    if not isinstance(arguments, (dict, str)):
        raise _fail(f"{where}.function.arguments", "must be a map or a string")
    return {
        "id": _str(call.get("id", ""), f"{where}.id", 256),
        "type": "function",
        "function": {"name": _str(function.get("name"), f"{where}.function.name", 256), "arguments": arguments},
    }


def _parse_tools(value: Any) -> list[dict[str, Any]] | None:
    """Function definitions as OpenAI spells them: `{type: "function", function: {name, description?, parameters?}}`."""
    if value is None:
        return None
    tools = _list(value, "tools", MAX_TOOLS)
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise _fail(f"tools[{i}]", 'must be a map `{type: "function", function: {name, description, parameters}}`')
        _str(function.get("name"), f"tools[{i}].function.name", 256)
        if not isinstance(function.get("parameters", {}), dict):
            raise _fail(f"tools[{i}].function.parameters", "must be a JSON Schema map")
    return tools


def _parse_constraint(value: Any) -> dict[str, Any] | None:
    """The grammar the output must match; the worker compiles it (and refuses one it cannot compile)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in CONSTRAINT_TYPES:
        raise _fail("constraint", f"must be a map whose `type` is one of {', '.join(CONSTRAINT_TYPES)}")
    kind = value["type"]
    needed = {
        "json_schema": ("schema", dict),
        "regex": ("pattern", str),
        "lark": ("grammar", str),
        "tool_calls": ("tools", list),
    }.get(kind)
    if needed is not None and not isinstance(value.get(needed[0]), needed[1]):
        raise _fail(f"constraint.{needed[0]}", f"a `{kind}` constraint needs `{needed[0]}` (a {needed[1].__name__})")
    if kind == "tool_calls":  # one or more calls of these tools, in the worker's tool-call format
        _parse_tools(value["tools"])
        _bool(value, "parallel", True)
    return value


def parse_request(data: dict[str, Any]) -> Request:
    """Validate a decoded request map. Errors carry the id and reply address when they could be read."""
    request_id = data.get("id")
    reply = None
    try:
        reply = parse_reply(data.get("reply"))
        request_id = _safe_name(request_id, "id")
    except ProtocolError as exc:
        exc.reply = reply
        exc.request_id = request_id if isinstance(request_id, str) else None
        raise
    try:
        return _parse_request_body(data, request_id, reply)
    except ProtocolError as exc:
        exc.request_id, exc.reply = request_id, reply
        raise


def _parse_request_body(data: dict[str, Any], request_id: str, reply: Reply) -> Request:
    version = data.get("v")
    if version != VERSION:
        raise ProtocolError(
            "unsupported_version", f"protocol version {version!r} is not supported (this worker speaks {VERSION})"
        )
    inputs = [name for name in ("messages", "prompt", "prompt_ids") if data.get(name) is not None]
    if len(inputs) != 1:
        raise _fail("input", "give exactly one of `messages`, `prompt`, `prompt_ids`")
    deadline = data.get("deadline", time.time() + 600)
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not math.isfinite(deadline):
        raise _fail("deadline", "must be unix seconds")
    return Request(
        id=request_id,
        model=_safe_name(data.get("model"), "model"),
        reply=reply,
        sampling=parse_sampling(data.get("sampling")),
        deadline=float(deadline),
        messages=_parse_messages(data["messages"]) if "messages" in inputs else None,
        prompt=_str(data["prompt"], "prompt", MAX_TEXT_CHARS) if "prompt" in inputs else None,
        prompt_ids=_token_ids(data["prompt_ids"], "prompt_ids", MAX_PROMPT_IDS) if "prompt_ids" in inputs else None,
        truncate=_bool(data, "truncate", False),
        trace=_traceparent(data.get("trace")),
        priority=_choice(data, "priority", PRIORITIES, "interactive"),
        task=_choice(data, "task", TASKS, "generate"),
        tools=_parse_tools(data.get("tools")),
        constraint=_parse_constraint(data.get("constraint")),
        logprobs=_int(data, "logprobs", None, 0, MAX_LOGPROBS),
        continue_final=_bool(data, "continue_final", False),
        announce=_bool(data, "announce", False),
        cancel_digest=_digest(data.get("cancel_digest")),
        reasoning_budget=_int(data, "reasoning_budget", None, 0, MAX_TOKENS_LIMIT),
        template_kwargs=_template_kwargs(data.get("template_kwargs")),
    )


def _template_kwargs(value: Any) -> dict[str, Any] | None:
    """Variables for the chat template beside the ones the worker sets: names, and plain values."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_TEMPLATE_KWARGS:
        raise _fail("template_kwargs", f"must be a map of at most {MAX_TEMPLATE_KWARGS} template variables")
    for name, item in value.items():
        if not isinstance(name, str) or not _TEMPLATE_NAME.match(name):
            raise _fail("template_kwargs", f"{name!r} is not a variable name (a letter, then letters, digits, _)")
        if name in TEMPLATE_NAMES_SET_BY_WORKER:
            raise _fail(f"template_kwargs.{name}", "is set by the worker")
        if not _plain(item, depth=4):
            raise _fail(f"template_kwargs.{name}", "must be nil, a bool, number or string, or lists and maps of them")
    return value


def _plain(value: Any, depth: int) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if depth == 0:
        return False
    if isinstance(value, list):
        return all(_plain(item, depth - 1) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and _plain(item, depth - 1) for key, item in value.items())
    return False


def _choice(data: dict, name: str, choices: tuple[str, ...], default: str) -> str:
    value = data.get(name, default)
    if value not in choices:
        raise _fail(name, f"must be one of {', '.join(choices)}")
    return value


def _traceparent(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _TRACEPARENT.match(value):
        raise _fail("trace", "must be a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>)")
    return value


def _digest(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _DIGEST.match(value):
        raise _fail("cancel_digest", "must be 64 lowercase hex digits (SHA-256 of the cancel token)")
    return value


def decode_request(raw: bytes) -> Request:
    """Refuses a message over MAX_MESSAGE_BYTES by its size, before unpacking it; its `id` and
    `reply` are still read (and nothing else: see codec.salvage_fields) so the refusal can be answered."""
    try:
        data = decode_map(raw)
    except ProtocolError as exc:
        if exc.code == "too_large":  # still answer it where it says to, if it can be read
            _add_address(exc, salvage_fields(raw, ("id", "reply")))
        raise
    return parse_request(data)


def _add_address(error: ProtocolError, data: dict[str, Any]) -> None:
    try:
        error.reply = parse_reply(data.get("reply"))
    except ProtocolError:
        return
    request_id = data.get("id")
    error.request_id = request_id if isinstance(request_id, str) and len(request_id) <= MAX_ID_LENGTH else None


# ---------------------------------------------------------------- events (worker → reply address)


def started_event(
    request_id: str, seq: int, prompt_tokens: int, reasoning: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A worker admitted the request (its prompt fits, its parameters are valid): generation follows.
    `reasoning` ({start, end, open}) when the answer may think: the tags around its thinking, and
    whether the prompt already opened the block (docs/protocol.md)."""
    event = {"v": VERSION, "type": "started", "id": request_id, "seq": seq, "prompt_tokens": prompt_tokens}
    if reasoning is not None:
        event["reasoning"] = reasoning
    return event


def delta_event(
    request_id: str,
    seq: int,
    text: str,
    token_ids: list[int],
    offset: int,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """New text. `offset` is the number of completion tokens streamed before this delta; `logprobs`
    (when the request asked) has one map per token id: `{token, bytes, logprob, top: [{token, bytes, logprob}]}`."""
    event = {
        "v": VERSION,
        "type": "delta",
        "id": request_id,
        "seq": seq,
        "text": text,
        "token_ids": token_ids,
        "offset": offset,
    }
    if logprobs is not None:
        event["logprobs"] = logprobs
    return event


def done_event(
    request_id: str,
    seq: int,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    stop_sequence: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The end of a generation; a tokenize/detokenize task adds `prompt_ids` / `text` as `extra`."""
    return extra | {
        "v": VERSION,
        "type": "done",
        "id": request_id,
        "seq": seq,
        "finish_reason": finish_reason,
        "stop_sequence": stop_sequence,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "cached_tokens": cached_tokens,
        },
    }


def error_event(request_id: str | None, seq: int, code: str, message: str) -> dict[str, Any]:
    return {"v": VERSION, "type": "error", "id": request_id, "seq": seq, "code": code, "message": message}


def decode_event(raw: bytes) -> dict[str, Any]:
    event = decode_map(raw)
    if event.get("type") not in ("started", "delta", "done", "error") or not isinstance(event.get("seq"), int):
        raise ProtocolError("bad_request", "not an lmq event")
    return event


# ---------------------------------------------------------------- cancellations and heartbeats


@dataclass(frozen=True)
class Cancel:
    """A cancellation: `digest` is the SHA-256 of the token it presented, None for one without a token.

    It stops only the request with this id whose `cancel_digest` is that digest: a request enqueued
    with a digest can be cancelled only by whoever holds its token, and a cancel without a token (the
    form producers sent before tokens existed) reaches only requests enqueued without a digest.
    """

    id: str
    digest: str | None = None


def cancel_digest(token: str) -> str:
    """What a request carries as `cancel_digest` for a cancel that presents `token`."""
    return hashlib.sha256(token.encode()).hexdigest()


def cancel_message(request_id: str, token: str | None = None) -> bytes:
    message: dict[str, Any] = {"v": VERSION, "id": request_id}
    if token is not None:
        message["token"] = token
    return encode(message)


def decode_cancel(raw: bytes) -> Cancel:
    data = decode_map(raw)
    request_id = _safe_name(data.get("id"), "id")
    token = data.get("token")
    if token is None:
        return Cancel(request_id)
    token = _safe_name(token, "token")
    if len(token) < MIN_TOKEN_CHARS:
        raise _fail("token", f"must be at least {MIN_TOKEN_CHARS} characters")
    return Cancel(request_id, cancel_digest(token))


@dataclass(frozen=True)
class Heartbeat:
    worker_id: str
    model: str
    capacity: int  # most sequences it runs at once
    running: int
    waiting: int
    kv_pages_used: int
    kv_pages_total: int
    time: float

    def encode(self) -> bytes:
        return encode({"v": VERSION, **asdict(self)})

    @classmethod
    def decode(cls, raw: bytes) -> Heartbeat:
        """Every field checked for its type and range: a heartbeat is read by every gateway on every
        request, so one malformed key (written by anything that can write `lmq:worker:*`) must be
        refused here, as a ProtocolError its reader can skip, not fail them all later."""
        data = decode_map(raw)
        unknown = set(data) - {"v", *HEARTBEAT_FIELDS}
        if unknown:
            raise _fail("heartbeat", f"unknown fields {sorted(unknown)}")
        if data.get("v", VERSION) != VERSION:
            raise ProtocolError("unsupported_version", f"heartbeat version {data.get('v')!r} is not {VERSION}")
        counts = {name: _required_int(data, name) for name in HEARTBEAT_FIELDS[2:-1]}
        beat_time = data.get("time")
        if isinstance(beat_time, bool) or not isinstance(beat_time, (int, float)) or not math.isfinite(beat_time):
            raise _fail("time", "must be unix seconds")
        worker_id = _safe_name(data.get("worker_id"), "worker_id")
        return cls(worker_id=worker_id, model=_safe_name(data.get("model"), "model"), time=float(beat_time), **counts)


HEARTBEAT_FIELDS = ("worker_id", "model", "capacity", "running", "waiting", "kv_pages_used", "kv_pages_total", "time")


def _required_int(data: dict, name: str) -> int:
    if name not in data:
        raise _fail(name, "is required")
    value = _int(data, name, None, 0, 1 << 62)
    assert value is not None
    return value


# ---------------------------------------------------------------- one pub/sub message per reply channel per step


def encode_event_batch(events: list[dict[str, Any]]) -> bytes:
    """A pub/sub message: all events of one worker step for one reply channel."""
    return encode({"v": VERSION, "events": events})


def decode_event_batch(raw: bytes, limit: int = MAX_MESSAGE_BYTES) -> list[dict[str, Any]]:
    """Workers keep a batch within MAX_MESSAGE_BYTES (worker/publisher.py); `limit` lets a reader
    accept a larger one from a worker older than that rule."""
    data = decode_map(raw, limit)
    events = data.get("events")
    if data.get("v") != VERSION or not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise ProtocolError("bad_request", "not an lmq event batch")
    return events
