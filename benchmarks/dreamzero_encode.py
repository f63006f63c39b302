"""DreamZero's frozen encoders in the train step or cached ahead (issue 32 point 3): which trains faster end
to end, measured side by side at runlocal size on this machine, and bounded at 5B size from FLOP counts.

Arms, one after the other in one process on the same data (configs/dreamzero.py:runlocal, ejax.sim's
recorded quickstart demos unless --arg says otherwise):
  in-step   the trainer as configured: every batch's camera-grid video decoded, then the frozen VAE,
            umT5 and CLIP run inside the jitted step;
  encode    the encode job (ejax/train/encode.py) over every sample of the dataset once;
  cached    the trainer reading that cache (data.encoder_cache): no video decoded, no encoder run.
Each train arm runs --steps steps (--repeats times, alternating); its rate is the median samples/s of the
logged intervals after the first (the compile excluded, as it is in both), then the median over repeats. End to end for the recipe (train.steps x
global_batch_size samples): in-step = samples / its rate; cached = the encode job's seconds + samples /
its rate; the figure is their ratio.

5B bound (no 5B run here): per training sample the DiT costs 3 x its forward (benchmarks/
dreamzero_scaling.py's analytic count, issue 32's 29.8 TFLOP) and, in the step, the frozen umT5 + CLIP
forward (same count) and the VAE's encode of 33 frames at 160 x 320 (XLA's cost analysis of the
lowered encode); the cache pays the encoders once per sample per dataset pass instead of once per
sample per epoch, so compute-bound the speed-up is (DiT + encoders) / (DiT + encoders / epochs).

  python benchmarks/dreamzero_encode.py                 # ~10 min on 2 loaded cores
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

GOAL = 1.0   # the cache is the default only where it is faster end to end


def load() -> str:
  return " ".join(f"{x:.1f}" for x in os.getloadavg())


class CpuClock:
  """This process's CPU seconds (every thread: XLA's, the input pipeline's) each time the trainer logs:
  a thread watches the metrics file. CPU seconds a sample vary less with other jobs' load than wall time."""

  def __init__(self, path: str):
    self.path, self.marks, self.stop = path, [], threading.Event()
    self.thread = threading.Thread(target=self.watch, daemon=True)
    self.thread.start()

  def watch(self):
    lines = 0
    while not self.stop.wait(0.05):
      count = sum(1 for _ in open(self.path)) if os.path.exists(self.path) else 0
      if count > lines:
        self.marks.append(sum(os.times()[:2]))
        lines = count

  def close(self) -> list[float]:
    self.stop.set()
    self.thread.join()
    return self.marks


def train_rate(config, workdir: str) -> tuple[float, float, list[float], float]:
  """(median samples/s of the logged intervals after the first, wall seconds of the whole run, the
  logged losses, median CPU seconds a sample over the same intervals)."""
  from ejax.train.loop import train
  shutil.rmtree(workdir, ignore_errors=True)
  started = time.perf_counter()
  clock = CpuClock(os.path.join(workdir, "metrics.jsonl"))
  history = train(config, workdir)["history"]
  marks = clock.close()
  rates = [h["samples_per_second"] for h in history[1:]]
  samples = config.train.global_batch_size * config.metrics.log_every_steps
  cpu = [(b - a) / samples for a, b in zip(marks, marks[1:])]
  return (statistics.median(rates), time.perf_counter() - started, [h["loss"] for h in history],
          statistics.median(cpu) if cpu else float("nan"))


