"""OpenAI-style error responses: {"error": {"message", "type", "param", "code"}}.

Messages are written for the client: they never carry a stack trace or an internal path (unexpected
errors are logged server-side and answered with a fixed message).
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

ERROR_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)
