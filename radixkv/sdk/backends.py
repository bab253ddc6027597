"""Where SDK requests run: in process on a `radixkv.LLM`, or over HTTP on a `radixkv serve`.

Both take a list of `Prompt`s and return one `Result` per prompt, in order, a failed prompt
carrying its error; `as_backend` picks one by what it is given (an LLM, an openai client, a
base URL). Pins (prefixes locked against eviction) are made here too.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixkv.engine.request_output import RequestOutput
from radixkv.engine.sampling_params import GrammarGuide, SamplingParams
from radixkv.errors import InvalidRequest
from radixkv.prompts import Prompt, has_chat_template

OnResult = Callable[[int, "Result"], None]


@dataclass(slots=True)
class Result:
    """One prompt's outcome: its reply and token counts, or `error` (then nothing else is set)."""

    text: str = ""
    texts: list[str] = field(default_factory=list)  # every continuation, when params.n > 1
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # the reply's token ids (in process only)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class GenerationError(RuntimeError):
    """A single generation (Session.generate, warm, pin) that failed; the message says why."""


@dataclass(slots=True)
class Pin:
    """A prefix locked in the cache; `unpin()` (or leaving a `with` block) releases it."""

    pin_id: int
    num_pinned_tokens: int  # the full pages' worth of the prefix now locked
    num_prompt_tokens: int
    backend: Backend = field(repr=False)
    released: bool = False

    def unpin(self) -> bool:
        """Release the pin; False if it was already released."""
        if self.released:
            return False
        self.released = True
        return self.backend.unpin(self.pin_id)

    def __enter__(self) -> Pin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.unpin()


class Backend:
    """The interface the SDK runs on. `chat`: prompts render through a chat template."""

    tokenizer: Any | None
    chat: bool

    @property
    def identity(self) -> object:
        """Two backends with the same identity share one engine (and its cache)."""
        return self

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams, on_result: OnResult | None = None) -> list[Result]:
        raise NotImplementedError

    def warm(self, prefix: Prompt) -> Result:
        """Compute a prefix with a one-token request; GenerationError if it fails."""
        return _one(self.generate([prefix], SamplingParams(max_tokens=1)))

    def pin(self, prefix: Prompt) -> Pin:
        raise NotImplementedError

    def unpin(self, pin_id: int) -> bool:
        raise NotImplementedError


# -- in process --------------------------------------------------------------------------------


class InProcessBackend(Backend):
    """Runs prompts on a `radixkv.LLM`'s engine: all submitted at once, so the scheduler sees
    their shared prefix together and computes it once.

    `on_step(engine)`, when given, runs after every engine step (introspection, tests).
    """

    def __init__(self, llm: Any, *, salt: str | None = None, on_step: Callable[[Any], None] | None = None) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.tokenizer = llm.tokenizer
        self.chat = has_chat_template(self.tokenizer)
        self.salt = salt
        self.on_step = on_step

    @property
    def identity(self) -> object:
        return self.llm

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams, on_result: OnResult | None = None) -> list[Result]:
        from radixkv.engine.run import run_to_completion

        results: list[Result | None] = [None] * len(prompts)

        def finish(i: int, result: Result) -> None:
            results[i] = result
            if on_result is not None:
                on_result(i, result)

        encoded: list[tuple[int, list[int]]] = []
        for i, prompt in enumerate(prompts):
            try:
                encoded.append((i, self.llm.encode_exact(prompt, salt=self.salt)))
            except Exception as error:  # noqa: BLE001 - the chat template refusing this prompt
                finish(i, Result(error=f"{type(error).__name__}: {error}"))

        def finished(j: int, output: RequestOutput) -> None:
            i = encoded[j][0]
            if prompts[i].messages is not None:  # a conversation's reply, for its next turn (LLM.remember)
                self.llm.remember(output, salt=self.salt)
            finish(i, _result_of(output))

        # Each prompt is checked on its own, so one over the context fails alone.
        run_to_completion(
            self.engine,
            [token_ids for _, token_ids in encoded],
            [params] * len(encoded),
            salt=self.salt,
            on_finished=finished,
            on_rejected=lambda j, error: finish(encoded[j][0], Result(error=f"{type(error).__name__}: {error}")),
            on_step=self.on_step,
        )
        return results  # type: ignore[return-value]

    def pin(self, prefix: Prompt) -> Pin:
        """Warm and pin `prefix` under the engine's pin caps (the same an HTTP caller gets);
        GenerationError past a cap, as from the HTTP backend."""
        token_ids = self.llm.encode_exact(prefix, salt=self.salt)  # as the next turn will encode it
        warmed = self.warm(Prompt(token_ids=token_ids))
        try:
            pinned = self.engine.pin(token_ids, self.salt)
        except InvalidRequest as error:
            raise GenerationError(f"{type(error).__name__}: {error}") from error
        return Pin(pinned.pin_id, pinned.num_pinned_tokens, warmed.num_prompt_tokens, self)

    def unpin(self, pin_id: int) -> bool:
        return self.engine.unpin(pin_id)


