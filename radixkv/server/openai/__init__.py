"""OpenAI's API family: chat completions, completions and models (`routes`, `protocol`), and the
Responses API (`responses_*`: routes, wire format, conversion to chat, stream events, store).
"""
