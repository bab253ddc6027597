"""The state every route of one app reads: the engine, tenants, the served model's names, the
limits, per-key quotas and parse slots, and the metrics; fixed when the app is created (the
metrics count on).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixkv.engine.async_engine import AsyncEngine
from radixkv.prompts.replies import ReplyMap
from radixkv.server.cache_diagnostics import DiagnosisStore
from radixkv.server.errors import APIError
from radixkv.server.guards.drain import Drain
from radixkv.server.limits import ServerLimits
from radixkv.server.metrics import ServerMetrics
from radixkv.server.reply_format import ReplyFormat
import time
from radixkv.server.guards.parse_slots import ParseSlots
from radixkv.server.guards.quotas import KeyQuotas
from radixkv.server.guards.tenants import Tenants


@dataclass(slots=True)
class AppState:
    """What every route of one app reads: fixed at creation, except the metrics it counts."""

    engine: AsyncEngine
    tenants: Tenants
    model_name: str
    model_aliases: frozenset[str]
    metrics: ServerMetrics
    limits: ServerLimits = field(default_factory=ServerLimits)
    quotas: KeyQuotas = field(init=False)
    parse_slots: ParseSlots = field(init=False)  # bodies parsed off the loop, a few per key
    created: int = field(default_factory=lambda: int(time.time()))
    drain: Drain = field(default_factory=Drain)  # set draining by SIGTERM (radixkv serve)
    replies: ReplyMap | None = field(init=False)  # chat replies' ids per owner; None: continuation off
    diagnoses: DiagnosisStore = field(init=False)  # answered prompts' fingerprints per owner (cache diagnostics)
    reply_format: ReplyFormat = field(init=False)  # the model's: how every route splits a reply

    def __post_init__(self) -> None:
        self.quotas = KeyQuotas(self.limits.max_requests_per_key, self.limits.max_seqs_per_key)
        limits = self.limits
        self.parse_slots = ParseSlots(
            limits.max_parses_per_key, limits.max_requests_per_key,
            cpu_share=limits.parse_cpu_share_per_key, cpu_burst_s=limits.parse_cpu_burst_s,
        )  # fmt: skip
        self.reply_format = ReplyFormat(self.engine.tokenizer)
        self.diagnoses = DiagnosisStore(
            limits.max_cache_diagnoses_per_key, limits.max_cache_diagnosis_bytes_per_key, limits.max_cache_diagnoses, limits.max_cache_diagnosis_bytes,
            argument_text=self.reply_format.harmony is not None,
        )  # fmt: skip
        self.replies = None
        if limits.exact_continuation:
            self.replies = ReplyMap(
                self.engine.tokenizer, limits.max_replies_per_key, limits.max_reply_tokens_per_key, limits.max_reply_tokens,
                max_spliced_replies=limits.max_spliced_replies,
            )  # fmt: skip

    def check_model(self, model: str) -> None:
        """APIError 404 unless `model` names the model this server serves."""
        if model not in self.model_aliases:
            raise APIError(
                404, f"the model {model!r} does not exist; this server serves {self.model_name!r}", param="model", code="model_not_found"
            )
