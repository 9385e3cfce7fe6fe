"""The on-disk cache of converted GGUF files: reuse, invalidation, atomic entries, and
that a cached entry holds what loading the GGUF file directly gives."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tandem.model_loader import gguf_cache


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.delenv("TANDEM_CACHE_ROOT", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    gguf_cache._converted_folder.cache_clear()
    yield tmp_path / "cache" / "tandem" / "gguf"
    gguf_cache._converted_folder.cache_clear()


@pytest.fixture
def fake_convert(monkeypatch):
    """A converter that writes one file holding the source's bytes (counts its calls)."""
    calls = []

    def convert(path: str, out: str) -> None:
        calls.append(path)
        with open(path, "rb") as src, open(os.path.join(out, "payload"), "wb") as dst:
            dst.write(src.read())

    monkeypatch.setattr(gguf_cache, "_convert", convert)
    return calls


def _entries(root) -> list[str]:
    return sorted(e for e in os.listdir(root) if e != gguf_cache.HASHES_DIR) if os.path.isdir(root) else []


def test_reused_then_invalidated_when_the_file_changes(tmp_path, cache_home, fake_convert):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"v1")
    first = gguf_cache.converted_folder(str(src))
    assert first is not None and os.path.dirname(first) == str(cache_home)
    assert gguf_cache.converted_folder(str(src)) == first
    gguf_cache._converted_folder.cache_clear()  # a new process: found on disk, not converted again
    assert gguf_cache.converted_folder(str(src)) == first
    assert len(fake_convert) == 1
    with open(os.path.join(first, gguf_cache.SOURCE_FILE)) as f:
        assert json.load(f)["paths"] == [os.path.realpath(src)]

    src.write_bytes(b"v2")  # new content (and mtime)
    second = gguf_cache.converted_folder(str(src))
    assert second != first and len(fake_convert) == 2
    assert open(os.path.join(second, "payload"), "rb").read() == b"v2"
    assert _entries(cache_home) == [os.path.basename(second)]  # the stale entry is gone

    st = os.stat(src)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same bytes, touched: same content
    assert gguf_cache.converted_folder(str(src)) == second and len(fake_convert) == 2


def test_copies_of_one_file_share_one_entry(tmp_path, cache_home, fake_convert, embedded_model_path):
    """Two installations of the same GGUF file (other paths, other modification times): one
    conversion, one copy on disk."""
    a, b = tmp_path / "venv1" / "m.gguf", tmp_path / "venv2" / "m.gguf"
    for p in (a, b):
        p.parent.mkdir()
        shutil.copyfile(embedded_model_path, p)
    os.utime(b, ns=(10**18, 10**18))
    assert gguf_cache.converted_folder(str(a)) == gguf_cache.converted_folder(str(b))
    assert len(fake_convert) == 1 and len(_entries(cache_home)) == 1
    (entry,) = _entries(cache_home)
    with open(cache_home / entry / gguf_cache.SOURCE_FILE) as f:
        assert json.load(f)["paths"] == [os.path.realpath(a), os.path.realpath(b)]


def test_an_entry_stays_while_another_path_holds_its_content(tmp_path, cache_home, fake_convert):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"v1")
    b.write_bytes(b"v1")
    shared = gguf_cache.converted_folder(str(a))
    assert gguf_cache.converted_folder(str(b)) == shared
    a.write_bytes(b"v2")  # a is upgraded; b still holds v1
    new_a = gguf_cache.converted_folder(str(a))
    assert sorted(_entries(cache_home)) == sorted([os.path.basename(shared), os.path.basename(new_a)])
    b.write_bytes(b"v2")  # b too: v1's entry has no user left
    assert gguf_cache.converted_folder(str(b)) == new_a
    assert _entries(cache_home) == [os.path.basename(new_a)] and len(fake_convert) == 2


