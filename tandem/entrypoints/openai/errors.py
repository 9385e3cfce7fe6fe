"""Errors answered with an OpenAI-style body (``{"error": {...}}``): as the response to a
bad request, or as the last event of a stream that failed."""

from __future__ import annotations

from tandem.entrypoints.openai import protocol as P


class OpenAIError(Exception):
    """An error answered with an OpenAI-style body (``{"error": {...}}``)."""

    def __init__(self, message: str, status_code: int = 400, err_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.err_type = err_type
        self.param = param

    def body(self) -> dict:
        return error_body(self.message, self.status_code, self.err_type, self.param)


def error_body(message: str, code: int, err_type: str, param: str | None = None) -> dict:
    return P.ErrorResponse(error=P.ErrorInfo(message=message, type=err_type, param=param, code=code)).model_dump()


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, 400, "BadRequestError", param)


def model_not_found(name: str) -> OpenAIError:
    """OpenAI's and vLLM's answer to a model id that is not served: 404, naming ``model``."""
    return OpenAIError(f"The model `{name}` does not exist.", 404, "NotFoundError", "model")
