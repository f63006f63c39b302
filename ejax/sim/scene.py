"""The one tabletop scene every task shares, generated as MJCF by ejax (no downloaded assets).

Contents: a table (plane), a Franka-like 7-DoF arm built from the DH table in `kinematics.py` with a
parallel gripper (two actuated slide fingers), three blocks and a cylinder (free bodies), a
bowl and a plate (static bodies, moved per episode), and a cabinet with a sliding drawer. Two cameras:
a fixed "agentview" facing the robot and a "wrist" camera on the hand looking down the gripper.

One shared model is the point: every task is data (see tasks.py), so a batch mixing all tasks runs
through one compiled MJX step. Per-episode object sizes and colours live in each env's state and are
swapped into the model inside `step` (geom_size / geom_rgba), the usual MJX domain-randomisation trick.

What is simulated, and what is not:
  - The hand is a dynamic body: three slide joints (world x, y, z) driven by stiff position servos
    that track the arm's forward kinematics (control.py), with gravity compensation. Its two fingers
    slide on their own joints, each driven by a force-limited position servo (control.py sets them
    like a non-backdrivable gripper). Objects are grasped, carried and released by finger contact
    and friction only.
  - Links 1..7 are kinematic (mocap bodies posed from the joint angles every step) and do not
    collide: a collision-free 7-link chain would add nothing to these tabletop tasks but a tree nine
    bodies deep, which makes MJX compile several times slower. The arm's kinematics (the DH chain, IK,
    joint limits and speeds) are exact; its dynamics are the hand's.
  - The bowl's rim (eight capsules) and the plate (a cylinder, with a box inside it for blocks: MJX
    has no box-cylinder collision) collide with the objects; the drawer slides on a damped joint and
    its handle collides with the fingers. The cabinet, the bowl's floor disc and the arm are visual.
  - Contact filtering (contype / conaffinity bits) keeps MJX's static pair list short: blocks (bit 1)
    touch blocks, the table, the fingers, the rim and the plate's box; the cylinder (bit 2) touches the
    table, the fingers and the plate's cylinder; the fingers (bit 4) touch objects, handle and table.
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
HANDLE_HALF_WIDTH = 0.008   # the handle bar's half thickness across the gripper's closing direction
# Handle centre in the world when the drawer is closed.
HANDLE_CLOSED_POS = np.array([CABINET_POS[0], CABINET_POS[1] - CABINET_HALF[1] - 0.035, HANDLE_HEIGHT], np.float32)

AGENTVIEW_POS = np.array([1.25, 0.0, 0.75], np.float32)
AGENTVIEW_TARGET = np.array([0.45, 0.05, 0.05], np.float32)
CAMERA_FOVY = 45.0
WRIST_CAMERA_AIM = 0.05   # the wrist camera looks at the tool axis this far below the tcp [m]


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


# The hand frame: x away from the robot, y to the robot's right, z down (the gripper points down), as
# the Franka hand sits on the flange rotated -45 degrees about the flange's z axis.
HAND_ROTATION = np.array([[1.0, 0.0, 0.0], [0.0, -1.0, 0.0], [0.0, 0.0, -1.0]], np.float32)
# Each finger's pad: two upright capsules side by side along the hand's x axis, centred at tcp height.
# Together they act as a flat pad (a rotated block is turned square to the fingers as they close);
# upright, they meet the upright cylinder along a line.
FINGER_PAD_RADIUS = 0.006
FINGER_PAD_HALF_LENGTH = 0.008       # half the straight part of each capsule
FINGER_PAD_SPREAD = 0.012            # the capsules' axes sit this far either side of the finger centre
HAND_KP, HAND_KV = 4000.0, 130.0     # hand servo [N/m], [N s/m] on a 1 kg carriage (about critical)
GRIPPER_KP, GRIPPER_KV, GRIPPER_FORCE = 2000.0, 40.0, 40.0  # per-finger servo; 40 N force limit
DRAWER_DAMPING = 6.0
PLATE_HEIGHT = 0.008           # the plate's top surface above the table [m]
BOWL_RIM_RADIUS, BOWL_RIM_TUBE, BOWL_RIM_SEGMENTS = 0.065, 0.011, 8
MJX_MAX_GEOM_PAIRS, MJX_MAX_CONTACT_POINTS = 4, 24


def _flange_to_hand_frame(position: np.ndarray, rotation: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """A pose given in the home flange frame -> the same world pose in the hand frame (origin: tcp)."""
  flange_rotation = kinematics.home_tcp_rotation()
  world_offset = flange_rotation @ (position - np.array([0.0, 0.0, kinematics.TCP_OFFSET]))
  return HAND_ROTATION.T @ world_offset, HAND_ROTATION.T @ flange_rotation @ rotation


def _arm_xml() -> str:
  """Links 1..7 as mocap bodies posed every step from the joint angles; then the dynamic hand.

  The links follow kinematics.link_frames (control.arm_mocap_pose). The hand body's origin is the tool
  centre point; its three slide joints are the tcp's world coordinates, so the hand servo's set point
  is simply forward_kinematics(q).
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
  # The wrist camera keeps its place on the hand: beside the palm, looking down the gripper at a point
  # WRIST_CAMERA_AIM below the tool centre point (given in the flange frame, like a camera bolted to the
  # flange), so whatever is between the fingers, or about to be, sits near the middle of its image.
  camera_pos = np.array([0.07, 0.0, 0.055])
  forward = np.array([0.0, 0.0, tcp + WRIST_CAMERA_AIM]) - camera_pos
  forward /= np.linalg.norm(forward)
  up = np.array([forward[2], 0.0, -forward[0]])  # in the flange's xz plane, away from the tool axis
  camera_rotation = np.stack([np.cross(up, -forward), up, -forward], axis=1)  # columns: x right, y up, z back
  camera_pos, camera_rot = _flange_to_hand_frame(camera_pos, camera_rotation)
  palm_z = -tcp  # the flange, in the hand frame (z points down)
  axes = {name: HAND_ROTATION.T @ axis for name, axis in zip("xyz", np.eye(3))}
  joints = "".join(f'<joint name="hand_{name}" type="slide" axis="{_vec(axis)}"/>' for name, axis in axes.items())
  fingers = []
  for name, side in (("left_finger", -1), ("right_finger", 1)):  # the robot's left is the hand's -y
    pads = "".join(
        f'<geom name="{name}_pad{k}" class="finger" type="capsule" size="{FINGER_PAD_RADIUS}" '
        f'fromto="{x} {side * FINGER_PAD_RADIUS} {-FINGER_PAD_HALF_LENGTH} {x} {side * FINGER_PAD_RADIUS} {FINGER_PAD_HALF_LENGTH}"/>'
        for k, x in enumerate((-FINGER_PAD_SPREAD, FINGER_PAD_SPREAD)))
    fingers.append(f"""
      <body name="{name}" gravcomp="1">
        <joint name="{name}" type="slide" axis="0 {side} 0" range="0 {FINGER_OPEN}" armature="0.05" damping="2"/>
        <geom class="arm" type="box" size="0.01 0.006 0.03" pos="0 {side * 0.006} -0.028" rgba="0.25 0.25 0.27 1" mass="0.05"/>
        {pads}
      </body>""")
  bodies.append(f"""
    <body name="hand" quat="{_vec(_quat_from_matrix(HAND_ROTATION))}" gravcomp="1">
      {joints}
      <inertial pos="0 0 {palm_z / 2}" mass="1.0" diaginertia="0.005 0.005 0.005"/>
      <geom class="arm" type="cylinder" size="0.035 0.01" pos="0 0 {palm_z + 0.01}" rgba="0.2 0.2 0.22 1"/>
      <geom class="arm" type="box" size="0.025 0.1 0.025" pos="0 0 {palm_z + 0.045}" rgba="0.92 0.92 0.92 1"/>
      <site name="tcp" size="0.005"/>
      <camera name="wrist" pos="{_vec(camera_pos)}" xyaxes="{_vec(camera_rot[:, 0])} {_vec(camera_rot[:, 1])}" fovy="{CAMERA_FOVY + 15}"/>
      {"".join(fingers)}
    </body>""")
  return "".join(bodies)


