"""Anthropic's Messages API: the wire format (`protocol`), a request as a chat conversation with
its cache breakpoints (`conversation`), and POST /v1/messages (`routes`).
"""
