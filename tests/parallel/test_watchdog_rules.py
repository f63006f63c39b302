"""The watchdog's automatic phase timeout and its last line (single process: no thread, no service)."""

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
