"""Agent frameworks, unchanged, against the live server: langchain-openai's bind_tools and
with_structured_output, and a pydantic-ai Agent with a typed output (which it asks for as a
tool call) through its OpenAI provider."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from tests.helpers.live_server import KEY_A, MODEL


class Weather(BaseModel):
    """Weather in a city."""

    city: Literal["Paris", "Rome"]


class Verdict(BaseModel):
    ok: bool


def test_langchain_bind_tools_and_structured_output(agent_server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{agent_server.base_url}/v1", api_key=KEY_A, model=MODEL, temperature=0, max_tokens=400)
    reply = llm.bind_tools([Weather], tool_choice="Weather").invoke("Weather in Paris?")
    [call] = reply.tool_calls
    assert call["name"] == "Weather" and Weather(**call["args"])
    reply = llm.bind_tools([Weather], tool_choice="required").invoke("Weather?")
    assert reply.tool_calls and all(Weather(**c["args"]) for c in reply.tool_calls)
    assert isinstance(llm.with_structured_output(Verdict).invoke("Is it fine?"), Verdict)
    assert isinstance(llm.with_structured_output(Verdict, method="function_calling").invoke("Is it fine?"), Verdict)


def test_pydantic_ai_agent_with_typed_output(agent_server):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    provider = OpenAIProvider(base_url=f"{agent_server.base_url}/v1", api_key=KEY_A)
    agent = Agent(OpenAIChatModel(MODEL, provider=provider), output_type=Verdict,
                  model_settings=ModelSettings(temperature=0, max_tokens=400))
    result = agent.run_sync("Is it fine?")
    assert isinstance(result.output, Verdict)
