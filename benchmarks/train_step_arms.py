"""benchmarks/train_step.py's arms: each arm's config and batch from the configured model (the layouts
of ejax.train.layout_arms, FP8 routes, attention implementations, the other block layout, CUDA graphs,
the attention layout checked).
The arms themselves are listed in train_step.py's docstring."""

from __future__ import annotations

import jax

UNPACKED = ("dreamzero",)   # models whose batch has no packed rows (no layout arms)
ALL_ARMS = ("configured", "graphs", "no_graphs", "layout_checked", "padded", "seed_padded", "best_fit", "fp8", "attn", "unscanned",
            "scanned")


def arm_configs(config, arms: list[str], samples: int) -> dict:
  """name -> (the config of that arm, its batch: numpy arrays of `samples` samples)."""
  if config.model.name in UNPACKED:
    return unpacked_arm_configs(config, arms, samples)
  from ejax.train.layout_arms import train_step_arms
  layouts = train_step_arms(config.model, samples, flops=False)
  out = {}

  def with_layout(layout: str):
    arm_config = config.copy_and_resolve_references()
    arm = layouts[layout]
    arm_config.model.packing.update(row_length=arm.row_length, samples_per_row=arm.samples_per_row)
    return arm_config, arm.batch

  for arm in arms:
    if arm in ("configured", "padded", "seed_padded", "best_fit"):
      if arm == "best_fit" and _same_layout(layouts["best_fit"], layouts["configured"]):
        print(f"  best_fit: the configured row ({layouts['configured'].row_length} x "
              f"{layouts['configured'].samples_per_row}) is already the best fit for these samples")
        continue
      out[arm] = with_layout(arm)
    elif arm in ("unscanned", "scanned") and other_layout(config.model)[0] == arm:
      out[arm] = with_layout("configured")
      out[arm][0].model = other_layout(config.model)[1]
    elif arm in ("graphs", "no_graphs"):
      out[arm] = with_layout("configured")
      _set_graphs(out[arm][0], arm)
    elif arm == "layout_checked":
      out[arm] = with_layout("configured")
      out[arm][0].train.check_attention_layout = True
    elif arm.split("_")[0] == "fp8" and "fp8" in config.model:
      from ejax.kernels.fp8 import DENSE_IMPLS as FP8_IMPLS
      for impl in FP8_IMPLS + ("frozen", "all") if arm == "fp8" else [arm[len("fp8_"):]]:
        out[f"fp8_{impl}"] = with_layout("configured")
        # frozen: the frozen towers' projections from FP8 copies (train.frozen_fp8); all: that and
        # model.fp8 with delayed scaling (the trained feed-forwards)
        out[f"fp8_{impl}"][0].train.frozen_fp8 = impl in ("frozen", "all")
        if impl != "frozen":
          out[f"fp8_{impl}"][0].model.update(fp8=True, fp8_impl="xla_delayed" if impl == "all" else impl)
    elif arm.split("_")[0] == "attn" and "attention_impl" in config.model:
      for impl in attention_impls(config.model) if arm == "attn" else [arm[len("attn_"):]]:
        out[f"attn_{impl}"] = with_layout("configured")
        out[f"attn_{impl}"][0].model.attention_impl = impl
  return out


def other_layout(model_config) -> tuple[str, object]:
  """("unscanned", the model config with every block unrolled) where it scans repeated blocks, else
  ("scanned", it with them scanned and rematerialised); ("", None) for a model without the switch."""
  if "scan_layers" not in model_config:
    return "", None
  other = model_config.copy_and_resolve_references()
  if model_config.scan_layers:
    other.scan_layers = False
    return "unscanned", other
  other.update(scan_layers=True, remat="full")
  return "scanned", other


def unpacked_arm_configs(config, arms: list[str], samples: int) -> dict:
  """DreamZero's arms: its example batch (VAE latents computed ahead, as the compile from shapes has it)
  as configured, with every block unrolled, and through each attention implementation."""
  from ejax.models.registry import get_model_spec
  example = get_model_spec(config.model.name).example_batch(config.model, samples, 0)
  out = {}
  for arm in arms:
    if arm == "configured":
      out[arm] = (config.copy_and_resolve_references(), example)
    elif arm in ("unscanned", "scanned") and other_layout(config.model)[0] == arm:
      out[arm] = (config.copy_and_resolve_references(), example)
      out[arm][0].model = other_layout(config.model)[1]
    elif arm in ("graphs", "no_graphs"):
      out[arm] = (config.copy_and_resolve_references(), example)
      _set_graphs(out[arm][0], arm)
    elif arm.split("_")[0] == "attn":
      for impl in attention_impls(config.model) if arm == "attn" else [arm[len("attn_"):]]:
        out[f"attn_{impl}"] = (config.copy_and_resolve_references(), example)
        out[f"attn_{impl}"][0].model.attention_impl = impl
  return out


def _set_graphs(config, arm: str) -> None:
  """graphs: loops in CUDA graphs too (train.command_buffers); no_graphs: no CUDA graphs (train.cuda_graphs)."""
  if arm == "graphs":
    config.train.command_buffers = True
  else:
    config.train.cuda_graphs = False


def _same_layout(a, b) -> bool:
  return (a.row_length, a.samples_per_row, a.num_rows) == (b.row_length, b.samples_per_row, b.num_rows)


def attention_impls(model_config) -> list[str]:
  if "attention_impl" not in model_config or jax.default_backend() == "cpu":
    return []
  from ejax.kernels.attention.ops import IMPLS
  return [impl for impl in IMPLS if impl not in ("auto", "reference")]
