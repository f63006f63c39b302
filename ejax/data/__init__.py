"""Datasets and the input pipeline.

lerobot.py (v2.1 / v3.0 step-level source; writers in lerobot_writer.py), rlds.py (TFDS RLDS),
video.py (mp4 encode / cached decode), transforms.py, stats.py (norm stats + job `stats`),
packing.py (segment ids, positions), pipeline.py (grain: `build_pipeline`), synthetic.py.
"""