def test_the_file_is_hashed_once_per_change(tmp_path, cache_home, monkeypatch):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"abcd")
    hashed = []
    real_hash = gguf_cache._file_sha256
    monkeypatch.setattr(gguf_cache, "_file_sha256", lambda p: hashed.append(p) or real_hash(p))
    first = gguf_cache.content_digest(str(src))
    assert gguf_cache.content_digest(str(src)) == first and len(hashed) == 1  # remembered on disk
    st = os.stat(src)
    src.write_bytes(b"abce")
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert gguf_cache.content_digest(str(src)) != first and len(hashed) == 2


def test_same_size_same_mtime_other_content_is_a_new_key(tmp_path, cache_home):
    a = tmp_path / "a.gguf"
    a.write_bytes(b"abcd")
    ia = gguf_cache.source_info(str(a))
    st = os.stat(a)
    gguf_cache._converted_folder.cache_clear()
    os.remove(a)  # a new file with other bytes, the same size and mtime (and maybe the same inode)
    a.write_bytes(b"abce")
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert gguf_cache.cache_key(gguf_cache.source_info(str(a))) != gguf_cache.cache_key(ia)


def test_failed_conversion_leaves_nothing(tmp_path, cache_home, monkeypatch):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")

    def broken(path, out):
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write("{")
        raise ValueError("unsupported architecture")

    monkeypatch.setattr(gguf_cache, "_convert", broken)
    with pytest.raises(ValueError, match="unsupported"):
        gguf_cache.converted_folder(str(src))
    assert _entries(cache_home) == []  # neither a partial entry nor a temporary folder


def test_unwritable_cache_falls_back(tmp_path, cache_home, fake_convert):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")
    cache_home.parent.mkdir(parents=True)
    cache_home.write_text("a file where the cache folder should be")
    assert gguf_cache.converted_folder(str(src)) is None
    assert fake_convert == []


def test_concurrent_conversion_loses_the_rename_gracefully(tmp_path, cache_home, monkeypatch):
    """Another process renamed its entry first: ours is discarded, theirs is used."""
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")
    dest = os.path.join(str(cache_home), gguf_cache.cache_key(gguf_cache.source_info(str(src))))

    def racing(path, out):
        os.makedirs(dest)
        with open(os.path.join(dest, gguf_cache.SOURCE_FILE), "w") as f:
            f.write("{}")
        with open(os.path.join(dest, "theirs"), "w") as f:
            f.write("1")

    monkeypatch.setattr(gguf_cache, "_convert", racing)
    assert gguf_cache.converted_folder(str(src)) == dest
    assert os.path.exists(os.path.join(dest, "theirs"))
    assert _entries(cache_home) == [os.path.basename(dest)]


def test_cached_entry_equals_direct_gguf_load(embedded_model_path):
    """The embedded model's entry (in the real cache: built once per machine) holds the
    config and tokenizer that reading the GGUF file gives."""
    from transformers import AutoConfig, AutoTokenizer

    folder = gguf_cache.converted_folder(embedded_model_path)
    assert folder is not None
    gdir, name = os.path.split(embedded_model_path)
    direct_cfg = AutoConfig.from_pretrained(gdir, gguf_file=name)
    cached_cfg = AutoConfig.from_pretrained(folder)
    strip = lambda d: {k: v for k, v in d.items() if "name_or_path" not in k}  # noqa: E731
    assert strip(cached_cfg.to_dict()) == strip(direct_cfg.to_dict())
    direct_tok = AutoTokenizer.from_pretrained(gdir, gguf_file=name)
    cached_tok = AutoTokenizer.from_pretrained(folder)
    text = "Hello <|im_start|>user\nünïcode 日本語 tabs\tand  spaces<|im_end|>"
    assert cached_tok.encode(text) == direct_tok.encode(text)
    assert cached_tok.chat_template == direct_tok.chat_template
    assert cached_tok.special_tokens_map == direct_tok.special_tokens_map


