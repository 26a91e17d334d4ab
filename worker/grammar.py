"""Constrained decoding: a grammar decides, token by token, which tokens a sequence may sample next.

The engine is llguidance (docs/dev/measurements.md, "Constrained decoding", says why: a per-token cost
like the other engines', a context-free grammar with JSON Schema inside, schemas compiled in
milliseconds, one small wheel with no dependencies). This module is the only one that talks to it:

- `GrammarCompiler`, one per model: the model's token bytes (worker/token_bytes.py) and its stop
  tokens, and an LRU of compiled grammars keyed by the canonical JSON of the constraint;
- `GrammarMatcher`, one per sequence: the grammar's state after the tokens so far;
- `apply_token_masks`: the batched step, one bitmask [rows, ceil(V/32)] for all constrained rows,
  turned into a 0/-inf bias on the logits' device and added.

A constraint is a plain dict, as the protocol carries it:

    {"type": "json_object"}                       any JSON object
    {"type": "json_schema", "schema": {...}}      JSON that validates against the schema
    {"type": "regex", "pattern": "..."}           text the (Rust-syntax) regex matches in full
    {"type": "lark", "grammar": "..."}            llguidance's Lark dialect; `%json {...}` embeds a
                                                  schema as a rule (see `lark_json`)
    {"type": "tool_calls", "tools": [...],        one tool call in the Hermes format (worker/chat_render.py),
     "parallel": true}                            or several; a call repeating an earlier one ends the
                                                  output (worker/tool_call_repeats.py)

A bad schema or grammar raises ValueError with llguidance's explanation. EOS (the model's stop
tokens) is allowed only where the grammar may end; a grammar that can go no further (the closing
`}` of a JSON document) is finished without waiting for EOS.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import llguidance
import torch
from tokenizers import Tokenizer

from worker.token_bytes import special_ids, token_bytes
from worker.tool_call_repeats import RepeatWatch

__all__ = ["GrammarCompiler", "GrammarMatcher", "JSON_OPTIONS", "apply_token_masks", "lark_json"]

# JSON whitespace is free by default, and a small model then may emit newlines or spaces until
# max_tokens. Each gap between tokens of the JSON may hold nothing, one space, or one line break
# and an indent of up to 24: compact, `{"a": 1}` and pretty-printed JSON (indent 4 to depth 6) fit.
JSON_OPTIONS = {"whitespace_pattern": r"(\r?\n[\x20\x09]{0,24}|\x20)?"}
CONSTRAINT_KEYS = {"json_object": set(), "json_schema": {"schema"}, "regex": {"pattern"}, "lark": {"grammar"}}
COMPILED_GRAMMARS = 128
MARKER = b"\xff"  # llguidance marks special tokens with this leading byte (never valid UTF-8)


def lark_json(schema: dict) -> str:
    """A Lark rule body for JSON that validates against `schema`, with the same whitespace bound as
    json_schema constraints: `call: ` + lark_json(schema)."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def canonical(constraint: dict) -> str:
    """The cache key. Keys keep their order: llguidance emits object properties in schema order,
    so two schemas that differ only in order are different grammars."""
    try:
        return json.dumps(constraint, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"the constraint is not plain JSON: {error}") from None


def grammar_source(constraint: dict) -> str:
    """The llguidance grammar for a constraint dict (not yet checked: `GrammarCompiler` does that)."""
    if not isinstance(constraint, dict):
        raise ValueError("a constraint is an object with a 'type'")
    kind = constraint.get("type")
    if kind == "tool_calls":  # the format is the chat renderer's, which shows the model the tools
        from worker.chat_render import tool_calls_grammar

        return grammar_source(tool_calls_grammar(constraint["tools"], constraint.get("parallel", True)))
    if kind not in CONSTRAINT_KEYS:
        raise ValueError(f"constraint type must be one of {sorted(CONSTRAINT_KEYS)} or tool_calls, not {kind!r}")
    extra = set(constraint) - CONSTRAINT_KEYS[kind] - {"type"}
    missing = CONSTRAINT_KEYS[kind] - set(constraint)
    if extra or missing:
        raise ValueError(f"a {kind} constraint has exactly the keys {sorted(CONSTRAINT_KEYS[kind] | {'type'})}")
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind == "json_schema":
        schema = constraint["schema"]
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema is an object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    text = constraint["pattern" if kind == "regex" else "grammar"]
    if not isinstance(text, str):
        raise ValueError(f"a {kind} constraint's source is a string")
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    return llguidance.LLMatcher.grammar_from_lark(text)


