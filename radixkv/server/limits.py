"""ServerLimits: the HTTP server's own protective knobs (body size, connections and read
deadlines, slow readers, per-key fair share, parsing threads, pin ttl, stored responses, cache diagnoses,
exact continuation, cross-site checks, operator endpoints), one validated dataclass with every default and unit.
What one request body may carry is radixkv.server.guards.request_caps.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixkv.prompts.continuation import DEFAULT_MAX_SPLICED_REPLIES
from radixkv.errors import ConfigError

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class ServerLimits:
    # Request bodies past this are refused with 413 before they are read in full. 8 MiB holds
    # any prompt that fits a 128k-token context several times over.
    max_body_bytes: int = 8 * MIB
    # A streaming client whose socket has not taken the next event for this long is treated as
    # gone: its requests are aborted and their pages freed (it stalls nobody else meanwhile).
    stream_send_timeout_s: float = 30.0
    # Per API key (or per anonymous caller when no keys are set): engine requests in flight at
    # once (queued or running), and their sequences (n summed). Past either: 429, Retry-After.
    max_requests_per_key: int = 256
    max_seqs_per_key: int = 1024
    # Per key: request bodies parsed, templated and tokenized on worker threads at once (more
    # wait without a thread, up to max_requests_per_key, then 429). 0: a quarter of the thread
    # pool (anyio's, 40 threads: 10), so one key never holds every parsing thread.
    max_parses_per_key: int = 0
    # Per key: CPU seconds a second its parses may spend, past a burst (a parse then waits,
    # holding no thread, until its key's earlier parses are paid off): one key sending large
    # bodies back to back gets a quarter of a core, not the interpreter lock the engine needs.
    # 0: no share.
    parse_cpu_share_per_key: float = 0.25
    parse_cpu_burst_s: float = 2.0
    # A pin made over HTTP is released this long after it was made unless unpinned before (a
    # remote client may vanish without unpinning); 0: never. The pin caps are the engine's
    # (EngineConfig.max_pinned_pages_per_owner, max_pinned_pages).
    pin_ttl_s: float = 3600.0
    # Responses kept for previous_response_id (store: true), per key: past either cap the key's
    # own oldest go; a conversation larger than the byte cap on its own is refused (400). The
    # bytes are the conversation's JSON size.
    max_stored_responses_per_key: int = 1024
    max_stored_response_bytes_per_key: int = 64 * MIB
    # And over all keys together: past either, the key holding the most bytes loses its oldest,
    # so a key within its own caps never loses a response to a key storing more.
    max_stored_responses: int = 65536
    max_stored_response_bytes: int = 1024 * MIB
    # Cache diagnostics (Anthropic's diagnostics.previous_message_id, OpenAI's
    # prompt_cache_options.comparison_response_id): every answered message or response keeps a
    # fingerprint (digests and counts, never text: 16 bytes a message plus 256) per key; past
    # a key's count or byte cap its least recently used go; over all keys past either cap, the
    # key holding the most bytes loses its least recently used.
    max_cache_diagnoses_per_key: int = 1024
    max_cache_diagnosis_bytes_per_key: int = 16 * MIB
    max_cache_diagnoses: int = 65536
    max_cache_diagnosis_bytes: int = 256 * MIB
    # Exact continuation: a turn continues from the ids its previous reply was generated as
    # (previous_response_id: the stored turn's ids; chat and Messages: a reply sent back as an
    # assistant message gets its generated ids spliced in), so it hits all the previous turn
    # computed even where the reply's text re-tokenizes differently. Off: every turn is
    # re-rendered and tokenized from text.
    exact_continuation: bool = True
    # The replies kept for chat and Messages per key (their ids, 4 bytes a token): past either
    # cap the key's least recently used go; over all keys past max_reply_tokens, the key
    # holding the most tokens loses its least recently used.
    max_replies_per_key: int = 4096
    max_reply_tokens_per_key: int = 1 << 20
    max_reply_tokens: int = 16 << 20
    # Replies one prompt gets back as their ids, the earliest (the rest re-tokenized from their
    # text): splicing is linear in the conversation, and this bounds the lookups and checks one
    # request makes. 0: none.
    max_spliced_replies: int = DEFAULT_MAX_SPLICED_REPLIES
    # Browser origins allowed to call the server (exact "scheme://host[:port]"); with no API key
    # configured, any other Origin is refused so a web page cannot drive a local server.
    allowed_origins: tuple[str, ...] = ()
    # Host names (besides loopback ones) a keyless server answers, "*" for any: a keyless server
    # refuses other Host headers so a DNS-rebound name cannot reach it from a browser.
    allowed_hosts: tuple[str, ...] = ()
    # Connections open at once (idle keep-alive ones included); past it a new connection is
    # answered 503 and closed (radixkv.server.guards.connections).
    max_connections: int = 1024
    # A request's headers must arrive within this long of its connection opening (or of the
    # previous response's end), its body within body_read_timeout_s of the headers; else 408
    # and the connection is closed, so a client trickling bytes cannot hold it open.
    header_read_timeout_s: float = 10.0
    body_read_timeout_s: float = 60.0
    # Serve /metrics, /get_load, /server_info and /model_info (and their /get_ aliases) without a
    # key even when keys are set (for a scraper or a router on a private network).
    public_operator_endpoints: bool = False

    def __post_init__(self) -> None:
        _int_in("max_body_bytes", self.max_body_bytes, 1024, 1 << 34)
        _int_in("max_requests_per_key", self.max_requests_per_key, 1, 1 << 30)
        _int_in("max_seqs_per_key", self.max_seqs_per_key, 1, 1 << 30)
        _int_in("max_parses_per_key", self.max_parses_per_key, 0, 1 << 20)
        _seconds("parse_cpu_share_per_key", self.parse_cpu_share_per_key, allow_zero=True)
        _seconds("parse_cpu_burst_s", self.parse_cpu_burst_s, allow_zero=True)
        _int_in("max_stored_responses_per_key", self.max_stored_responses_per_key, 1, 1 << 30)
        _int_in("max_stored_response_bytes_per_key", self.max_stored_response_bytes_per_key, 1024, 1 << 40)
        _int_in("max_stored_responses", self.max_stored_responses, 1, 1 << 30)
        _int_in("max_stored_response_bytes", self.max_stored_response_bytes, 1024, 1 << 40)
        _int_in("max_cache_diagnoses_per_key", self.max_cache_diagnoses_per_key, 1, 1 << 30)
        _int_in("max_cache_diagnosis_bytes_per_key", self.max_cache_diagnosis_bytes_per_key, 1024, 1 << 40)
        _int_in("max_cache_diagnoses", self.max_cache_diagnoses, 1, 1 << 30)
        _int_in("max_cache_diagnosis_bytes", self.max_cache_diagnosis_bytes, 1024, 1 << 40)
        _int_in("max_replies_per_key", self.max_replies_per_key, 1, 1 << 30)
        _int_in("max_reply_tokens_per_key", self.max_reply_tokens_per_key, 1, 1 << 34)
        _int_in("max_reply_tokens", self.max_reply_tokens, 1, 1 << 36)
        _int_in("max_spliced_replies", self.max_spliced_replies, 0, 1 << 20)
        if not isinstance(self.exact_continuation, bool):
            raise ConfigError(f"exact_continuation must be true or false, got {self.exact_continuation!r}", param="exact_continuation")
        _seconds("stream_send_timeout_s", self.stream_send_timeout_s, allow_zero=False)
        _seconds("pin_ttl_s", self.pin_ttl_s, allow_zero=True)
        _int_in("max_connections", self.max_connections, 1, 1 << 20)
        _seconds("header_read_timeout_s", self.header_read_timeout_s, allow_zero=False)
        _seconds("body_read_timeout_s", self.body_read_timeout_s, allow_zero=False)
        if not all(isinstance(o, str) and "://" in o for o in self.allowed_origins):
            raise ConfigError(f"allowed_origins must be 'scheme://host[:port]' strings, got {self.allowed_origins!r}", param="allowed_origins")
        if not all(isinstance(h, str) and h for h in self.allowed_hosts):
            raise ConfigError(f"allowed_hosts must be non-empty host names, got {self.allowed_hosts!r}", param="allowed_hosts")


def _int_in(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{name} must be an integer in [{low}, {high}], got {value!r}", param=name)


def _seconds(name: str, value: object, *, allow_zero: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
    if not ok or value > 1e9:  # type: ignore[operator]
        raise ConfigError(f"{name} must be a number of seconds {'>= 0' if allow_zero else '> 0'}, got {value!r}", param=name)
