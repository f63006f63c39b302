"""Shared pieces of the opt-in parity tests (`pytest -m parity`) against transformers' PyTorch modules."""

import numpy as np
import pytest


def require_parity(request):
  """Skips unless the run asked for parity tests and torch + transformers import; -> torch."""
  if "parity" not in (request.config.option.markexpr or ""):
    pytest.skip("parity tests are opt-in: pytest -m parity")
  torch = pytest.importorskip("torch")
  pytest.importorskip("transformers")
  return torch


def strip_prefix(tensors: dict, prefix: str) -> dict:
  """The tensors under `prefix`, keyed without it (a transformers module's own state-dict keys)."""
  return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def assert_matches(name: str, ours, expected, **tolerance) -> None:
  """Prints the max abs error against the output scale, then asserts closeness."""
  error = np.abs(ours - expected).max()
  print(f"{name} max abs error {error:.2e} (output scale {np.abs(expected).max():.2f})")
  np.testing.assert_allclose(ours, expected, **tolerance)
