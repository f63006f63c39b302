"""The watchdog's automatic phase timeout and its last line (single process: no thread, no service)."""

import json
import threading
import time

import pytest

from ejax.parallel import watchdog


def test_the_automatic_timeout_is_20x_the_median_warmed_up_step_and_at_least_300_s():
  dog = watchdog.Watchdog("train")
  assert dog.timeout_s() == 300  # nothing timed yet: compiling and the first steps are not timed
  for seconds in [90.0, 90.0, 90.0, 10.0, 30.0, 20.0]:  # the first 3 (warm-up) are left out
    dog._steps_timed += 1
    if dog._steps_timed > watchdog.WARMUP_STEPS:
      dog._step_seconds.append(seconds)
  assert dog.timeout_s() == 20 * 20.0
  dog._step_seconds.clear()
  dog._step_seconds.extend([1.0] * 10)
  assert dog.timeout_s() == 300  # 20 s would be too eager
  assert watchdog.Watchdog("train", timeout_s=12.5).timeout_s() == 12.5


def test_a_peer_is_lost_after_the_runs_setting_which_must_sit_below_jaxs_heartbeat_timeout(monkeypatch):
  from ml_collections import ConfigDict

  from ejax.errors import UserError
  from ejax.parallel import distributed
  assert watchdog.Watchdog("train")._lost_after_s == distributed.PEER_LOST_AFTER_S == 40
  monkeypatch.setattr(distributed, "_peer_lost_after_s", 15.0)  # what initialize() keeps of the config
  assert watchdog.Watchdog("train")._lost_after_s == 15.0
  assert watchdog.Watchdog("train", lost_after_s=3.0)._lost_after_s == 3.0
  for value in (5.0, 150.0):  # under a few heartbeats; at jax's own timeout, which aborts instead
    cfg = ConfigDict(dict(coordinator_address="127.0.0.1:1", num_processes=2, process_id=0, peer_lost_after=value))
    with pytest.raises(UserError, match=r"distributed\.peer_lost_after=\d+: set it between 10 s and jax's "
                                        r"heartbeat timeout \(150 s\)"):
      distributed.initialize(cfg)


def test_the_line_names_the_process_the_step_and_where_to_resume():
  dog = watchdog.Watchdog("train", resume_from=lambda: 10)
  dog.count = 2
  assert dog._line(1, 12, "no heartbeat for 41 s") == (
      "error: process 1 of 2 stopped answering at step 12 (train: no heartbeat for 41 s): "
      "run the same command to resume from step 10")
  rl = watchdog.Watchdog("rl", unit="update", resume_from=lambda: None)
  rl.count = 2
  assert rl._line(None, 3, "x").startswith("error: every process of 2 stopped answering at update 3 (rl: x): "
                                          "run the same command to start again")


def _waiting_dog(monkeypatch, store: dict, verdict_s: float) -> watchdog.Watchdog:
  """A watchdog of process 0 of 2 whose thread (a stand-in) ends the process after verdict_s."""
  monkeypatch.setattr(watchdog.distributed, "kv_try_get", store.get)
  dog = watchdog.Watchdog("train", heartbeat_s=0.04)
  dog.count = 2
  dog._thread = threading.Thread(target=time.sleep, args=(verdict_s,), daemon=True)
  dog._thread.start()
  return dog


def _beat(store: dict, seq: int, done: bool = False) -> None:
  store["ejax/watchdog/train/1"] = json.dumps({"seq": seq, "step": 4, "phase": None, "done": done})


def test_after_a_failed_step_a_dead_peer_waits_for_the_verdict_and_live_peers_let_the_error_stand(monkeypatch):
  store = {}
  _beat(store, 7)
  started = time.monotonic()  # before the stand-in thread starts its 1 s (measured after it, 0.999 s once)
  dog = _waiting_dog(monkeypatch, store, verdict_s=1.0)
  dog.wait_for_verdict(RuntimeError("gloo: connection reset"))  # peer 1's heartbeat never moves
  assert time.monotonic() - started >= 1.0  # until the watchdog has named it (here: its stand-in ended)

  dog = _waiting_dog(monkeypatch, store, verdict_s=30.0)
  for seq in (8, 9):  # peer 1 is alive: two heartbeats after the error
    threading.Timer(0.1 * (seq - 7), _beat, (store, seq)).start()
  started = time.monotonic()
  dog.wait_for_verdict(RuntimeError("cannot write checkpoint step 10"))
  assert 0.2 <= time.monotonic() - started < 5  # the error stands, without the 58 s wait

  threading.Timer(0.1, _beat, (store, 10, True)).start()  # or it says it is done
  started = time.monotonic()
  dog.wait_for_verdict(RuntimeError("x"))
  assert time.monotonic() - started < 5
