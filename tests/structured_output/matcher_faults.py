"""A grammar matcher that fails on purpose: the kind of fault an xgrammar error at run time
is, injected into one request of an engine (tests of the engine and of speculation)."""

from __future__ import annotations

from tandem.structured_output.manager import StructuredOutputRequest

# What fails: creating the matcher, or its n-th call of one of these methods.
FAULTS = ("create", "fill_next_token_bitmask", "accept_token")


class FaultyMatcher:
    """Wraps a real ``xgrammar.GrammarMatcher``; its ``after``-th call of ``method`` (and
    every one after) raises. It hides the C++ handle, so a batched xgrammar call given it
    raises (AttributeError), as a C++ error of one matcher fails the whole batch."""

    def __init__(self, matcher, method: str, after: int) -> None:
        self._matcher, self._method, self._calls_left = matcher, method, after

    def __getattr__(self, name: str):
        if name == "_handle":  # what xgrammar's batched calls read: they fail on this object
            raise AttributeError(name)
        real = getattr(self._matcher, name)
        if name != self._method:
            return real

        def call(*args, **kwargs):
            self._calls_left -= 1
            if self._calls_left <= 0:
                raise RuntimeError(f"[12:00:00] /project/cpp/grammar_matcher.cc:1: simulated {name} failure")
            return real(*args, **kwargs)
        return call


class _FaultyRequest(StructuredOutputRequest):
    def __init__(self, compiled, fault: str, after: int) -> None:
        super().__init__(compiled)
        self._fault, self._after = fault, after

    @property
    def matcher(self):
        if self._fault == "create":
            raise RuntimeError("simulated create failure")
        if self._matcher is None:
            self._matcher = FaultyMatcher(super().matcher, self._fault, self._after)
        return self._matcher


def inject_matcher_fault(monkeypatch, manager, prompt_token_ids: list[int], fault: str, after: int = 3) -> None:
    """Make the matcher of the request with ``prompt_token_ids`` fail with ``fault`` (one
    of :data:`FAULTS`) once the engine adds it to ``manager``."""
    init = manager.init_request

    def init_request(req):
        init(req)
        if list(req.prompt_token_ids) == list(prompt_token_ids):
            req.structured_output = _FaultyRequest(req.structured_output._compiled, fault, after)
    monkeypatch.setattr(manager, "init_request", init_request)


def expected_error(fault: str) -> str:
    """The error the faulty request ends with (the C++ location left out)."""
    return f"grammar matcher failed: simulated {'create' if fault == 'create' else fault} failure"
