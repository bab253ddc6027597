"""Every error the server answers with, in OpenAI's error shape: APIError, the app's exception
handlers, request-body validation errors, and the engine's errors mapped by their fields
(param, code) into the names the request itself used (WireNames).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixkv.engine.async_engine import EngineStepError, EngineStopped
from radixkv.errors import InvalidRequest, OwnerCapExceeded, QueueFull
from radixkv.server.guards.request_caps import CapExceeded

logger = logging.getLogger("radixkv.server")

M = TypeVar("M", bound=BaseModel)

# What AsyncEngine.submit and a request's stream may raise that is not a bug of the server.
ENGINE_ERRORS = (InvalidRequest, QueueFull, EngineStopped, EngineStepError)


# The two wire shapes of an error: OpenAI's, and Anthropic's on its own paths.
class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


# Anthropic's error type per HTTP status; 529 is its "overloaded".
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


@dataclass(frozen=True, slots=True)
class WireNames:
    """One wire format's names for the engine's parameters, the one place they are mapped: a
    chat request's prompt is its `messages`, its max_tokens may be `max_completion_tokens`, a
    Responses request's are `input` and `max_output_tokens`. `guide` is the field a JSON guide
    came from (response_format, text.format, or tools when a call is forced); None keeps the
    engine's name."""

    prompt: str = "prompt"
    max_tokens: str = "max_tokens"
    guide: str | None = None

    def of(self, param: str | None) -> str | None:
        if param == "prompt":
            return self.prompt
        if param == "max_tokens":
            return self.max_tokens
        if param in ("response_format", "guide") and self.guide is not None:
            return self.guide
        return param


class APIError(Exception):
    """An error the client caused (or may retry), rendered in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def anthropic_response(self) -> JSONResponse:
        """This error in Anthropic's shape, for /v1/messages (529 where OpenAI's layer says 503)."""
        status = {503: 529, 422: 400}.get(self.status, self.status)
        return JSONResponse(anthropic_error_body(status, self.message), status_code=status, headers=self.headers)

    def response_for(self, path: str) -> JSONResponse:
        """In the shape of the API `path` belongs to (for errors raised before any route runs)."""
        return self.anthropic_response() if path.startswith(ANTHROPIC_PATH) else self.response()


ANTHROPIC_PATH = "/v1/messages"


class ClientGone(Exception):
    """The client disconnected before its (non-streamed) response was ready."""


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> Response:
        return error.response()

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> Response:
        return _validation_error(error.errors()).response()  # 400, not FastAPI's 422

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> Response:
        kind = "not_found" if error.status_code == 404 else None
        return APIError(error.status_code, str(error.detail), code=kind, headers=error.headers).response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception) -> Response:
        logger.exception("unhandled error", exc_info=error)
        return APIError(500, "internal server error", type="server_error", code="internal_error").response()


def rate_limited(message: str, retry_after_s: int = 1) -> APIError:
    """A 429 for a key past one of its per-key shares, telling the client when to retry."""
    return APIError(
        429, message, type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(retry_after_s)}
    )


# -- request bodies --------------------------------------------------------------------------


def parse_body(model: type[M], raw: bytes) -> M:
    """The body as `model`, or APIError 400 naming the first field that is wrong."""
    try:
        return model.model_validate_json(raw or b"null")
    except ValidationError as error:
        raise _validation_error(error.errors()) from None


def validation_error_at(prefix: Sequence[str | int], errors: Sequence[Any]) -> APIError:
    """A part validated on its own (a Responses input item) as the body's error would be, its
    location under `prefix`."""
    return _validation_error([{**e, "loc": (*prefix, *e.get("loc", ()))} for e in errors])


def _validation_error(errors: Sequence[Any]) -> APIError:
    capped = next((e for e in errors if _cap_of(e) is not None or e.get("type") == "too_long"), None)
    if capped is not None:
        return _cap_error(capped)
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}")
    locs = [[str(part) for part in e.get("loc", ()) if part != "body"] for e in errors] or [[]]
    if first.get("type") == "model_type" and not locs[0]:
        return APIError(400, "the request body must be a JSON object")
    # Several errors under one field are the branches of a union (`stop`: a string or a list
    # of strings): name the field itself, not a branch.
    loc = locs[0]
    if len(errors) > 1:
        common = 0
        while all(len(other) > common and other[common] == loc[common] for other in locs):
            common += 1
        loc = loc[:common] or loc
    param = ".".join(loc) or None
    detail = str(first.get("msg", "invalid value"))
    if len(loc) < len(locs[0]):  # the branch that got furthest says most
        deepest = max(range(len(errors)), key=lambda i: len(locs[i]))
        where = ".".join(locs[deepest][len(loc) :])
        detail = f"matches no accepted form; as {where}: {errors[deepest].get('msg', 'invalid value')}"
    message = f"{param}: {detail}" if param else detail
    return APIError(400, message, param=param)


def _cap_of(error: Any) -> CapExceeded | None:
    cause = error.get("ctx", {}).get("error") if isinstance(error.get("ctx"), dict) else None
    return cause if isinstance(cause, CapExceeded) else None


def _cap_error(error: Any) -> APIError:
    """A request part past its cap (request_caps): named alone, even under a union whose other
    branches also failed, since the cap is what the client must change."""
    cap = _cap_of(error)
    loc = ".".join(str(part) for part in error.get("loc", ()) if part != "body")
    param = (cap.param if cap is not None else None) or loc or None
    detail = cap.message if cap is not None else str(error.get("msg", "too long"))
    return APIError(400, f"{param}: {detail}" if param else detail, param=param)


# -- engine errors ---------------------------------------------------------------------------


def engine_error(error: BaseException, names: WireNames | None = None) -> APIError:
    """An engine error as the client sees it, its param in the request's own names (`names`,
    server.sampling's map for the request's wire format); anything unexpected is the engine
    failing (500). A request a step failed alone for its own input (a schema with no way on)
    is the client's error (400), as if refused up front; one past its owner's own share of a
    cap is 429, as the per-key quotas are."""
    if isinstance(error, EngineStepError) and isinstance(error.__cause__, InvalidRequest):
        error = error.__cause__
    if isinstance(error, InvalidRequest):
        param = names.of(error.param) if names is not None else error.param
        # The engine's message names its own parameter; say which field of the request that is.
        message = error.message if param == error.param else f"{param}: {error.message}"
        if isinstance(error, OwnerCapExceeded):
            return APIError(429, message, type="rate_limit_error", param=param, code=error.code)
        return APIError(400, message, param=param, code=error.code)
    if isinstance(error, QueueFull):
        return APIError(503, str(error), type="server_error", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(error, EngineStopped):
        # Its text may carry the internal error that stopped the engine: never sent to clients.
        return APIError(503, "the engine is not running", type="server_error", code="engine_down")
    return APIError(500, "the engine failed while running this request", type="server_error", code="engine_error")
