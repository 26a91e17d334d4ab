"""Constrained decoding (worker/grammar.py) and token bytes (worker/token_bytes.py).

Whatever the sampling settings, a constrained sequence that finishes is valid: JSON that parses and
validates against its schema (checked by `jsonschema`, not by the grammar engine), text its regex
matches in full, a tool call in its Lark format. The tiny model's random weights make it a harsh
test: it picks tokens no trained model would.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import llguidance
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models

from protocol import SamplingParams
from tests.support.engine_runs import generate, greedy
from worker.engine import Engine, GenRequest
from worker.grammar import GrammarCompiler, apply_token_masks, lark_json
from worker.model.loader import LoadedModel, load_model
from worker.sampler import SamplingState, sample
from worker.token_bytes import token_bytes, token_text

PAGE = 4

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
PETS = {
    "type": "object",
    "properties": {
        "pets": {
            "type": "array",
            "minItems": 1,
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "kind": {"enum": ["cat", "dog"]},
                    "legs": {"type": "integer", "minimum": 0, "maximum": 4},
                },
                "required": ["kind", "legs"],
                "additionalProperties": False,
            },
        },
        "owner": {"type": ["string", "null"], "maxLength": 6},
    },
    "required": ["pets", "owner"],
    "additionalProperties": False,
}
SCHEMAS = [PERSON, PETS]


@pytest.fixture(scope="module")
def model(tiny: LoadedModel) -> LoadedModel:
    return tiny


@pytest.fixture(scope="module")
def compiler(model: LoadedModel) -> GrammarCompiler:
    return GrammarCompiler(model.tokenizer, vocab_size=model.config.vocab_size, stop_token_ids=model.stop_token_ids)


def prompt(model: LoadedModel, text: str = "The user asks") -> list[int]:
    return model.tokenizer.encode(text, add_special_tokens=False).ids


def no_whitespace_runs(model: LoadedModel) -> dict[int, float]:
    """A bias against tokens that are only whitespace. A random model otherwise fills every gap
    the JSON grammar allows and rarely finishes within the tiny context; what the grammar allows
    does not depend on the bias, so the property tested is the same. The bias all but forbids them:
    at -8, temperature 1.6 (seed 28256440, top_p 0.9) still wrote tabs until max_tokens."""
    table = token_bytes(model.tokenizer)
    return {token: -100.0 for token, raw in enumerate(table) if raw and not raw.strip()}


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "schema": schema}


def assert_valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


# ------------------------------------------------------------ token bytes


def test_token_bytes_spell_the_text_of_byte_level_tokens(model: LoadedModel) -> None:
    text = "Unicode: Ünïcödé ✓ 日本語 🙂 and\nnew lines"
    ids = prompt(model, text)
    table = token_bytes(model.tokenizer)
    assert b"".join(table[token] for token in ids) == text.encode()
    assert any(
        table[token].decode("utf-8", errors="replace") != table[token].decode("utf-8", errors="ignore") for token in ids
    )
    assert token_text(model.tokenizer, model.tokenizer.token_to_id("<|im_end|>")) == "<|im_end|>"
    assert token_text(model.tokenizer, len(table) + 5) == ""


def test_token_bytes_agree_with_llguidance_reading_of_the_tokenizer(model: LoadedModel) -> None:
    own = token_bytes(model.tokenizer)
    theirs = llguidance.LLTokenizer(model.tokenizer.to_str(), n_vocab=len(own))
    # llguidance drops a lone 0xFF byte (its marker for special tokens); the bytes are still 0xFF.
    assert [raw if raw != b"\xff" else b"" for raw in own] == [
        theirs.decode_bytes([token]) for token in range(len(own))
    ]


def test_token_bytes_of_a_sentencepiece_vocabulary() -> None:
    vocab = {"<unk>": 0, "<s>": 1, "<0x0A>": 2, "<0xE2>": 3, "▁hello": 4, "▁": 5, "world": 6, "é": 7}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    assert token_bytes(tokenizer) == [b"<unk>", b"<s>", b"\n", b"\xe2", b" hello", b" ", b"world", "é".encode()]
    assert token_text(tokenizer, 3) == "\ufffd"


# ------------------------------------------------------------ compiling constraints


@pytest.mark.parametrize(
    "constraint, message",
    [
        ({"type": "yaml"}, "constraint type must be one of"),
        ({"type": "json_schema"}, "exactly the keys"),
        ({"type": "json_object", "schema": {}}, "exactly the keys"),
        ({"type": "json_schema", "schema": "{}"}, "a JSON schema is an object"),
        (json_schema({"type": "strnig"}), "strnig"),
        (json_schema({"type": "string", "minLength": 5, "maxLength": 2}), "minLength"),
        (json_schema({"type": "object", "properties": {"a": False}, "required": ["a"]}), "unsatisfiable"),
        (json_schema({"not": {"type": "string"}}), "not"),
        ({"type": "regex", "pattern": "(unclosed"}, "unclosed group"),
        ({"type": "regex", "pattern": 5}, "string"),
        ({"type": "lark", "grammar": "start: missing_rule"}, "missing_rule"),
        ({"type": "json_schema", "schema": {"const": float("nan")}}, "not plain JSON"),
    ],
)
def test_a_bad_constraint_is_a_value_error_that_says_why(
    compiler: GrammarCompiler, constraint: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        compiler.check(constraint)
    with pytest.raises(ValueError, match=re.escape(message)):  # remembered, same answer
        compiler.check(constraint)


def test_a_bad_constraint_is_refused_before_it_is_queued(model: LoadedModel) -> None:
    engine = Engine(model, on_step=lambda outputs: None, page_size=PAGE)
    with pytest.raises(ValueError, match="strnig"):
        engine.add(GenRequest("bad", prompt(model), greedy(), constraint=json_schema({"type": "strnig"})))
    with pytest.raises(ValueError, match="logprobs"):
        engine.add(GenRequest("many", prompt(model), greedy(), logprobs=21))
    assert engine.stats.waiting == 0
    engine.add(GenRequest("bad", prompt(model), greedy(), constraint={"type": "json_object"}))  # the id is free
    assert engine.stats.waiting == 1


def test_compiled_grammars_are_cached_by_content_and_property_order(compiler: GrammarCompiler) -> None:
    first = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    }
    swapped = {
        "type": "object",
        "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}},
        "required": ["a", "b"],
    }
    assert compiler._pristine(json_schema(first)) is compiler._pristine(json_schema(json.loads(json.dumps(first))))
    assert compiler._pristine(json_schema(first)) is not compiler._pristine(json_schema(swapped))


# ------------------------------------------------------------ the mask in the sampler


def allowed_next(compiler: GrammarCompiler, matcher, vocab: int) -> set[int]:
    logits = torch.zeros(1, vocab)
    apply_token_masks(logits, [0], [matcher])
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def test_the_mask_allows_exactly_the_tokens_that_continue_the_grammar(
    model: LoadedModel, compiler: GrammarCompiler
) -> None:
    vocab = model.config.vocab_size
    table = token_bytes(model.tokenizer)
    matcher = compiler.matcher({"type": "regex", "pattern": "(yes|no)!"})
    expected = {t for t, raw in enumerate(table) if raw and any(w.startswith(raw) for w in (b"yes!", b"no!"))}
    assert allowed_next(compiler, matcher, vocab) == expected
    for token in prompt(model, "no!"):
        assert not matcher.finished and matcher.consume(token)
    assert matcher.finished and matcher.error is None


def test_masked_rows_sample_only_allowed_tokens_and_other_rows_are_untouched(
    model: LoadedModel, compiler: GrammarCompiler
) -> None:
    vocab = model.config.vocab_size
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(3)) * 4
    params = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)

    def state(grammar=None, **overrides) -> SamplingState:
        chosen = SamplingParams(**{**params.__dict__, **overrides})
        return SamplingState(
            chosen,
            prompt_ids=[],
            generated_ids=[],
            vocab_size=vocab,
            device=torch.device("cpu"),
            grammar=grammar,
            logprobs=20,
        )

    constraint = {"type": "regex", "pattern": "[0-9]{3}"}
    digits = allowed_next(compiler, compiler.matcher(constraint), vocab)
    for _ in range(10):
        batch = logits.clone()
        states = [state(), state(compiler.matcher(constraint)), state(compiler.matcher(constraint), temperature=0.0)]
        sampled = sample(batch, states)
        assert torch.equal(batch[0], logits[0])  # unconstrained row: the logits as they came
        assert sampled.tokens[1] in digits and sampled.tokens[2] in digits
        for row in (1, 2):
            assert {token for token, _ in sampled.logprobs[row].top} <= digits
            masked = torch.full((vocab,), float("-inf"))
            masked[list(digits)] = logits[row][list(digits)] / (1.0 if row == 2 else 1.5)
            expected = masked.log_softmax(-1)[sampled.tokens[row]]
            assert sampled.logprobs[row].logprob == pytest.approx(float(expected), abs=1e-5)


# ------------------------------------------------------------ the engine


@pytest.mark.timeout(900)  # 15 engine runs of 3 constrained and one free sequence; the watchdog catches a hang
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(seed=28256440, temperature=1.6, top_k=0, top_p=0.9)  # ran to max_tokens on tabs with a -8 bias
@given(
    seed=st.integers(0, 2**31 - 1),
    temperature=st.sampled_from([0.0, 0.4, 1.0, 1.6]),
    top_k=st.sampled_from([0, 3, 40]),
    top_p=st.sampled_from([1.0, 0.9, 0.5]),
)
@pytest.mark.slow  # many constrained answers: seconds
def test_constrained_output_always_parses_and_validates(
    model: LoadedModel, seed: int, temperature: float, top_k: int, top_p: float
) -> None:
    bias = no_whitespace_runs(model)

    def params(offset: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=220,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=0.0,
            seed=seed + offset,
            logit_bias=bias,
        )

    requests = [
        GenRequest(f"s{i}", prompt(model), params(i), constraint=json_schema(schema))
        for i, schema in enumerate(SCHEMAS)
    ]
    requests.append(GenRequest("object", prompt(model), params(7), constraint={"type": "json_object"}))
    requests.append(GenRequest("free", prompt(model), params(8)))
    results = asyncio.run(generate(model, requests, page_size=PAGE))
    for index, schema in enumerate(SCHEMAS):
        result = results[f"s{index}"]
        assert result.finish_reason == "stop", (result.finish_reason, result.error, result.text)
        assert_valid(result.text, schema)
    if results["object"].finish_reason == "stop":  # any object: depth is not bounded, so it may run out
        assert isinstance(json.loads(results["object"].text), dict)
    else:
        assert results["object"].finish_reason == "length" and results["object"].text.startswith("{")


async def test_json_object_gives_an_object_and_the_grammar_finishes_it(model: LoadedModel) -> None:
    stop_on_eos = {token: 30.0 for token in model.stop_token_ids}  # EOS everywhere it is allowed
    request = GenRequest(
        "o", prompt(model), greedy(max_tokens=200, logit_bias=stop_on_eos), constraint={"type": "json_object"}
    )
    result = (await generate(model, [request], page_size=PAGE))["o"]
    assert result.finish_reason == "stop" and result.error is None
    assert isinstance(json.loads(result.text), dict)
    # The object ends at its closing brace: the grammar is complete, no EOS was needed (or allowed before).
    assert result.text.endswith("}") and not set(result.token_ids) & model.stop_token_ids


async def test_eos_is_allowed_only_where_the_grammar_may_end(model: LoadedModel) -> None:
    stop_on_eos = {token: 30.0 for token in model.stop_token_ids}
    params = SamplingParams(max_tokens=20, temperature=0.0, logit_bias=stop_on_eos)
    lark = {"type": "lark", "grammar": 'start: "ab" /[a-z]*/'}
    for ignore_eos in (False, True):  # the grammar ends the sequence on EOS either way
        chosen = SamplingParams(**{**params.__dict__, "ignore_eos": ignore_eos})
        result = (await generate(model, [GenRequest("l", prompt(model), chosen, constraint=lark)], page_size=PAGE))["l"]
        assert result.finish_reason == "stop" and result.text == "ab"
        assert result.token_ids[-1] in model.stop_token_ids
    free = (await generate(model, [GenRequest("f", prompt(model), params)], page_size=PAGE))["f"]
    assert len(free.token_ids) == 1 and free.token_ids[0] in model.stop_token_ids


async def test_regex_output_matches_in_full(model: LoadedModel) -> None:
    pattern = r"(yes|no), [0-9]{2,3} (cats|dogs)\."
    requests = [
        GenRequest(
            f"r{seed}",
            prompt(model),
            SamplingParams(max_tokens=40, temperature=1.2, seed=seed),
            constraint={"type": "regex", "pattern": pattern},
        )
        for seed in range(4)
    ]
    results = await generate(model, requests, page_size=PAGE)
    for result in results.values():
        assert result.finish_reason == "stop" and re.fullmatch(pattern, result.text), result.text


async def test_lark_tool_call_with_an_embedded_schema(model: LoadedModel) -> None:
    arguments = PETS
    grammar = 'start: "<tool_call>" call "</tool_call>"\ncall: ' + lark_json(
        {
            "type": "object",
            "properties": {"name": {"const": "get_pets"}, "arguments": arguments},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
    )
    bias = no_whitespace_runs(model)
    requests = [
        GenRequest(
            f"t{seed}",
            prompt(model),
            SamplingParams(max_tokens=200, temperature=0.8, seed=seed, logit_bias=bias),
            constraint={"type": "lark", "grammar": grammar},
        )
        for seed in range(3)
    ]
    results = await generate(model, requests, page_size=PAGE)
    for result in results.values():
        assert result.finish_reason == "stop", (result.finish_reason, result.text)
        match = re.fullmatch(r"<tool_call>(.*)</tool_call>", result.text, flags=re.DOTALL)
        assert match, result.text
        call = json.loads(match.group(1))
        assert call["name"] == "get_pets"
        jsonschema.validate(call["arguments"], arguments)


async def test_lark_text_or_tool_call(model: LoadedModel) -> None:
    grammar = 'start: TEXT | "<tool_call>" call "</tool_call>"\nTEXT: /[^<]{1,12}/\ncall: ' + lark_json(PETS)
    requests = [
        GenRequest(
            f"c{seed}",
            prompt(model),
            SamplingParams(max_tokens=150, temperature=1.0, seed=seed, logit_bias=no_whitespace_runs(model)),
            constraint={"type": "lark", "grammar": grammar},
        )
        for seed in range(4)
    ]
    for result in (await generate(model, requests, page_size=PAGE)).values():
        assert result.finish_reason == "stop", result.text
        call = re.fullmatch(r"<tool_call>(.*)</tool_call>", result.text, flags=re.DOTALL)
        if call:
            assert_valid(call.group(1), PETS)
        else:
            assert re.fullmatch(r"[^<]{1,12}", result.text), result.text


async def test_a_resumed_request_keeps_its_grammar_state(model: LoadedModel) -> None:
    params = SamplingParams(max_tokens=200, temperature=0.0, logit_bias=no_whitespace_runs(model))
    whole = (
        await generate(model, [GenRequest("w", prompt(model), params, constraint=json_schema(PETS))], page_size=PAGE)
    )["w"]
    assert whole.finish_reason == "stop" and len(whole.token_ids) > 8
    for cut in (1, 5, len(whole.token_ids) - 1):
        resumed = GenRequest(
            "r", prompt(model), params, generated_ids=whole.token_ids[:cut], constraint=json_schema(PETS)
        )
        result = (await generate(model, [resumed], page_size=PAGE))["r"]
        assert result.token_ids == whole.token_ids[cut:] and result.finish_reason == "stop"
        assert whole.text.endswith(result.text)
    done = GenRequest("d", prompt(model), params, generated_ids=whole.token_ids, constraint=json_schema(PETS))
    finished = (await generate(model, [done], page_size=PAGE))["d"]
    assert finished.finish_reason == "stop" and finished.token_ids == []


async def test_resumed_tokens_that_break_the_grammar_fail_the_request_clearly(model: LoadedModel) -> None:
    off_grammar = prompt(model, "Hello")
    request = GenRequest("x", prompt(model), greedy(), generated_ids=off_grammar, constraint={"type": "json_object"})
    result = (await generate(model, [request], page_size=PAGE))["x"]
    assert result.finish_reason == "error" and "do not follow the constraint" in result.error


async def test_a_constrained_seeded_request_is_the_same_alone_and_in_a_batch(model: LoadedModel) -> None:
    bias = no_whitespace_runs(model)
    params = SamplingParams(max_tokens=200, temperature=1.0, top_k=0, seed=11, logit_bias=bias)
    constrained = GenRequest("c", prompt(model), params, constraint=json_schema(PERSON), logprobs=3)
    alone = (await generate(model, [constrained], page_size=PAGE))["c"]
    others = [
        GenRequest("free", prompt(model, "Hello, world!"), greedy(max_tokens=30)),
        GenRequest(
            "other",
            prompt(model, "Numbers"),
            SamplingParams(max_tokens=60, temperature=0.7, seed=3),
            constraint={"type": "regex", "pattern": "[0-9]{40}"},
        ),
    ]
    batched = await generate(model, [*others, constrained], joins={"c": 2}, page_size=PAGE)
    assert batched["c"].token_ids == alone.token_ids and batched["c"].finish_reason == alone.finish_reason == "stop"
    free_alone = (await generate(model, [others[0]], page_size=PAGE))["free"]
    assert batched["free"].token_ids == free_alone.token_ids
    assert re.fullmatch("[0-9]{40}", batched["other"].text)


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_the_default_model_answers_in_the_schema() -> None:
    model = load_model(None)
    messages = [{"role": "user", "content": "Ann is 31 and has a cat called Tom. Describe her as JSON."}]
    ids = model.tokenizer.encode(model.chat_template.render(messages), add_special_tokens=False).ids
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer"},
            "pets": {"type": "array", "maxItems": 2, "items": PETS["properties"]["pets"]["items"]},
        },
        "required": ["name", "age", "pets"],
        "additionalProperties": False,
    }
    requests = [
        GenRequest(
            f"p{seed}",
            ids,
            SamplingParams(max_tokens=160, temperature=0.0 if seed == 0 else 0.9, seed=seed),
            constraint=json_schema(schema),
            logprobs=2,
        )
        for seed in range(4)
    ]
    requests.append(
        GenRequest(
            "obj", ids, SamplingParams(max_tokens=160, temperature=0.7, seed=5), constraint={"type": "json_object"}
        )
    )
    results = await generate(model, requests, page_size=16)
    for index in range(4):
        result = results[f"p{index}"]
        assert result.finish_reason == "stop", result.text
        assert_valid(result.text, schema)
    greedy_answer = json.loads(results["p0"].text)
    assert (greedy_answer["name"], greedy_answer["age"]) == ("Ann", 31)  # constrained, and still the model's answer
    if results["obj"].finish_reason == "stop":
        assert isinstance(json.loads(results["obj"].text), dict)


async def test_a_grammar_that_breaks_mid_run_fails_its_sequence_only(model: LoadedModel) -> None:
    outputs: dict[str, list] = {"broken": [], "fine": []}
    engine: Engine

    def on_step(step) -> None:
        for output in step:
            outputs[output.id].append(output)
        active = engine._active.get("broken")
        if active is not None and len(outputs["broken"]) == 2:  # a token the grammar forbids puts it in error
            active.sampling.grammar.consume(model.tokenizer.token_to_id("<|im_start|>"))

    engine = Engine(model, on_step=on_step, page_size=PAGE)
    engine.add(
        GenRequest(
            "broken", prompt(model), greedy(max_tokens=40), constraint={"type": "regex", "pattern": "[a-z ]{30}"}
        )
    )
    engine.add(
        GenRequest("fine", prompt(model), greedy(max_tokens=10), constraint={"type": "regex", "pattern": "[0-9]{5}"})
    )
    engine.stop()
    await asyncio.wait_for(engine.run(), 300)
    broken, fine = outputs["broken"][-1], outputs["fine"][-1]
    assert broken.finish_reason == "error" and "constrained decoding failed" in broken.error
    assert fine.finish_reason == "stop" and re.fullmatch("[0-9]{5}", "".join(o.text for o in outputs["fine"]))
    assert engine.stats.kv_pages_free == engine.stats.kv_pages_total
