"""DreamZero training on H100s: samples/s a GPU predicted from the train step compiled on a CPU, beside RLinf's.

RLinf reports (issue 32) 1.10 -> 4.44 samples/s a GPU for the 5B on 8 H100s and 0.055 -> 0.150 for
the 14B; issue 32 sets >= 8 for ejax's 5B. This script does not measure a GPU. It reads
`python -m ejax.train.compile_report --config=configs/dreamzero.py:<variant> --mesh=data=128,fsdp=8` (the
trainer's own step, 32 samples a device, compiled for 1,024 fake CPU devices; benchmarks/scaling.py's
compile and cache, keyed by the source) and counts FLOPs analytically:

  model FLOPs / sample  = 3 x the DiT's forward (forward + backward) + the frozen umT5 and CLIP
                          forwards (the batch carries VAE latents: no VAE in the step), the
                          numerator of MFU as RLinf's ~13 % is stated (issue 32: 29.8 TFLOP a 5B sample);
  hardware FLOPs        = the model's + one more DiT forward (model.remat="full" recomputes it);
  the compiled HLO's matmul FLOPs must agree with the analytic matmuls within 10 % (attention is
  counted analytically only: XLA:CPU's attention tile loops hide it from the HLO count).

Predictions, each labelled by its assumption:
  ceiling     step = max(hardware FLOPs / 798 TFLOP/s (the H100 large-matmul rate of REFERENCE.md),
                         NVLink bytes / 450 GB/s, InfiniBand bytes / 50 GB/s) on 8 and 1,024 GPUs
                         (benchmarks/scaling.py's model: collectives overlapped, weights gathered in
                         bf16, gradients reduce-scattered; input loading not modelled);
  at an MFU   samples/s = MFU x 989 TFLOP/s / model FLOPs, for assumed MFUs: what a GPU run has to
              reach; the only measured ejax figure is GR00T's 7.3 % on an H200 (BENCHMARKS.md).

The 5B only: the 14B at the config's 32 samples a GPU (15,940 tokens a sample) needs 776 GiB a device
by the same compile (BENCHMARKS.md), so a step at that batch is no H100's.

  python benchmarks/dreamzero_scaling.py                # ~5 min the first time (the compile), then cached
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import scaling  # noqa: E402  (the compile cache, the H100 figures, collective_seconds)

RLINF = {"5b": (1.10, 4.44), "14b": (0.055, 0.150)}   # samples/s a GPU on 8 H100s: official code, RLinf
GOAL = {"5b": 8.0}                                     # issue 32's goal for ejax
ASSUMED_MFU = (0.13, 0.25, 0.40)


def analytic_flops(model_config) -> dict[str, float]:
  """Matmul and attention FLOPs of one training sample (2 per multiply-add), forward passes."""
  from ejax.models.dreamzero import model as dz
  from ejax.models.dreamzero.image_encoder import ClipVisionConfig
  from ejax.models.dreamzero.sequence import direct_wam_mask
  from ejax.models.dreamzero.text_encoder import UMT5Config

  dit, lay = dz.dit_config(model_config), dz.layout(model_config)
  text, clip = UMT5Config(**model_config.text), ClipVisionConfig(**model_config.image)
  d, tokens, words, pixels = dit.dim, lay.length, model_config.text_length, clip.num_tokens
  context = words + pixels
  pairs = float(direct_wam_mask(lay).sum())   # the query-key pairs the WAM mask allows
  # a block: self q, k, v, o and cross q, o on every token; cross k, v (text) and k_img, v_img
  # (image) on the context; the FFN; then attention: QK and PV over the allowed pairs and the context
  block = 2 * tokens * (6 * d * d + 2 * d * dit.ffn_dim) + 2 * context * 2 * d * d
  block_attention = 4 * d * (pairs + tokens * context)
  embed = 2 * (tokens * dit.patch_features * d + words * (dit.text_dim * d + d * d)
               + pixels * (dit.image_dim ** 2 + dit.image_dim * d) + tokens * dit.out_dim * 4 * d)
  t5 = 2 * words * text.num_layers * (4 * text.dim ** 2 + 3 * text.dim * text.ffn_dim)
  t5_attention = 4 * words * words * text.dim * text.num_layers
  vit = 2 * pixels * clip.use_layers * (4 * clip.dim ** 2 + 2 * clip.dim * clip.mlp_dim)
  vit_attention = 4 * pixels * pixels * clip.dim * clip.use_layers
  dit_forward = dit.num_layers * block + embed
  return dict(dit_forward=dit_forward, dit_attention=dit.num_layers * block_attention,
              encoders=t5 + vit, encoder_attention=t5_attention + vit_attention, tokens=tokens, pairs=pairs)


def sample_flops(model_config) -> dict[str, float]:
  """A training sample's model FLOPs (DiT 3 x forward + frozen encoders: MFU's numerator), hardware
  FLOPs (+ the forward that remat "full" recomputes) and their matmul part (what the HLO count sees)."""
  f = analytic_flops(model_config)
  recompute = 1 if model_config.remat == "full" else 0
  dit = f["dit_forward"] + f["dit_attention"]
  model = 3 * dit + f["encoders"] + f["encoder_attention"]
  return dict(f, model=model, hardware=model + recompute * dit,
              matmuls=(3 + recompute) * f["dit_forward"] + f["encoders"])


def report(variant: str, recompile: bool) -> None:
  from ejax.train.compile_report import load_config_file

  config = load_config_file(os.path.join(REPO, "configs/dreamzero.py"), variant)
  result = scaling.compiled(f"configs/dreamzero.py:{variant}", recompile)
  per_device = result["per_device_batch"]
  f = sample_flops(config.model)
  model, hardware, matmuls = f["model"], f["hardware"], f["matmuls"]
  compiled = result["matmul_flops_per_device"] / per_device
  ratio = compiled / matmuls
  print(f"== DreamZero {variant} (configs/dreamzero.py:{variant}, remat {config.model.remat}): compiled for "
        f"{result['devices']} devices (data=128 x fsdp=8), {per_device} samples a GPU, {f['tokens']} DiT tokens a sample "
        f"({f['pairs'] / f['tokens'] ** 2:.0%} of the pairs allowed by the WAM mask)")
  print(f"FLOPs per sample: DiT forward {(f['dit_forward'] + f['dit_attention']) / 1e12:.2f} T (attention "
        f"{f['dit_attention'] / 1e12:.2f}), frozen umT5 + CLIP forward {(f['encoders'] + f['encoder_attention']) / 1e12:.2f} T "
        f"({config.model.text_length} text tokens, all encoded); model {model / 1e12:.2f} T, hardware {hardware / 1e12:.2f} T")
  print(f"matmul FLOPs per sample: compiled HLO {compiled / 1e12:.2f} T vs analytic {matmuls / 1e12:.2f} T "
        f"(ratio {ratio:.3f})")
  if abs(ratio - 1) > 0.10:
    raise SystemExit(f"dreamzero {variant}: compiled and analytic FLOPs differ by {abs(ratio - 1):.0%} (more than 10 %)")
  compute = hardware * per_device / scaling.MATMUL_RATE
  print(f"per GPU: peak {result['memory']['total'] / 2**30:.1f} GiB (XLA:CPU's estimate); a step of {per_device} "
        f"samples: compute {compute:.2f} s at {scaling.MATMUL_RATE / 1e12:.0f} TFLOP/s")
  for gpus in (8, 1024):
    nvlink, infiniband, _ = scaling.collective_seconds(result["collective_ops"], gpus)
    ceiling = per_device / max(compute, nvlink, infiniband)
    print(f"ceiling on {gpus} GPUs (every FLOP at the matmul rate, collectives overlapped; NVLink {nvlink:.2f} s, "
          f"InfiniBand {infiniband:.2f} s a step): {ceiling:.1f} samples/s a GPU, MFU {model * ceiling / scaling.PEAK:.0%}")
  official, rlinf = RLINF[variant]
  rlinf_mfu = rlinf * model / scaling.PEAK
  print(f"RLinf: {rlinf} samples/s a GPU (official code {official}) = MFU {rlinf_mfu:.1%} on this model-FLOP count")
  rates = ", ".join(f"{mfu:.0%}: {mfu * scaling.PEAK / model:.1f}" for mfu in ASSUMED_MFU)
  print(f"assumed MFU -> samples/s a GPU (989 TFLOP/s peak): {rates}")
  if variant in GOAL:
    print(f"goal {GOAL[variant]:.0f} samples/s a GPU needs MFU {GOAL[variant] * model / scaling.PEAK:.1%} at "
          f"these FLOPs (RLinf's {rlinf_mfu:.1%} gives {rlinf_mfu * scaling.PEAK / model:.2f})")
  words = config.model.text_length
  real = 32   # an assumed instruction length in umT5 tokens: the encoder on real tokens only
  t5_share = f["encoders"] * (1 - real / words) / model
  print(f"if umT5 ran on {real} real tokens instead of {words}: {t5_share:.1%} fewer model FLOPs")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--recompile", action="store_true", help="ignore the cached compile results")
  args = parser.parse_args(argv)
  print(f"assumed: H100 {scaling.PEAK / 1e12:.0f} TFLOP/s peak, matmuls at {scaling.MATMUL_RATE / 1e12:.0f}, NVLink "
        f"{scaling.NVLINK / 1e9:.0f} GB/s and InfiniBand {scaling.INFINIBAND / 1e9:.0f} GB/s sent a GPU; input loading not "
        "modelled")
  report("5b", args.recompile)


if __name__ == "__main__":
  main()
