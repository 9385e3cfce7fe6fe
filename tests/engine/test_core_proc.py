"""A spawned engine core (tandem.engine.core_proc.run_engine_core) that fails to load."""

from __future__ import annotations

import multiprocessing
import os

import zmq

from tandem.engine.arg_utils import EngineArgs
from tandem.engine.core_proc import run_engine_core
from tandem.engine.launch import CoreLaunch, EngineZmqAddresses
from tandem.engine.messages import CoreMessage, EngineCoreOutputs, MsgpackDecoder


def test_bad_input_at_load_is_reported_and_leaves_no_traceback(tmp_path, capfd):
    """A model the core cannot load (a config.json, no weights: bad input) is reported to the
    front end as one line (``config_error``), and the rank exits 1 without printing a
    traceback itself, whether or not the front end stops it first (it used to print one when
    it won that race, after the front end's one line)."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    config = EngineArgs(model=str(tmp_path), device="cpu").create_engine_config()
    ctx = zmq.Context()
    front = ctx.socket(zmq.PULL)
    addr = f"ipc://{tmp_path}/out"
    front.bind(addr)
    try:
        proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(CoreLaunch(config, EngineZmqAddresses([[f"ipc://{tmp_path}/in"]], [addr]), os.getpid()),))
        proc.start()
        assert front.poll(120_000), "no message from the failed rank"
        msg = MsgpackDecoder(CoreMessage).decode(front.recv())
        proc.join(60)
    finally:
        front.close(0)
        ctx.term()
    assert isinstance(msg, EngineCoreOutputs) and msg.engine_dead
    assert "safetensors" in msg.config_error and str(tmp_path) in msg.config_error
    assert proc.exitcode == 1
    assert "Traceback" not in capfd.readouterr().err
