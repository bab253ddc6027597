"""The server-sent events of a streamed response, in the order OpenAI sends them: created,
in_progress, per output item its added / deltas / done events, and completed (or incomplete);
every event numbered by sequence_number.
"""

from __future__ import annotations

import json
from typing import Any

from radixkv.server.errors import APIError
from radixkv.server.openai.responses_convert import function_call_item, reasoning_item
from radixkv.server.openai.responses_protocol import (
    IncompleteDetails,
    OutputFunctionCall,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ResponseObject,
    ResponseUsage,
    new_item_id,
)
from radixkv.server.tools import ToolCall


class ResponseEvents:
    """Builds the events of one response as its text and tool calls arrive; `response` holds
    the output so far and, once finished, the whole Response."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self._sequence_number = 0
        self._message: OutputMessage | None = None  # the message item still open, if any
        self._reasoning: OutputReasoning | None = None  # the reasoning item still open, if any

    def start(self) -> list[str]:
        return [self._event("response.created", response=self._dump()), self._event("response.in_progress", response=self._dump())]

    def reasoning(self, delta: str) -> list[str]:
        """Reasoning text, in a reasoning item of its own (one item open at a time)."""
        if not delta:
            return []
        events = [] if self._reasoning is not None else self._close_message("completed") + self._open_reasoning()
        assert self._reasoning is not None
        self._reasoning.content[0].text += delta
        events.append(self._event("response.reasoning_text.delta", **self._reasoning_place(), delta=delta))
        return events

    def text(self, delta: str) -> list[str]:
        if not delta:
            return []
        events = [] if self._message is not None else self._close_reasoning("completed") + self._open_message()
        assert self._message is not None
        self._message.content[0].text += delta
        events.append(self._event("response.output_text.delta", **self._part_place(), delta=delta, logprobs=[]))
        return events

    def call(self, call: ToolCall) -> list[str]:
        # A call closes the items before it: items never interleave in OpenAI's stream.
        events = self._close_reasoning("completed") + self._close_message("completed")
        item = function_call_item(call, "in_progress")
        index = len(self.response.output)
        self.response.output.append(item)
        place = {"item_id": item.id, "output_index": index}
        events.append(self._event("response.output_item.added", output_index=index, item=item.model_dump()))
        events.append(self._event("response.function_call_arguments.delta", **place, delta=call.arguments))
        item.arguments, item.status = call.arguments, "completed"
        events.append(self._event("response.function_call_arguments.done", **place, name=call.name, arguments=call.arguments))
        events.append(self._event("response.output_item.done", output_index=index, item=item.model_dump()))
        return events

    def finish(self, usage: ResponseUsage, complete: bool) -> list[str]:
        """The closing events; `complete` False: the reply ran out of max_output_tokens."""
        status = "completed" if complete else "incomplete"
        events = self._close_reasoning(status) + self._close_message(status)
        if not any(isinstance(item, (OutputMessage, OutputFunctionCall)) for item in self.response.output):
            events += self._open_message() + self._close_message("completed" if complete else "incomplete")
        self.response.usage = usage
        if complete:
            self.response.status = "completed"
            events.append(self._event("response.completed", response=self._dump()))
        else:
            self.response.status = "incomplete"
            self.response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
            events.append(self._event("response.incomplete", response=self._dump()))
        return events

    def error(self, error: APIError) -> str:
        return self._event("error", code=error.code, message=error.message, param=error.param)

    # -- items ---------------------------------------------------------------------------------

    def _open_message(self) -> list[str]:
        self._message = OutputMessage(id=new_item_id("msg"), status="in_progress", content=[])
        index = len(self.response.output)
        self.response.output.append(self._message)
        added = self._event("response.output_item.added", output_index=index, item=self._message.model_dump())
        self._message.content.append(OutputText(text=""))
        part = self._event("response.content_part.added", **self._part_place(), part=OutputText(text="").model_dump())
        return [added, part]

    def _close_message(self, status: str) -> list[str]:
        message = self._message
        if message is None:
            return []
        place = self._part_place()
        text = message.content[0].text
        message.status = status  # type: ignore[assignment]
        self._message = None
        return [
            self._event("response.output_text.done", **place, text=text, logprobs=[]),
            self._event("response.content_part.done", **place, part=message.content[0].model_dump()),
            self._event("response.output_item.done", output_index=place["output_index"], item=message.model_dump()),
        ]

    def _open_reasoning(self) -> list[str]:
        self._reasoning = reasoning_item("", "in_progress")
        index = len(self.response.output)
        self.response.output.append(self._reasoning)
        added = self._event("response.output_item.added", output_index=index, item=self._reasoning.model_dump())
        part = self._event("response.content_part.added", **self._reasoning_place(), part=self._reasoning.content[0].model_dump())
        return [added, part]

    def _close_reasoning(self, status: str) -> list[str]:
        item = self._reasoning
        if item is None:
            return []
        place = self._reasoning_place()
        item.status = status  # type: ignore[assignment]
        self._reasoning = None
        return [
            self._event("response.reasoning_text.done", **place, text=item.content[0].text),
            self._event("response.content_part.done", **place, part=item.content[0].model_dump()),
            self._event("response.output_item.done", output_index=place["output_index"], item=item.model_dump()),
        ]

    def _reasoning_place(self) -> dict[str, Any]:
        assert self._reasoning is not None
        return {"item_id": self._reasoning.id, "output_index": self.response.output.index(self._reasoning), "content_index": 0}

    def _part_place(self) -> dict[str, Any]:
        assert self._message is not None
        return {"item_id": self._message.id, "output_index": self.response.output.index(self._message), "content_index": 0}

    def _dump(self) -> dict[str, Any]:
        return self.response.model_dump()

    def _event(self, kind: str, **fields: Any) -> str:
        number = self._sequence_number
        self._sequence_number += 1
        data = json.dumps({"type": kind, "sequence_number": number, **fields}, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n"  # OpenAI names each event twice, so do we
