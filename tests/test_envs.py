"""tandem.envs: values are read at access time and validated, naming the variable."""

from __future__ import annotations

import pytest

from tandem import envs


def test_read_at_access_time_with_defaults(monkeypatch):
    monkeypatch.delenv("TANDEM_STARTUP_TIMEOUT_S", raising=False)
    assert envs.TANDEM_STARTUP_TIMEOUT_S == 1800.0
    monkeypatch.setenv("TANDEM_STARTUP_TIMEOUT_S", "12.5")
    assert envs.TANDEM_STARTUP_TIMEOUT_S == 12.5
    monkeypatch.setenv("TANDEM_MOE_IMPL", " Triton ")
    assert envs.TANDEM_MOE_IMPL == "triton"


def test_structured_output_threads_default_is_half_the_cpus_up_to_8(monkeypatch):
    monkeypatch.delenv("TANDEM_STRUCTURED_OUTPUT_THREADS", raising=False)
    for cpus, threads in ((1, 1), (2, 1), (16, 8), (64, 8)):
        monkeypatch.setattr(envs.os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)))
        assert envs.TANDEM_STRUCTURED_OUTPUT_THREADS == threads
    monkeypatch.setenv("TANDEM_STRUCTURED_OUTPUT_THREADS", "3")
    assert envs.TANDEM_STRUCTURED_OUTPUT_THREADS == 3


@pytest.mark.parametrize("name,value", [("TANDEM_MOE_IMPL", "fastest"), ("TANDEM_FUSED_OPS", "cuda"),
                                        ("TANDEM_STARTUP_TIMEOUT_S", "soon"), ("TANDEM_LOGGING_LEVEL", "loud"),
                                        ("TANDEM_STRUCTURED_OUTPUT_THREADS", "0"),
                                        ("TANDEM_STRUCTURED_OUTPUT_THREADS", "many"),
                                        ("TANDEM_FP8_DEFERRED_SCALES_MAX_ROWS", "-1")])
def test_bad_values_name_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        getattr(envs, name)


def test_unknown_attribute():
    with pytest.raises(AttributeError):
        envs.TANDEM_NOT_A_VARIABLE  # noqa: B018
    assert "TANDEM_MOE_IMPL" in dir(envs)


def test_cache_root_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv("TANDEM_CACHE_ROOT", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert envs.TANDEM_CACHE_ROOT == str(tmp_path / "xdg" / "tandem")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert envs.TANDEM_CACHE_ROOT == str(tmp_path / "home" / ".cache" / "tandem")
    monkeypatch.setenv("TANDEM_CACHE_ROOT", str(tmp_path / "mine"))
    assert envs.TANDEM_CACHE_ROOT == str(tmp_path / "mine")
    from tandem.model_loader.gguf_cache import cache_root

    assert cache_root() == str(tmp_path / "mine" / "gguf")


def test_library_cache_limits_are_defaults(monkeypatch):
    """An engine bounds oneDNN's shape-keyed caches where the user has not."""
    for name in envs.LIBRARY_CACHE_LIMITS:
        monkeypatch.setenv(name, "unset below")  # recorded, so that the test restores the environment
        monkeypatch.delenv(name)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    envs.set_library_cache_limits()
    assert envs.os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"
    assert envs.os.environ["LRU_CACHE_CAPACITY"] == "7"


def test_core_malloc_arena_max_yields_to_the_user(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert envs.core_malloc_arena_max() == 2
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert envs.core_malloc_arena_max() is None
