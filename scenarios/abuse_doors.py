"""The load test's attacks on the doors that sessions, continuation and grammars opened: echoed
replies around forged splice markers, grammar pairs beside another key's schema, lookups past the
context, a logit_bias key of thousands of digits. Each must be answered with a 4xx or served, never
a 5xx, and the victim key's small schema must be served throughout.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Any

import httpx

# The pre-fix marker format (private-use delimiters around a counter): text a client could send
# to make the joint splice fail and every remembered reply retried alone.
FORGED_MARKER = "\ue000radixkv-reply-0\ue001"
# A small GBNF grammar (about 400 bytes): the attack is two of them queued ahead of another key.
GRAMMAR = r"""
root ::= "{" ws "\"items\":" ws "[" ws item (ws "," ws item)* ws "]" ws "," ws "\"note\":" ws note ws "}"
item ::= "{" ws "\"name\":" ws word ws "," ws "\"size\":" ws number ws "}"
word ::= "\"" [a-z]+ ("-" [a-z]+)* "\""
note ::= "\"" ([a-zA-Z0-9 .,!?] | "\\" ["\\/bfnrt])* "\""
number ::= "-"? ([0-9] | [1-9] [0-9]+) ("." [0-9]+)? ([eE] [-+]? [0-9]+)?
ws ::= [ \t\n]*
"""
VICTIM_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
}


@dataclass(slots=True)
class DoorTally:
    """What the door attacks sent, what came back that should not have, and the victim's schema."""

    echo_splice_sent: int = 0
    echo_splice_slowest_s: float = 0.0  # reported beside the p99s, never judged on its own
    grammar_pairs_sent: int = 0
    lookups_past_context_sent: int = 0
    logit_bias_digits_sent: int = 0
    unexpected: int = 0  # a 5xx, a timeout, or a 2xx where only a 4xx is right
    victim_schema_sent: int = 0
    victim_schema_served: int = 0

    @property
    def ok(self) -> bool:
        return self.unexpected == 0 and self.victim_schema_served == self.victim_schema_sent


async def door_attacks(base_url: str, key: str, victim_key: str, model_name: str, echoes: int, stop: asyncio.Event, tally: DoorTally) -> None:
    """Round robin over the four attacks until `stop` (each at least once); the victim key
    asks for its 3-property schema after every grammar pair."""
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=base_url, timeout=120, headers=headers) as client:
        reply = await _a_reply(client, model_name)
        for i in itertools.count():
            if stop.is_set() and i >= 4:
                return
            try:
                await _ATTACKS[i % 4](client, model_name, reply, echoes, tally)
                if i % 4 == 1:
                    await _victim_schema(base_url, victim_key, model_name, tally)
            except httpx.HTTPError:
                tally.unexpected += 1
            await asyncio.sleep(0)


async def _a_reply(client: httpx.AsyncClient, model_name: str) -> str:
    """A reply the server remembers for this key, to echo back."""
    body = {"model": model_name, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8, "temperature": 0}
    response = await client.post("/v1/chat/completions", json=body)
    return response.json()["choices"][0]["message"]["content"] if response.status_code == 200 else "An echoed reply."


async def _echo_splice(client: httpx.AsyncClient, model_name: str, reply: str, echoes: int, tally: DoorTally) -> None:
    messages: list[dict[str, str]] = []
    for _ in range(echoes):
        messages += [{"role": "user", "content": f"Again {FORGED_MARKER}"}, {"role": "assistant", "content": reply}]
    messages.append({"role": "user", "content": FORGED_MARKER})
    tally.echo_splice_sent += 1
    start = time.perf_counter()
    response = await client.post("/v1/chat/completions", json={"model": model_name, "messages": messages, "max_tokens": 1})
    tally.echo_splice_slowest_s = max(tally.echo_splice_slowest_s, time.perf_counter() - start)
    tally.unexpected += response.status_code not in (200, 400, 429)


async def _grammar_pair(client: httpx.AsyncClient, model_name: str, reply: str, echoes: int, tally: DoorTally) -> None:
    def body(n: int) -> dict[str, Any]:
        return {"model": model_name, "prompt": f"List {n}:", "max_tokens": 8, "guided_grammar": GRAMMAR}

    tally.grammar_pairs_sent += 1
    answers = await asyncio.gather(*(client.post("/v1/completions", json=body(n)) for n in range(2)))
    tally.unexpected += sum(a.status_code not in (200, 400, 429) for a in answers)


async def _lookup_past_context(client: httpx.AsyncClient, model_name: str, reply: str, echoes: int, tally: DoorTally) -> None:
    tally.lookups_past_context_sent += 1
    response = await client.post("/v1/cache/lookup", json={"prompt": [1] * 200_000})
    tally.unexpected += response.status_code not in (400, 413, 429)


async def _logit_bias_digits(client: httpx.AsyncClient, model_name: str, reply: str, echoes: int, tally: DoorTally) -> None:
    tally.logit_bias_digits_sent += 1
    body = {"model": model_name, "prompt": "Hi", "max_tokens": 1, "logit_bias": {"7" * 5000: 1}}
    response = await client.post("/v1/completions", json=body)
    tally.unexpected += response.status_code not in (400, 429)


async def _victim_schema(base_url: str, key: str, model_name: str, tally: DoorTally) -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": VICTIM_SCHEMA}}
    body = {"model": model_name, "messages": [{"role": "user", "content": "A person:"}], "max_tokens": 16, "response_format": schema}
    tally.victim_schema_sent += 1
    async with httpx.AsyncClient(base_url=base_url, timeout=120, headers={"Authorization": f"Bearer {key}"}) as client:
        response = await client.post("/v1/chat/completions", json=body)
    tally.victim_schema_served += response.status_code == 200


_ATTACKS = (_echo_splice, _grammar_pair, _lookup_past_context, _logit_bias_digits)