def _actuator_xml() -> str:
  hand = "".join(f'<position name="hand_{name}" joint="hand_{name}" kp="{HAND_KP}" kv="{HAND_KV}"/>' for name in "xyz")
  fingers = "".join(f'<position name="{name}" joint="{name}" kp="{GRIPPER_KP}" kv="{GRIPPER_KV}" '
                    f'forcerange="{-GRIPPER_FORCE} {GRIPPER_FORCE}" ctrlrange="0 {FINGER_OPEN}"/>'
                    for name in ("left_finger", "right_finger"))
  return f"<actuator>{hand}{fingers}</actuator>"


def _bowl_xml() -> str:
  """A bowl from primitives: a thin floor disc (visual) and a rim of capsules the blocks collide with."""
  rim = []
  half_length = BOWL_RIM_RADIUS * math.tan(math.pi / BOWL_RIM_SEGMENTS)
  for k in range(BOWL_RIM_SEGMENTS):
    angle = 2 * math.pi * (k + 0.5) / BOWL_RIM_SEGMENTS
    centre = np.array([BOWL_RIM_RADIUS * math.cos(angle), BOWL_RIM_RADIUS * math.sin(angle), BOWL_RIM_TUBE])
    tangent = np.array([-math.sin(angle), math.cos(angle), 0.0]) * half_length
    rim.append(f'<geom class="rim" type="capsule" size="{BOWL_RIM_TUBE}" fromto="{_vec(centre - tangent)} {_vec(centre + tangent)}"/>')
  return (f'<body name="bowl" mocap="true" pos="0.5 -0.2 0"><geom class="visual" type="cylinder" '
          f'size="{BOWL_RIM_RADIUS} 0.001" pos="0 0 0.001"/>{"".join(rim)}</body>')


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
  plate_box = PLATE_RADIUS / math.sqrt(2) - 0.002
  return f"""<mujoco model="ejax_tabletop">
  <compiler angle="radian" autolimits="true"/>
  <option timestep="{TIMESTEP}" integrator="implicitfast" iterations="6" ls_iterations="8" impratio="10">
    <flag eulerdamp="disable"/>
  </option>
  <visual><global offwidth="640" offheight="480"/></visual>
  <custom>
    <!-- MJX only (native MuJoCo has its own broad phase): per collision-function group, test only the
         {MJX_MAX_GEOM_PAIRS} nearest candidate pairs, and keep the {MJX_MAX_CONTACT_POINTS} deepest contacts per
         contact dimension. Far fewer constraint rows than the static all-pairs list (tests/sim/test_backends.py
         checks that nothing real is culled: MJX and native MuJoCo agree). -->
    <numeric name="max_geom_pairs" data="{MJX_MAX_GEOM_PAIRS}"/>
    <numeric name="max_contact_points" data="{MJX_MAX_CONTACT_POINTS}"/>
  </custom>
  <default>
    <default class="arm"><geom contype="0" conaffinity="0" rgba="0.93 0.93 0.93 1" material="matte"/></default>
    <default class="visual"><geom contype="0" conaffinity="0" rgba="0.8 0.8 0.8 1" material="matte"/></default>
    <default class="block"><geom contype="1" conaffinity="1" condim="3" friction="1 0.01 0.001" density="600" material="matte"/></default>
    <default class="cylinder"><geom contype="2" conaffinity="2" condim="3" friction="1 0.01 0.001" density="600" material="matte"/></default>
    <default class="finger"><geom contype="4" conaffinity="3" condim="3" friction="1.5 0.02 0.002" mass="0.02" rgba="0.25 0.25 0.27 1" material="matte"/></default>
    <default class="rim"><geom contype="0" conaffinity="1" rgba="0.8 0.8 0.8 1" material="matte"/></default>
  </default>
  <asset>
    <!-- mjx.ray needs at least one material in the model (STACK.md). -->
    <material name="matte" specular="0.1" shininess="0.1"/>
    <material name="table" rgba="0.62 0.48 0.34 1" specular="0.1"/>
  </asset>
  <worldbody>
    <light name="top" pos="0.4 0 1.5" dir="0 0 -1" directional="true"/>
    <geom name="table" type="plane" size="1.0 1.0 0.05" material="table" contype="0" conaffinity="7"/>
    <camera name="agentview" pos="{_vec(AGENTVIEW_POS)}" xyaxes="{_vec(_look_at_xyaxes(AGENTVIEW_POS, AGENTVIEW_TARGET))}" fovy="{CAMERA_FOVY}"/>
    <geom name="pedestal" class="visual" type="cylinder" size="0.08 0.02" pos="0 0 0.02" rgba="0.3 0.3 0.32 1"/>
    {_arm_xml()}
    {"".join(objects)}
    {_bowl_xml()}
    <body name="plate" mocap="true" pos="0.5 0.1 0">
      <geom class="visual" type="cylinder" size="{PLATE_RADIUS} {PLATE_HEIGHT / 2}" pos="0 0 {PLATE_HEIGHT / 2}" contype="0" conaffinity="2"/>
      <geom class="visual" type="box" size="{plate_box} {plate_box} {PLATE_HEIGHT / 2}" pos="0 0 {PLATE_HEIGHT / 2}" contype="0" conaffinity="1" rgba="0 0 0 0"/>
      <geom class="visual" type="cylinder" size="{PLATE_RADIUS * 0.7} 0.0005" pos="0 0 {PLATE_HEIGHT + 0.0005}"/>
    </body>
    <body name="cabinet" pos="{_vec(CABINET_POS)}">
      <geom class="visual" type="box" size="{cabinet_half[0]} {cabinet_half[1]} 0.006" pos="0 0 {2 * cabinet_half[2]}" rgba="0.45 0.3 0.2 1"/>
      <geom class="visual" type="box" size="0.006 {cabinet_half[1]} {cabinet_half[2]}" pos="{cabinet_half[0]} 0 {cabinet_half[2]}" rgba="0.45 0.3 0.2 1"/>
      <geom class="visual" type="box" size="0.006 {cabinet_half[1]} {cabinet_half[2]}" pos="{-cabinet_half[0]} 0 {cabinet_half[2]}" rgba="0.45 0.3 0.2 1"/>
      <geom class="visual" type="box" size="{cabinet_half[0]} 0.006 {cabinet_half[2]}" pos="0 {cabinet_half[1]} {cabinet_half[2]}" rgba="0.45 0.3 0.2 1"/>
    </body>
    <body name="drawer" pos="{_vec(CABINET_POS)}">
        <joint name="drawer" type="slide" axis="{_vec(DRAWER_AXIS)}" range="0 {DRAWER_TRAVEL}" damping="{DRAWER_DAMPING}" armature="0.5"/>
        <geom class="visual" type="box" size="{cabinet_half[0] - 0.01} 0.008 {cabinet_half[2] - 0.01}" pos="0 {-cabinet_half[1] + 0.002} {cabinet_half[2]}" rgba="0.7 0.55 0.4 1"/>
        <geom class="visual" type="box" size="{cabinet_half[0] - 0.02} {cabinet_half[1] - 0.02} 0.004" pos="0 0 0.02" rgba="0.6 0.45 0.3 1"/>
        <geom name="handle" class="visual" type="box" size="0.05 {HANDLE_HALF_WIDTH} 0.008" pos="0 {handle_y} {HANDLE_HEIGHT}" contype="0" conaffinity="4" rgba="0.15 0.15 0.15 1"/>
        <geom class="visual" type="box" size="0.006 0.015 0.006" pos="0.04 {handle_y + 0.02} {HANDLE_HEIGHT}" rgba="0.15 0.15 0.15 1"/>
        <geom class="visual" type="box" size="0.006 0.015 0.006" pos="-0.04 {handle_y + 0.02} {HANDLE_HEIGHT}" rgba="0.15 0.15 0.15 1"/>
    </body>
  </worldbody>
  {_actuator_xml()}
</mujoco>
"""


