"""Downloads into .whl/ the wheels the GPU machines' image lacks, for benchmarks/gpu.py to install there.

The image (Python 3.12, x86-64, jax 0.11.x with CUDA, flax, optax, orbax, numpy, safetensors,
tokenizers, sentencepiece) has no network; ejax also needs the packages below, at the versions
constraints.txt pins (tokenizers too, which GR00T's configs import: an image without it would lose
every figure that builds GR00T). The image's flax is used (the pinned 0.12.6 cannot import on jax 0.11); tokamax
and what it imports (benchmarks/tokamax_requirements.txt) go into .whl/tokamax and a fallback flax
0.12.12 into .whl/tokamax/flax (benchmarks/gpu.py and attention_hopper.sh install them). Run where pip
reaches PyPI, in the repository root; .whl/ is git-ignored and travels with the device call (~32 MB).

  python benchmarks/download_wheels.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# ejax's imports the image lacks, and theirs (mujoco 4 is split into mujoco + mujoco-core).
PACKAGES = ("ml_collections", "mujoco", "mujoco-core", "mujoco-mjx", "glfw", "pyopengl", "trimesh", "grain",
            "array_record", "dm-tree", "portpicker", "tensorboardX", "websockets", "openpi-client", "tokenizers")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "any")
# Pins for what constraints.txt does not list (mujoco's split packages come with mujoco 4.0.0).
EXTRA_PINS = {"mujoco-core": "4.0.0", "pyopengl": "3.1.10", "portpicker": "1.6.0"}


def pins() -> dict[str, str]:
  out = dict(EXTRA_PINS)
  with open(os.path.join(REPO, "constraints.txt")) as f:
    for line in f:
      match = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", line.strip())
      if match:
        out[match.group(1).lower().replace("_", "-")] = match.group(2)
  return out


FALLBACK_FLAX = "flax==0.12.12"  # imports on jax 0.11, for an image whose own flax does not


def tokamax_requirements() -> list[str]:
  with open(os.path.join(REPO, "benchmarks", "tokamax_requirements.txt")) as f:
    return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def download(requirement: str, destination: str) -> None:
  """The one wheel of `requirement` for the GPU image's Python 3.12 on x86-64 Linux, no dependencies."""
  command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "--python-version", "3.12", "--implementation", "cp", "-d", destination, requirement]
  for platform in PLATFORMS:
    command += ["--platform", platform]
  subprocess.run(command, check=True)


def main() -> None:
  versions = pins()
  destination = os.path.join(REPO, ".whl")
  folders = {destination: [], os.path.join(destination, "tokamax"): tokamax_requirements(),
             os.path.join(destination, "tokamax", "flax"): [FALLBACK_FLAX]}
  for package in PACKAGES:
    version = versions.get(package.lower().replace("_", "-"))
    folders[destination].append(f"{package}=={version}" if version else package)
  for folder, requirements in folders.items():
    os.makedirs(folder, exist_ok=True)
    for requirement in requirements:
      download(requirement, folder)
  wheels = [os.path.join(root, name) for root, _, names in os.walk(destination) for name in names if name.endswith(".whl")]
  print(f"{len(wheels)} wheels in {destination}, {sum(map(os.path.getsize, wheels)) / 2**20:.0f} MiB")


if __name__ == "__main__":
  main()