class GrammarCompiler:
    """One model's grammars: its vocabulary as llguidance sees it, and compiled grammars (LRU)."""

    def __init__(self, tokenizer: Tokenizer, *, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.token_bytes = token_bytes(tokenizer)
        self.llg_tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_Vocabulary(tokenizer, vocab_size, self.stop_token_ids))
        )
        self._compiled: OrderedDict[str, llguidance.LLMatcher | ValueError] = OrderedDict()
        self._lock = threading.Lock()
        self._bitmask: torch.Tensor | None = None  # reused host buffer (pinned when CUDA is there)

    def check(self, constraint: dict) -> None:
        """Compile the constraint (or find it compiled); ValueError if it is not a usable grammar."""
        self._pristine(constraint)

    def matcher(self, constraint: dict, replay: Sequence[int] = ()) -> GrammarMatcher:
        """A fresh matcher for one sequence, advanced over `replay` (tokens an earlier run generated)."""
        watch = RepeatWatch(self.token_bytes) if constraint.get("type") == "tool_calls" else None
        matcher = GrammarMatcher(self, self._pristine(constraint).deep_copy(), watch)
        for token in replay:
            if not matcher.consume(token):
                break
        return matcher

    def _pristine(self, constraint: dict) -> llguidance.LLMatcher:
        key = canonical(constraint)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
        if compiled is None:
            compiled = self._compile(constraint)
            with self._lock:
                self._compiled[key] = compiled
                while len(self._compiled) > COMPILED_GRAMMARS:
                    self._compiled.popitem(last=False)
        if isinstance(compiled, ValueError):  # bad constraints are remembered too: a retry costs nothing
            raise ValueError(str(compiled))
        return compiled

    def _compile(self, constraint: dict) -> llguidance.LLMatcher | ValueError:
        try:
            source = grammar_source(constraint)
        except ValueError as error:
            return ValueError(f"invalid constraint: {error}")
        matcher = llguidance.LLMatcher(self.llg_tokenizer, source, log_level=0)
        if matcher.is_error():
            return ValueError(f"invalid {constraint['type']} constraint: {matcher.get_error().strip()}")
        return matcher

    def bitmask(self, rows: int) -> torch.Tensor:
        """A host int32 buffer [rows, ceil(V/32)], all tokens allowed (reused: one step at a time)."""
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            words = (self.vocab_size + 31) // 32
            self._bitmask = torch.empty(max(rows, 16), words, dtype=torch.int32, pin_memory=torch.cuda.is_available())
        bitmask = self._bitmask[:rows]
        bitmask.fill_(-1)
        return bitmask


class GrammarMatcher:
    """One sequence's place in its grammar."""

    def __init__(
        self, compiler: GrammarCompiler, matcher: llguidance.LLMatcher, repeats: RepeatWatch | None = None
    ) -> None:
        self.compiler = compiler
        self._matcher = matcher
        self._repeats = repeats  # tool calls: a repeated call ends the output

    def consume(self, token_id: int) -> bool:
        """Advance over a sampled token; False (and `error` set) if the grammar forbids it."""
        if self._repeats is not None:
            self._repeats.push(token_id)
        return self._matcher.consume_token(token_id)

    @property
    def finished(self) -> bool:
        """Complete: nothing can follow (the stop token, if one was sampled, is consumed), or a tool
        call just repeated an earlier one."""
        repeated = self._repeats is not None and self._repeats.repeated
        return (repeated or self._matcher.is_stopped()) and not self._matcher.is_error()

    @property
    def error(self) -> str | None:
        if not self._matcher.is_error():
            return None
        return self._matcher.get_error() or "the grammar allows no further token"


@dataclass
class _Vocabulary:
    """What llguidance.TokenizerWrapper reads: token bytes (special ones marked), stop tokens, encode."""

    tokenizer: Tokenizer
    vocab_size: int
    stop_token_ids: list[int]

    def __post_init__(self) -> None:
        table = token_bytes(self.tokenizer)
        specials = special_ids(self.tokenizer) | set(self.stop_token_ids)
        tokens = []
        for token_id in range(self.vocab_size):
            raw = table[token_id] if token_id < len(table) else b""  # ids past the tokenizer: never allowed
            if token_id in specials:
                raw = MARKER + raw
            elif raw.startswith(MARKER):
                raw = b""  # a lone 0xFF byte cannot occur in UTF-8 text; unmarked it would read as special
            tokens.append(raw)
        self.tokens = tokens
        self.special_token_ids = sorted(i for i in specials if i < self.vocab_size)
        self.eos_token_id = self.stop_token_ids[0] if self.stop_token_ids else None
        self.bos_token_id = None

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self.tokenizer.encode(text, add_special_tokens=False).ids


_byte_tables: dict[torch.device, torch.Tensor] = {}


def apply_token_masks(logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[GrammarMatcher]) -> None:
    """Forbid, in logits [S, V] (in place), every token the grammar of rows[i] does not allow next.

    One bitmask for all rows, filled row by row in this thread (a JSON row takes some 10-20 µs;
    llguidance's thread pool was slower at 16 rows, and its threads wait for a core when the
    model's threads hold them: docs/benchmarks.md). It travels packed (V/8 bytes a row) to the
    logits' device and becomes an additive bias there, 0 where allowed and -inf where not (x + 0
    is x and x + -inf is -inf, exactly). A matcher in error gets no mask: the engine fails its
    sequence after the step.
    """
    bitmask = matchers[0].compiler.bitmask(len(rows))
    row_bytes = bitmask.shape[1] * bitmask.element_size()
    for index, matcher in enumerate(matchers):
        if matcher.error is None:  # llguidance.torch.fill_next_token_bitmask, without its torch.compile import
            matcher._matcher.unsafe_compute_mask_ptr(bitmask[index].data_ptr(), row_bytes)
        if matcher.error is not None:  # in error before, or since computing its mask
            bitmask[index].fill_(-1)
    bias = mask_bias(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
    if len(rows) == logits.shape[0]:
        logits.add_(bias)
    else:
        logits.index_add_(0, torch.tensor(list(rows), dtype=torch.int64, device=logits.device), bias)


def mask_bias(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bitmask [R, W] int32 (token i is bit i % 32 of word i // 32) → bias [R, vocab]: 0 or -inf.

    Each byte of the mask picks a row of 8 biases from a 256-row table: a gather of V/8 rows, several
    times faster on a CPU than unpacking bits and `masked_fill` (not vectorized there)."""
    table = _byte_tables.get(words.device)
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1  # bit b of byte value v: token 8k + b
        table = torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf")).to(words.device)
        _byte_tables[words.device] = table
    byte_values = words.contiguous().view(torch.uint8).reshape(-1).to(torch.int32)  # little-endian words
    return table.index_select(0, byte_values).view(words.shape[0], -1)[:, :vocab]