def measure(arg: str, steps: int, out: str, repeats: int) -> dict:
  from ejax.train import encode as encode_job
  from ejax.train.compile_report import load_config_file

  config = load_config_file(os.path.join(REPO, "configs/dreamzero.py"), arg)
  recipe_samples = config.train.steps * config.train.global_batch_size
  config.train.steps = steps
  config.metrics.update(tensorboard=False, progress_bar=False, log_every_steps=max(1, steps // 6))
  config.checkpoint.update(every_steps=10 ** 9, async_save=False)
  config.data.update(encoder_cache=None, encoder_cache_refresh=False)   # in-step: no cache
  cache = os.path.join(out, "encoder_cache")
  result = {"recipe_samples": recipe_samples, "load": {"start": load()}, "in_step": [], "cached": []}
  encoding = config.copy_and_resolve_references()
  encoding.data.encoder_cache = cache
  # in-step, encode, cached, then (in-step, cached) again: both arms see the same spells of load
  for repeat in range(repeats):
    result["in_step"].append(train_rate(config, os.path.join(out, "in_step")))
    result["load"][f"after in-step {repeat + 1}"] = load()
    if repeat == 0:
      written = encode_job.encode(encoding)
      result["encode_seconds"], result["dataset_samples"] = written["seconds"], written["num_samples"]
      result["prompts"] = written["num_prompts"]
      result["load"]["after encode"] = load()
    result["cached"].append(train_rate(encoding, os.path.join(out, "cached")))
    result["load"][f"after cached {repeat + 1}"] = load()
  return result


def five_b_bound() -> dict:
  """Per-sample TFLOP at the 5B size: the DiT trained, the step's frozen encoders."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from benchmarks.dreamzero_scaling import sample_flops
  from ejax.models.dreamzero import model as dz
  from ejax.models.dreamzero.vae import WanVAE

  config = dz.model_config("5b")
  f = sample_flops(config)
  vae = nnx.eval_shape(lambda: WanVAE(dz.vae_config(config), dtype=jnp.bfloat16, param_dtype=jnp.float32,
                                      rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(vae)
  frames = 1 + 4 * config.layout.num_chunks * config.layout.frames_per_chunk
  video = jax.ShapeDtypeStruct((1, frames, *config.image_size, 3), jnp.float32)
  vae_flops = jax.jit(lambda s, v: nnx.merge(graphdef, s).encode(v)).lower(state, video).cost_analysis()["flops"]
  dit = 3 * (f["dit_forward"] + f["dit_attention"])
  return dict(dit=dit / 1e12, text_image=(f["encoders"] + f["encoder_attention"]) / 1e12, vae=vae_flops / 1e12,
              recompute=(f["dit_forward"] + f["dit_attention"]) / 1e12 if config.remat == "full" else 0.0,
              frames=frames)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--arg", default="runlocal", help="configs/dreamzero.py's arg string")
  parser.add_argument("--steps", type=int, default=60, help="train steps an arm")
  parser.add_argument("--repeats", type=int, default=2, help="runs of each train arm, alternating")
  parser.add_argument("--out", default="/tmp/dreamzero_encode_bench")
  args = parser.parse_args(argv)
  from ejax.config import quiet
  quiet.quiet_xla_cpu_logs()   # before jax starts: the compilation cache's loader warnings
  bound = five_b_bound()
  r = measure(args.arg, args.steps, args.out, args.repeats)
  print(f"== configs/dreamzero.py:{args.arg}, {args.steps} steps an arm, load (1/5/15 min) "
        + "; ".join(f"{k}: {v}" for k, v in r["load"].items()))
  for name in ("in_step", "cached"):
    print(f"{name}: " + ", ".join(f"{rate:.1f} samples/s ({wall:.0f} s with the compile, {1e3 * cpu:.0f} CPU ms a sample)"
                                  for rate, wall, _, cpu in r[name]))
  print(f"encode job: {r['dataset_samples']} samples ({r['prompts']} prompts) in {r['encode_seconds']:.1f} s "
        f"({r['dataset_samples'] / r['encode_seconds']:.0f} samples/s, start-up and compile included)")
  # The trainer's shuffle and the cache's are the same permutation of (seed, epoch): the same samples in
  # the same order with the same noise, so the logged losses agree where the cached outputs are exact.
  gap = max(abs(a - b) for a, b in zip(r["in_step"][0][2], r["cached"][0][2]))
  print(f"logged losses, in-step {[round(x, 4) for x in r['in_step'][0][2]]} vs cached: largest difference {gap:.2g}")
  in_rate = statistics.median(rate for rate, _, _, _ in r["in_step"])
  cached_rate = statistics.median(rate for rate, _, _, _ in r["cached"])
  in_cpu = statistics.median(cpu for _, _, _, cpu in r["in_step"])
  cached_cpu = statistics.median(cpu for _, _, _, cpu in r["cached"])
  print(f"median: in-step {in_rate:.1f}, cached {cached_rate:.1f} samples/s: {cached_rate / in_rate:.2f}x the in-step rate; "
        f"CPU a sample {1e3 * in_cpu:.0f} vs {1e3 * cached_cpu:.0f} ms: {in_cpu / cached_cpu:.2f}x less")
  samples = r["recipe_samples"]
  epochs = samples / r["dataset_samples"]
  in_step = samples / in_rate
  cached = r["encode_seconds"] + samples / cached_rate
  print(f"the recipe's {samples} samples ({epochs:.1f} epochs): in-step {in_step / 60:.1f} min, cached "
        f"{cached / 60:.1f} min (encode {r['encode_seconds'] / 60:.1f} + train {samples / cached_rate / 60:.1f})")
  b = bound
  encoders = b["text_image"] + b["vae"]
  print(f"5B per sample, TFLOP: DiT trained {b['dit']:.1f} (+{b['recompute']:.1f} recomputed), frozen umT5 + CLIP "
        f"{b['text_image']:.2f}, VAE encode of {b['frames']} frames {b['vae']:.2f} (the official code encodes twice: "
        f"{2 * b['vae']:.2f})")
  for label, dit in (("model FLOPs", b["dit"]), ("hardware FLOPs (remat full)", b["dit"] + b["recompute"])):
    bounds = ", ".join(f"{e} epoch{'s' if e != 1 else ''} {(dit + encoders) / (dit + encoders / e):.2f}x"
                       for e in (1, 2, 4))
    print(f"5B compute-bound speed-up of the cache, {label}: {bounds}, many epochs {(dit + encoders) / dit:.2f}x")
  print(f"runlocal end-to-end speed-up of the encoder cache over encoding in the step ({samples} samples, "
        f"the encode job included): {in_step / cached:.2f}x (goal > {GOAL:.2f}x)")


if __name__ == "__main__":
  main()