@pytest.fixture
def tiny_gguf(tmp_path, cache_home, monkeypatch):
    """A small GGUF file of Llama tensors (fp32, Q8_0), whose config and tokenizer stand
    in for transformers' reading of GGUF metadata (seconds for a real file)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig

    path = tmp_path / "tiny.gguf"
    w = GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((300, 64), dtype=np.float32))
    w.add_tensor("output_norm.weight", rng.standard_normal(64, dtype=np.float32))
    q8 = quantize(rng.standard_normal((64, 64), dtype=np.float32), GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    class Tokenizer:
        def save_pretrained(self, out: str) -> None:
            pass

    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    monkeypatch.setattr(AutoConfig, "from_pretrained", lambda *a, **k: config)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: Tokenizer())
    return str(path)


def test_conversion_writes_no_weights_and_the_checkpoint_is_written_on_request(tiny_gguf, monkeypatch):
    """A conversion writes config and tokenizer only (loads cache their own parameters); a
    reader of a whole HF checkpoint gets the fp32 weights written once into the entry,
    equal to the file's dequantized tensors, which the loader then reads."""
    from safetensors.torch import load_file

    from tandem.model_loader.gguf_weights import iterate_gguf_weights
    from tandem.model_loader.loader import iterate_gguf_weights_cached, load_hf_config

    folder = gguf_cache.converted_folder(tiny_gguf)
    assert not os.path.exists(os.path.join(folder, gguf_cache.WEIGHTS_FILE))
    assert gguf_cache.checkpoint_folder(tiny_gguf) == folder
    cached = load_file(os.path.join(folder, gguf_cache.WEIGHTS_FILE))
    direct = dict(iterate_gguf_weights(tiny_gguf, load_hf_config(tiny_gguf)))
    assert cached.keys() == direct.keys() == {"model.embed_tokens.weight", "model.norm.weight",
                                              "model.layers.0.self_attn.q_proj.weight"}
    for k, t in direct.items():
        assert cached[k].dtype == torch.float32 and torch.equal(cached[k], t), k
    assert [e for e in os.listdir(folder) if e.startswith(".")] == []  # no temporary file left

    def written_again(*args):
        raise AssertionError("the checkpoint was written again")

    monkeypatch.setattr(gguf_cache, "_write_checkpoint", written_again)
    assert gguf_cache.checkpoint_folder(tiny_gguf) == folder
    monkeypatch.setattr("tandem.model_loader.gguf_weights.open_gguf", written_again)  # read, not dequantized
    loaded = dict(iterate_gguf_weights_cached(tiny_gguf, load_hf_config(tiny_gguf)))
    assert all(torch.equal(loaded[k], t) for k, t in direct.items())


def test_checkpoint_not_writable_is_none(tiny_gguf, monkeypatch):
    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf_cache, "_write_checkpoint", full_disk)
    assert gguf_cache.checkpoint_folder(tiny_gguf) is None
    assert gguf_cache.converted_folder(tiny_gguf) is not None  # loads still use the entry


def test_concurrent_first_loads_convert_once(tmp_path, cache_home, monkeypatch):
    """`tandem serve` reads the tokenizer in its front end while the engine core reads the
    config: the second first load waits for the first conversion instead of doing its own."""
    import threading
    import time

    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")
    calls = []

    def slow(path: str, out: str) -> None:
        calls.append(path)
        time.sleep(0.5)

    monkeypatch.setattr(gguf_cache, "_convert", slow)
    results = []
    threads = [threading.Thread(target=lambda: results.append(gguf_cache.converted_folder(str(src))))
               for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.1)  # the second arrives while the first converts
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and results[0] is not None
    assert _entries(cache_home) == [os.path.basename(results[0])]  # no lock file left


@pytest.mark.parametrize("keep", [0.01, 0.9], ids=["metadata-cut", "tensor-data-cut"])
def test_a_truncated_file_is_named_in_one_error(tmp_path, cache_home, embedded_model_path, keep):
    """A GGUF file cut short (an interrupted download), its metadata or its last tensors
    missing: the conversion and the reader raise one ValueError naming the file and its size,
    and the cache keeps no entry."""
    from tandem.model_loader.gguf_weights import open_gguf

    data = open(embedded_model_path, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    message = rf"{cut} \({os.path.getsize(cut):,} bytes\) is not a whole GGUF file: truncated or damaged"
    with pytest.raises(ValueError, match=message):
        gguf_cache.converted_folder(str(cut))
    assert _entries(cache_home) == []
    with pytest.raises(ValueError, match=message):
        open_gguf(str(cut))
