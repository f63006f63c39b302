"""Bar plot of per-task success rates with 95 % confidence intervals (matplotlib, headless)."""

from __future__ import annotations

from matplotlib.figure import Figure


def success_bar_plot(path: str, rows: list[dict], title: str) -> None:
  """rows: {"task", "success_rate", "ci_low", "ci_high"} per task; writes a PNG."""
  names = [row["task"] for row in rows]
  rates = [row["success_rate"] for row in rows]
  lower = [row["success_rate"] - row["ci_low"] for row in rows]
  upper = [row["ci_high"] - row["success_rate"] for row in rows]
  # A bare Figure renders headless (Agg) without switching the process-wide pyplot backend, so
  # notebooks that import ejax keep drawing inline.
  figure = Figure(figsize=(max(6.0, 0.5 * len(rows) + 2), 4.5))
  axis = figure.subplots()
  axis.bar(range(len(rows)), rates, yerr=[lower, upper], capsize=3, color="#4c72b0")
  axis.set_xticks(range(len(rows)), names, rotation=60, ha="right", fontsize=8)
  axis.set_ylim(0, 1.05)
  axis.set_ylabel("success rate (95 % Wilson CI)")
  axis.set_title(title)
  figure.tight_layout()
  figure.savefig(path, dpi=120)
