"""OpenAI-style error bodies and the exception handlers shared by the node and the proxy."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.api.guards import RETRY_AFTER_S
from pdserve.sampling_params import InvalidParameter


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type_ or {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                              404: "not_found_error", 429: "rate_limit_error"}.get(status, "server_error")


def error_body(status: int, message: str, param: str | None = None, type_: str | None = None) -> dict:
    err = APIError(status, message, param, type_)
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": status}}


def error_response(status: int, message: str, param: str | None = None, type_: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, type_), status_code=status, headers=headers)


def too_busy(waiting: int) -> JSONResponse:
    return error_response(429, f"server busy: {waiting} requests already waiting; retry later",
                          type_="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)})


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as OpenAI's `{"error": {...}}` body; invalid bodies get 400 naming the field."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.type)

    @app.exception_handler(InvalidParameter)
    async def _invalid(_: Request, exc: InvalidParameter):
        return error_response(400, str(exc), exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON body: {first.get('msg', '')}", None)
        param = ".".join(loc) or None
        return error_response(400, f"invalid request: {param}: {first.get('msg', 'invalid value')}", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))
