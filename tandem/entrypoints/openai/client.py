"""Reaching a running OpenAI-compatible server from Tandem's clients (``tandem bench
serve``, ``tandem eval --base-url``): one clear error when nothing answers."""

from __future__ import annotations


def served_models(base_url: str, timeout: float = 30.0) -> list[str]:
    """The model ids of ``GET /v1/models`` at ``base_url`` (with or without ``/v1``).

    Raises:
        ConnectionError: no server answers there, or it answers with an HTTP error; the
            message names the URL and what to do.
    """
    import httpx

    root = base_url.rstrip("/").removesuffix("/v1")
    url = f"{root}/v1/models"
    try:
        r = httpx.get(url, timeout=timeout)
    except httpx.TransportError as e:
        raise ConnectionError(f"no server answers at {root} ({type(e).__name__}: {e or 'no reply'}); start one with "
                              f"`tandem serve` or fix --base-url") from None
    if r.status_code != 200:
        raise ConnectionError(f"{url} answered HTTP {r.status_code}: is {root} an OpenAI-compatible server?")
    return [m["id"] for m in r.json().get("data", [])]
