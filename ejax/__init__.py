"""ejax: train robot Vision-Language-Action policies in JAX, from one CPU to a thousand GPUs."""

__version__ = "0.1.0"