def _result_of(output: RequestOutput) -> Result:
    return Result(
        text=output.text,
        texts=[o.text for o in output.outputs],
        num_prompt_tokens=output.num_prompt_tokens,
        num_output_tokens=output.num_output_tokens,
        num_cached_tokens=output.num_cached_tokens,
        finish_reason=output.finish_reason,
        token_ids=list(output.token_ids),
    )


# -- over HTTP ---------------------------------------------------------------------------------


class HTTPBackend(Backend):
    """Runs prompts on a running `radixkv serve` (or any OpenAI-compatible server) through the
    official `openai` client: chat prompts on /v1/chat/completions, text on /v1/completions,
    up to `max_concurrency` at a time; pins on radixkv's /v1/cache/pin.

    With more than one prompt the first goes alone and the rest follow together, so they find
    the shared prefix cached whatever the server does with concurrent duplicates. A `tokenizer`
    (the served model's, an object or a path) is optional: with it the SDK checks shared
    prefixes in tokens and sends template prefixes as token ids; without it, in characters.

    Given a URL, the key is `api_key`, else $RADIXKV_API_KEY; $OPENAI_API_KEY only with
    `forward_openai_api_key=True`, so OpenAI's credential never goes to a URL unasked.
    """

    def __init__(
        self,
        target: Any,
        *,
        model: str | None = None,
        api_key: str | None = None,
        tokenizer: Any | None = None,
        chat: bool | None = None,
        max_concurrency: int = 8,
        salt: str | None = None,
        timeout_s: float = 600.0,
        forward_openai_api_key: bool = False,
    ) -> None:
        import openai

        if isinstance(target, str):
            base_url = target.rstrip("/")
            if not base_url.endswith("/v1"):
                base_url += "/v1"
            # OPENAI_API_KEY is a credential for OpenAI: sent to an arbitrary URL only when the
            # caller says so; RADIXKV_API_KEY is meant for radixkv servers.
            openai_key = os.environ.get("OPENAI_API_KEY") if forward_openai_api_key else None
            api_key = api_key or os.environ.get("RADIXKV_API_KEY") or openai_key or "none"
            target = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s)
        if not isinstance(target, openai.OpenAI):
            raise TypeError(f"HTTPBackend needs an openai.OpenAI client or a base URL, got {type(target).__name__}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
        self.client = target
        self._model = model
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.tokenizer = tokenizer
        self.chat = chat if chat is not None else (has_chat_template(tokenizer) if tokenizer is not None else True)
        self.max_concurrency = max_concurrency
        self.salt = salt

    @property
    def identity(self) -> object:
        return (str(self.client.base_url), self.client.api_key, self.salt)

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = self.client.models.list().data[0].id
        return self._model

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams, on_result: OnResult | None = None) -> list[Result]:
        options = {chat: self._options(params, chat=chat) for chat in (True, False)}
        results: list[Result | None] = [None] * len(prompts)

        def finish(i: int, result: Result) -> None:
            results[i] = result
            if on_result is not None:
                on_result(i, result)

        if len(prompts) > 1:
            finish(0, self._request(prompts[0], options))
        rest = range(1 if len(prompts) > 1 else 0, len(prompts))
        workers = max(1, min(self.max_concurrency, len(rest)))
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="radixkv-sdk") as pool:
            futures = {pool.submit(self._request, prompts[i], options): i for i in rest}
            try:
                for future in concurrent.futures.as_completed(futures):
                    finish(futures[future], future.result())  # callbacks on the caller's thread
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                raise
        return results  # type: ignore[return-value]

    def pin(self, prefix: Prompt) -> Pin:
        body: dict[str, Any] = {"model": self.model}
        if prefix.token_ids is not None:
            body["prompt"] = list(prefix.token_ids)
        elif prefix.text is not None:
            body["prompt"] = prefix.text
        else:
            body["messages"] = prefix.messages
        if self.salt is not None:
            body["cache_salt"] = self.salt
        response = self._call(lambda: self.client.post("/cache/pin", body=body, cast_to=object))
        return Pin(int(response["pin_id"]), int(response["pinned_tokens"]), int(response["prompt_tokens"]), self)

    def unpin(self, pin_id: int) -> bool:
        import openai

        try:
            self.client.delete(f"/cache/pin/{int(pin_id)}", cast_to=object)
        except openai.NotFoundError:
            return False
        return True

    # -- one request -------------------------------------------------------------------------

    def _options(self, params: SamplingParams, *, chat: bool) -> dict[str, Any]:
        """The request's options for the chat (messages) or the completions endpoint."""
        options: dict[str, Any] = {
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "n": params.n,
        }
        if params.seed is not None:
            options["seed"] = params.seed
        if params.stop:
            options["stop"] = list(params.stop)
        extra_body: dict[str, Any] = {}
        if isinstance(params.guide, GrammarGuide):
            extra_body["guided_regex" if params.guide.kind == "regex" else "guided_grammar"] = params.guide.source
        elif params.guide is not None:
            # OpenAI's response_format; the completions endpoint has no such field, so there it
            # travels in the body as vLLM's extension, which radixkv takes too.
            guide = params.guide
            if guide.schema is None:
                response_format: dict[str, Any] = {"type": "json_object"}
            else:
                schema = json.loads(guide.schema)
                response_format = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema, "strict": guide.strict}}
            (options if chat else extra_body)["response_format"] = response_format
        if params.logprobs is not None:
            if chat:
                options["logprobs"] = True
                options["top_logprobs"] = params.logprobs
            else:
                options["logprobs"] = params.logprobs
        if params.logit_bias:
            options["logit_bias"] = {str(token): bias for token, bias in params.logit_bias.items()}
        # vLLM's extensions, which radixkv's OpenAI endpoints take too.
        for name, default in (("top_k", 0), ("stop_token_ids", []), ("ignore_eos", False), ("min_tokens", 0)):
            if getattr(params, name) != default:
                extra_body[name] = getattr(params, name)
        if self.salt is not None:
            extra_body["cache_salt"] = self.salt
        if extra_body:
            options["extra_body"] = extra_body
        return options

    def _request(self, prompt: Prompt, options_by_chat: dict[bool, dict[str, Any]]) -> Result:
        options = options_by_chat[prompt.messages is not None]
        try:
            # Messages and text go as they are (the server renders and tokenizes them exactly as
            # the SDK does); token ids only when that is all there is (a template's prefix).
            if prompt.messages is not None:
                response = self.client.chat.completions.create(model=self.model, messages=prompt.messages, **options)
                choices = sorted(response.choices, key=lambda c: c.index)
                texts = [c.message.content or "" for c in choices]
            else:
                source = prompt.text if prompt.text is not None else list(prompt.token_ids or [])
                response = self.client.completions.create(model=self.model, prompt=source, **options)
                choices = sorted(response.choices, key=lambda c: c.index)
                texts = [c.text for c in choices]
        except Exception as error:  # noqa: BLE001 - one prompt's failure is reported on it
            return Result(error=_error_message(error))
        usage = response.usage
        details = getattr(usage, "prompt_tokens_details", None)
        return Result(
            text=texts[0] if texts else "",
            texts=texts,
            num_prompt_tokens=usage.prompt_tokens if usage else 0,
            num_output_tokens=usage.completion_tokens if usage else 0,
            num_cached_tokens=(getattr(details, "cached_tokens", None) or 0) if details else 0,
            finish_reason=choices[0].finish_reason if choices else None,
        )

    @staticmethod
    def _call(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as error:  # noqa: BLE001 - reraised with the server's message
            raise GenerationError(_error_message(error)) from error


def _error_message(error: BaseException) -> str:
    import openai

    if isinstance(error, openai.APIStatusError):
        body = error.body
        message = body.get("message") if isinstance(body, dict) else None
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            message = body["error"].get("message")
        return f"HTTP {error.status_code}: {message or error.message}"
    return f"{type(error).__name__}: {error}"


def _one(results: list[Result]) -> Result:
    [result] = results
    if result.error is not None:
        raise GenerationError(result.error)
    return result


# -- choosing one ------------------------------------------------------------------------------


def as_backend(target: Any, **options: Any) -> Backend:
    """A Backend for `target`: itself, an `LLM` (in process), an `openai.OpenAI` client or a
    base URL string (HTTP). `options` go to the backend's constructor."""
    if isinstance(target, Backend):
        if options:
            raise TypeError("options apply only when a backend is made here, not to an existing Backend")
        return target
    if isinstance(target, str):
        return HTTPBackend(target, **options)
    if hasattr(target, "engine") and hasattr(target, "tokenizer") and hasattr(target, "generate"):
        return InProcessBackend(target, **options)  # a radixkv.LLM (duck-typed: no torch import here)
    try:
        import openai
    except ImportError:
        openai = None  # type: ignore[assignment]
    if openai is not None and isinstance(target, openai.OpenAI):
        return HTTPBackend(target, **options)
    raise TypeError(
        f"expected a radixkv.LLM, a Backend, an openai.OpenAI client or a base URL, got {type(target).__name__}"
    )
