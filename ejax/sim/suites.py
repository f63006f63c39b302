"""The registered task suites, in the spirit of LIBERO: spatial relations, object identity, goals.

Spatial: three identical blocks; the instruction singles one out by where it is.
Object: distinctly coloured objects; the instruction names one by colour and kind.
Goal: one scene, different goals (drawer, stacking, lifting, placing).
"""

from __future__ import annotations

from ejax.sim.tasks import TaskSpec

_SPATIAL = (
    TaskSpec("spatial_left_block_to_bowl", "spatial", "put the block on the left in the bowl",
             target="left", destination="bowl", same_colour_blocks=True),
    TaskSpec("spatial_right_block_to_plate", "spatial", "put the block on the right on the plate",
             target="right", destination="plate", same_colour_blocks=True),
    TaskSpec("spatial_front_block_to_bowl", "spatial", "put the block closest to the robot in the bowl",
             target="front", destination="bowl", same_colour_blocks=True),
    TaskSpec("spatial_back_block_to_plate", "spatial", "put the block farthest from the robot on the plate",
             target="back", destination="plate", same_colour_blocks=True),
    TaskSpec("spatial_stack_left_on_right", "spatial", "stack the block on the left on the block on the right",
             target="left", destination="right", same_colour_blocks=True),
)

_OBJECT = (
    TaskSpec("object_red_block_to_bowl", "object", "put the red block in the bowl",
             target="red", destination="bowl"),
    TaskSpec("object_green_block_to_plate", "object", "put the green block on the plate",
             target="green", destination="plate"),
    TaskSpec("object_blue_block_to_bowl", "object", "put the blue block in the bowl",
             target="blue", destination="bowl"),
    TaskSpec("object_cylinder_to_plate", "object", "put the yellow cylinder on the plate",
             target="cylinder", destination="plate"),
    TaskSpec("object_lift_cylinder", "object", "pick up the yellow cylinder",
             target="cylinder", destination="air", episode_length=40),
)

_GOAL = (
    TaskSpec("goal_open_drawer", "goal", "open the drawer", target="handle", destination="open",
             drawer_start=(0.0, 0.03), episode_length=50),
    TaskSpec("goal_close_drawer", "goal", "close the drawer", target="handle", destination="closed",
             drawer_start=(0.1, 0.15), episode_length=50),
    TaskSpec("goal_stack_red_on_blue", "goal", "put the red block on top of the blue block",
             target="red", destination="blue"),
    TaskSpec("goal_lift_green_block", "goal", "lift the green block", target="green", destination="air",
             episode_length=40),
    TaskSpec("goal_red_block_to_plate", "goal", "put the red block on the plate", target="red",
             destination="plate"),
)

SUITES: dict[str, tuple[TaskSpec, ...]] = {"spatial": _SPATIAL, "object": _OBJECT, "goal": _GOAL}
TASKS: dict[str, TaskSpec] = {spec.name: spec for suite in SUITES.values() for spec in suite}
