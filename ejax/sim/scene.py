"""The one tabletop scene every task shares, generated as MJCF by ejax (no downloaded assets).

Contents: a table (plane), a Franka-like 7-DoF arm built from the DH table in `kinematics.py` with a
parallel gripper (two actuated slide fingers), three blocks and a cylinder (free bodies), a bowl and a
plate (mocap bodies, moved per episode), and a cabinet with a sliding drawer. Two cameras: a fixed
"agentview" facing the robot and a "wrist" camera on the hand looking down the gripper.

One shared model is the point: every task is data (see tasks.py), so a batch mixing all tasks runs
through one compiled MJX step. Per-episode object sizes and colours live in each env's state and are
swapped into the model inside `step` (geom_size / geom_rgba), the usual MJX domain-randomisation trick.

Physics simplifications, stated so nobody mistakes them for more: the arm and fingers are kinematic and
do not collide (contype 0); a grasp attaches the object to the hand (control.py) instead of holding it by friction;
bowl, plate, cabinet and drawer are visual only, so objects placed "in the bowl" rest on the table
inside its rim. Objects collide with the table and with each other (boxes with boxes, the cylinder
only with the table: MJX has no box-cylinder collision).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import mujoco
import numpy as np

from ejax.sim import kinematics

TIMESTEP = 0.01          # physics step [s]
CONTROL_HZ = 10          # policy steps per second
SUBSTEPS = round(1.0 / (CONTROL_HZ * TIMESTEP))
FINGER_OPEN = 0.04       # one finger's travel [m] when fully open

# Free objects, in slot order. Sizes here are the largest the randomisation draws (collision bounds
# are computed from them, so smaller per-episode sizes stay inside).
OBJECT_NAMES = ("block_a", "block_b", "block_c", "cylinder")
NUM_OBJECTS = len(OBJECT_NAMES)
BLOCK_HALF_RANGE = (0.018, 0.026)          # cube half-size [m]
CYLINDER_RADIUS_RANGE = (0.018, 0.024)
CYLINDER_HALF_HEIGHT_RANGE = (0.024, 0.034)
BOWL_RADIUS = 0.065
PLATE_RADIUS = 0.07

# Cabinet on the robot's left; the drawer slides out along -y (towards the workspace).
CABINET_POS = np.array([0.50, 0.52, 0.0], np.float32)
CABINET_HALF = np.array([0.12, 0.11, 0.08], np.float32)
DRAWER_TRAVEL = 0.15
DRAWER_AXIS = np.array([0.0, -1.0, 0.0], np.float32)
HANDLE_HEIGHT = 0.07
# Handle centre in the world when the drawer is closed.
HANDLE_CLOSED_POS = np.array([CABINET_POS[0], CABINET_POS[1] - CABINET_HALF[1] - 0.035, HANDLE_HEIGHT], np.float32)

AGENTVIEW_POS = np.array([1.25, 0.0, 0.75], np.float32)
AGENTVIEW_TARGET = np.array([0.45, 0.05, 0.05], np.float32)
CAMERA_FOVY = 45.0


def _vec(values) -> str:
  return " ".join(f"{float(v):.6g}" for v in values)


def _quat_from_matrix(rot: np.ndarray) -> np.ndarray:
  quat = np.zeros(4)
  mujoco.mju_mat2Quat(quat, np.asarray(rot, np.float64).reshape(-1))
  return quat


def _look_at_xyaxes(position: np.ndarray, target: np.ndarray) -> np.ndarray:
  """MuJoCo camera axes (x right, y up; the camera looks along -z) for a camera at `position` facing `target`."""
  forward = (target - position) / np.linalg.norm(target - position)
  right = np.cross(forward, np.array([0.0, 0.0, 1.0]))
  right /= np.linalg.norm(right)
  up = np.cross(right, forward)
  return np.concatenate([right, up])


def _arm_xml() -> str:
  """Links 1..7, the hand and two fingers as mocap bodies, posed every step from kinematics.link_frames.

  The arm is kinematic (like Meta-World's mocap-driven hand): its joint state lives in the env state
  and follows the IK target through a rate-limited servo (control.py). It never collides, so nothing
  in the physics depends on its dynamics; keeping it out of the MJX tree keeps the tree one level deep,
  which cuts MJX compile time several-fold.
  """
  offsets = kinematics.link_offsets()
  bodies = []
  for i in range(len(offsets)):
    next_position = offsets[i + 1][0] if i + 1 < len(offsets) else np.array([0.0, 0.0, kinematics.FLANGE_D])
    radius = 0.06 if i < 4 else 0.05
    if np.linalg.norm(next_position) > 1e-6:
      link_geom = f'<geom class="arm" type="capsule" size="{radius}" fromto="0 0 0 {_vec(next_position)}"/>'
    else:
      link_geom = f'<geom class="arm" type="sphere" size="{radius}"/>'
    bodies.append(f'<body name="link{i + 1}" mocap="true">{link_geom}</body>')
  tcp = kinematics.TCP_OFFSET
  bodies.append(f"""
    <body name="hand" mocap="true">
      <geom class="arm" type="cylinder" size="0.035 0.01" pos="0 0 0.01" rgba="0.2 0.2 0.22 1"/>
      <geom class="arm" type="box" size="0.025 0.1 0.025" pos="0 0 0.045" rgba="0.92 0.92 0.92 1"/>
      <site name="tcp" pos="0 0 {tcp}" size="0.005"/>
      <!-- Looks down the gripper (hand +z) from beside the palm, towards a point below the fingertips. -->
      <camera name="wrist" pos="0.07 0 0.03" xyaxes="0 1 0 0.925 0 0.381" fovy="{CAMERA_FOVY + 15}"/>
    </body>""")
  for name, side in (("left_finger", 1), ("right_finger", -1)):
    bodies.append(f'<body name="{name}" mocap="true"><geom class="arm" type="box" size="0.01 0.006 0.025" '
                  f'pos="0 {0.006 * side} {tcp}" rgba="0.25 0.25 0.27 1"/></body>')
  return "".join(bodies)


def finger_offsets(opening, xp=np):
  """Finger body origins in the hand frame [2, 3] for a per-finger opening (metres from the centre)."""
  zero = xp.zeros_like(opening)
  return xp.stack([xp.stack([zero, opening, zero]), xp.stack([zero, -opening, zero])])


def _bowl_xml() -> str:
  """A bowl from primitives: a thin base disc and a ring of 12 wall slabs."""
  walls = []
  for k in range(12):
    angle = 2 * math.pi * k / 12
    position = (BOWL_RADIUS * math.cos(angle), BOWL_RADIUS * math.sin(angle), 0.025)
    walls.append(f'<geom class="visual" type="box" size="0.004 0.018 0.025" pos="{_vec(position)}" '
                 f'euler="0 0 {angle:.6g}"/>')
  return (f'<body name="bowl" mocap="true" pos="0.5 -0.2 0"><geom class="visual" type="cylinder" '
          f'size="{BOWL_RADIUS} 0.002" pos="0 0 0.002"/>{"".join(walls)}</body>')


def scene_xml() -> str:
  block_max = BLOCK_HALF_RANGE[1]
  objects = []
  for k, name in enumerate(OBJECT_NAMES):
    position = (0.4 + 0.08 * k, -0.2, 0.05)
    if name == "cylinder":
      geom = (f'<geom name="{name}" class="cylinder" type="cylinder" '
              f'size="{CYLINDER_RADIUS_RANGE[1]} {CYLINDER_HALF_HEIGHT_RANGE[1]}"/>')
    else:
      geom = f'<geom name="{name}" class="block" type="box" size="{block_max} {block_max} {block_max}"/>'
    objects.append(f'<body name="{name}" pos="{_vec(position)}"><freejoint name="{name}"/>{geom}</body>')
  cabinet_half, handle_y = CABINET_HALF, HANDLE_CLOSED_POS[1] - CABINET_POS[1]
  return f"""<mujoco model="ejax_tabletop">
  <compiler angle="radian" autolimits="true"/>
  <option timestep="{TIMESTEP}" integrator="implicitfast" iterations="6" ls_iterations="8">
    <flag eulerdamp="disable"/>
  </option>
  <visual><global offwidth="640" offheight="480"/></visual>
  <default>
    <default class="arm"><geom contype="0" conaffinity="0" rgba="0.93 0.93 0.93 1" material="matte"/></default>
    <default class="visual"><geom contype="0" conaffinity="0" rgba="0.8 0.8 0.8 1" material="matte"/></default>
    <default class="block"><geom contype="1" conaffinity="1" condim="3" friction="1 0.01 0.001" material="matte"/></default>
    <default class="cylinder"><geom contype="2" conaffinity="2" condim="3" friction="1 0.01 0.001" material="matte"/></default>
  </default>
  <asset>
    <!-- mjx.ray needs at least one material in the model (STACK.md). -->
    <material name="matte" specular="0.1" shininess="0.1"/>
    <material name="table" rgba="0.62 0.48 0.34 1" specular="0.1"/>
  </asset>
  <worldbody>
    <light name="top" pos="0.4 0 1.5" dir="0 0 -1" directional="true"/>
    <geom name="table" type="plane" size="1.0 1.0 0.05" material="table" contype="3" conaffinity="3"/>
    <camera name="agentview" pos="{_vec(AGENTVIEW_POS)}" xyaxes="{_vec(_look_at_xyaxes(AGENTVIEW_POS, AGENTVIEW_TARGET))}" fovy="{CAMERA_FOVY}"/>
    <geom name="pedestal" class="visual" type="cylinder" size="0.08 0.02" pos="0 0 0.02" rgba="0.3 0.3 0.32 1"/>
    {_arm_xml()}
    {"".join(objects)}
    {_bowl_xml()}
    <body name="plate" mocap="true" pos="0.5 0.1 0">
      <geom class="visual" type="cylinder" size="{PLATE_RADIUS} 0.003" pos="0 0 0.003"/>
      <geom class="visual" type="cylinder" size="{PLATE_RADIUS * 0.7} 0.0035" pos="0 0 0.0035"/>
    </body>
    <body name="cabinet" pos="{_vec(CABINET_POS)}">
      <geom class="visual" type="box" size="{cabinet_half[0]} {cabinet_half[1]} 0.006" pos="0 0 {2 * cabinet_half[2]}" rgba="0.45 0.3 0.2 1"/>
      <geom class="visual" type="box" size="0.006 {cabinet_half[1]} {cabinet_half[2]}" pos="{cabinet_half[0]} 0 {cabinet_half[2]}" rgba="0.45 0.3 0.2 1"/>
      <geom class="visual" type="box" size="0.006 {cabinet_half[1]} {cabinet_half[2]}" pos="{-cabinet_half[0]} 0 {cabinet_half[2]}" rgba="0.45 0.3 0.2 1"/>
      <geom class="visual" type="box" size="{cabinet_half[0]} 0.006 {cabinet_half[2]}" pos="0 {cabinet_half[1]} {cabinet_half[2]}" rgba="0.45 0.3 0.2 1"/>
    </body>
    <body name="drawer" pos="{_vec(CABINET_POS)}">
        <joint name="drawer" type="slide" axis="{_vec(DRAWER_AXIS)}" range="0 {DRAWER_TRAVEL}" damping="20" armature="0.5"/>
        <geom class="visual" type="box" size="{cabinet_half[0] - 0.01} 0.008 {cabinet_half[2] - 0.01}" pos="0 {-cabinet_half[1] + 0.002} {cabinet_half[2]}" rgba="0.7 0.55 0.4 1"/>
        <geom class="visual" type="box" size="{cabinet_half[0] - 0.02} {cabinet_half[1] - 0.02} 0.004" pos="0 0 0.02" rgba="0.6 0.45 0.3 1"/>
        <geom name="handle" class="visual" type="box" size="0.05 0.008 0.008" pos="0 {handle_y} {HANDLE_HEIGHT}" rgba="0.15 0.15 0.15 1"/>
        <geom class="visual" type="box" size="0.006 0.015 0.006" pos="0.04 {handle_y + 0.02} {HANDLE_HEIGHT}" rgba="0.15 0.15 0.15 1"/>
        <geom class="visual" type="box" size="0.006 0.015 0.006" pos="-0.04 {handle_y + 0.02} {HANDLE_HEIGHT}" rgba="0.15 0.15 0.15 1"/>
    </body>
  </worldbody>
</mujoco>
"""


@dataclasses.dataclass(frozen=True)
class SceneIndex:
  """Addresses into qpos / qvel / ctrl / geoms, resolved once from the compiled model."""
  arm_mocap: np.ndarray       # [8]: links 1..7 and the hand
  finger_mocap: np.ndarray    # [2]: left, right
  object_qpos: np.ndarray     # [NUM_OBJECTS, 7]: xyz + quat of each free object
  object_dof: np.ndarray      # [NUM_OBJECTS, 6]
  object_geom: np.ndarray     # [NUM_OBJECTS]
  drawer_qpos: int
  drawer_dof: int
  bowl_mocap: int
  plate_mocap: int
  bowl_geoms: np.ndarray      # geoms whose colour follows the bowl's colour
  plate_geoms: np.ndarray
  agentview_camera: int
  wrist_camera: int


@functools.lru_cache(maxsize=None)
def mj_model() -> mujoco.MjModel:
  """The compiled scene (cached: every env shares it; do not mutate it, copy it)."""
  return mujoco.MjModel.from_xml_string(scene_xml())


@functools.lru_cache(maxsize=None)
def scene_index() -> SceneIndex:
  model = mj_model()

  def joint(name):
    return model.joint(name)

  def body_geoms(name):
    body_id = model.body(name).id
    return np.flatnonzero(model.geom_bodyid == body_id)

  return SceneIndex(
      arm_mocap=np.array([model.body(f"link{i + 1}").mocapid[0] for i in range(7)] + [model.body("hand").mocapid[0]]),
      finger_mocap=np.array([model.body("left_finger").mocapid[0], model.body("right_finger").mocapid[0]]),
      object_qpos=np.array([joint(name).qposadr[0] + np.arange(7) for name in OBJECT_NAMES]),
      object_dof=np.array([joint(name).dofadr[0] + np.arange(6) for name in OBJECT_NAMES]),
      object_geom=np.array([model.geom(name).id for name in OBJECT_NAMES]),
      drawer_qpos=int(joint("drawer").qposadr[0]),
      drawer_dof=int(joint("drawer").dofadr[0]),
      bowl_mocap=int(model.body("bowl").mocapid[0]),
      plate_mocap=int(model.body("plate").mocapid[0]),
      bowl_geoms=body_geoms("bowl"),
      plate_geoms=body_geoms("plate"),
      agentview_camera=model.camera("agentview").id,
      wrist_camera=model.camera("wrist").id,
  )


def handle_position(drawer_q, xp=np):
  """World position of the drawer handle's centre for drawer opening q (metres along DRAWER_AXIS)."""
  return xp.asarray(HANDLE_CLOSED_POS) + xp.asarray(DRAWER_AXIS) * drawer_q