@dataclasses.dataclass(frozen=True)
class SceneIndex:
  """Addresses into qpos / qvel / ctrl / geoms, resolved once from the compiled model."""
  arm_mocap: np.ndarray       # [7]: links 1..7
  hand_qpos: np.ndarray       # [3]: the hand's slide joints = tcp world position
  hand_dof: np.ndarray        # [3]
  finger_qpos: np.ndarray     # [2]: left, right finger opening (pad inner face from the centre)
  finger_dof: np.ndarray      # [2]
  hand_actuators: np.ndarray  # [3]: ctrl = tcp set point
  finger_actuators: np.ndarray  # [2]: ctrl = per-finger opening set point (both the same)
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
      arm_mocap=np.array([model.body(f"link{i + 1}").mocapid[0] for i in range(7)]),
      hand_qpos=np.array([joint(f"hand_{axis}").qposadr[0] for axis in "xyz"]),
      hand_dof=np.array([joint(f"hand_{axis}").dofadr[0] for axis in "xyz"]),
      finger_qpos=np.array([joint(name).qposadr[0] for name in ("left_finger", "right_finger")]),
      finger_dof=np.array([joint(name).dofadr[0] for name in ("left_finger", "right_finger")]),
      hand_actuators=np.array([model.actuator(f"hand_{axis}").id for axis in "xyz"]),
      finger_actuators=np.array([model.actuator(name).id for name in ("left_finger", "right_finger")]),
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


def camera_calibration() -> dict[str, dict]:
  """Both cameras' calibration in the form model.perception.geometry.cameras takes: the agentview's pose in
  the world; the wrist camera's offset from the tool centre point (the hand keeps its orientation, so
  the offset and the rotation are constant) and rotation; each camera's vertical field of view."""
  model = mj_model()
  data = mujoco.MjData(model)
  mujoco.mj_forward(model, data)
  tcp = data.qpos[scene_index().hand_qpos]  # the hand's slide joints are world coordinates
  calibration = {}
  for name, mount in (("agentview", "world"), ("wrist", "tcp")):
    cam = model.camera(name).id
    position = data.cam_xpos[cam] - (tcp if mount == "tcp" else 0.0)
    calibration[name] = dict(mount=mount, position=[round(float(v), 6) for v in position],
                             rotation=[round(float(v), 6) for v in data.cam_xmat[cam]], fovy=float(model.cam_fovy[cam]))
  return calibration
