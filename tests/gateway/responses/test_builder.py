"""The Responses output builder: items and stream events from a generation, read back by the openai
SDK's own stream accumulator (the state machine behind `client.responses.stream()`)."""

from __future__ import annotations

import json

from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from gateway.generation import Done, Usage
from gateway.responses.builder import ResponseBuilder
from gateway.tool_calls import ToolPlan

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
ECHO = {"model": "tiny", "tools": [], "tool_choice": "auto", "parallel_tool_calls": True}


def accumulate(events: list[dict]):
    """What the SDK makes of the events: its final response (it raises on an order it does not take)."""
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in events:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=json.loads(json.dumps(event))))
    return state._completed_response


def done(reason: str = "stop", completion: int = 5) -> Done:
    return Done(finish_reason=reason, stop_sequence=None, usage=Usage(7, completion, 3))


def test_reasoning_then_an_answer_are_two_items_the_sdk_accumulates():
    builder = ResponseBuilder("resp_" + "a" * 32, ECHO, ToolPlan("none"), 1.0)
    events = builder.start()
    events += builder.feed("", reasoning="Paris is ")
    events += builder.feed("", reasoning="the capital.")
    events += builder.feed("\n")  # whitespace alone opens no message
    events += builder.feed("Paris.")
    events += builder.finish(done())
    final = accumulate(events)
    assert final.status == "completed" and final.output_text == "\nParis."
    reasoning, message = final.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Paris is the capital."
    assert message.type == "message" and message.status == "completed"
    kinds = [event["type"] for event in events]
    assert kinds.count("response.reasoning_text.delta") == 2 and "response.reasoning_text.done" in kinds
    assert kinds.index("response.output_item.done") < kinds.index(
        "response.output_text.delta"
    )  # reasoning closed first
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert final.usage.input_tokens_details.cached_tokens == 3 and final.usage.total_tokens == 12


def test_a_forced_call_is_a_function_call_item_and_no_message():
    builder = ResponseBuilder("resp_" + "b" * 32, ECHO, ToolPlan("required", [TOOL], parallel=False), 1.0)
    events = builder.start()
    for piece in ('<tool_call>\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}\n</tool_call>', "\n<tool_"):
        events += builder.feed(piece)
    events += builder.finish(done("length"))  # the grammar let it run on: the call is what counts
    final = accumulate(events)
    assert final.status == "completed"
    [call] = final.output
    assert (
        call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    )
    assert call.call_id.startswith("call_")


def test_the_same_inputs_make_the_same_events():
    """A gateway taking a background response over rebuilds its events to skip those written."""

    def run() -> list[dict]:
        builder = ResponseBuilder("resp_" + "c" * 32, ECHO, ToolPlan("auto", [TOOL]), 1.0)
        events = (
            builder.start(queued=True) + builder.feed("Hi ") + builder.feed("there") + builder.finish(done("length"))
        )
        for event in events:
            event.get("response", {}).pop("completed_at", None)
        return events

    first = run()
    assert first == run()
    assert [event["type"] for event in first][:3] == ["response.created", "response.queued", "response.in_progress"]
    assert first[-1]["type"] == "response.incomplete"
    assert first[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
