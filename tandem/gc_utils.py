"""The garbage collector in long-running engine processes.

After vLLM's ``vllm/utils/gc_utils.py``: once an engine has started, everything alive then
(imported modules, the model, tokenizer tables) lives until shutdown, yet every full
collection of the oldest generation walks all of it. With torch and transformers imported
that is hundreds of thousands of objects, a pause of tens to hundreds of milliseconds that
lands in whichever engine step triggers it (benchmarks/RESULTS.md, "Session 7 — host time
per decode step"). :func:`freeze_gc_heap` moves the startup heap into the permanent
generation, which collections skip; objects created later are still collected.
"""

from __future__ import annotations

import gc


def freeze_gc_heap() -> int:
    """Collect garbage, then freeze every object still tracked (``gc.freeze``).

    Call once startup is done (an engine core built, a front end ready); calling it again
    later freezes what has been created since. Collecting first keeps startup garbage from
    becoming permanent (frozen objects are never collected, only freed by reference count).

    Returns:
        Objects now in the permanent generation (``gc.get_freeze_count()``).
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
