"""Scene, kinematics and registry checks that need no compilation (numpy only)."""

import mujoco
import numpy as np
import pytest

from ejax.sim import control, kinematics, registry, scene, tasks


def test_suites_register_at_least_ten_tasks_over_two_suites():
  assert len(registry.list_suites()) >= 2
  assert len(registry.list_tasks()) >= 10
  for suite in registry.list_suites():
    for name in registry.list_tasks(suite):
      spec = registry.get_spec(name)
      assert spec.suite == suite and spec.instruction
  with pytest.raises(ValueError, match="unknown task"):
    registry.get_spec("no_such_task")


def test_scene_compiles_with_a_material_for_ray_casting():
  model = scene.mj_model()
  assert model.nmat >= 1
  # Links 1..7, bowl and plate are mocap bodies; the hand (3 slides), fingers (2), four free objects
  # and the drawer are dynamic; five position servos (hand x, y, z, two fingers).
  assert model.nmocap == 9 and model.nq == 3 + 2 + 4 * 7 + 1 and model.nu == 5


def test_mocap_links_match_dh_kinematics_and_the_hand_sits_at_its_joints():
  """Links posed through mocap are where kinematics.link_frames puts them; the hand's slide joints
  are the tcp's world position, and the finger pads' inner faces are `opening` from the centre."""
  rng = np.random.default_rng(0)
  model, data = scene.mj_model(), mujoco.MjData(scene.mj_model())
  index = scene.scene_index()
  q = (kinematics.HOME_QPOS + rng.uniform(-0.4, 0.4, 7)).astype(np.float32)
  pos, quat = control.arm_mocap_pose(q)
  data.mocap_pos[index.arm_mocap], data.mocap_quat[index.arm_mocap] = pos, quat
  tcp, _, _, _ = kinematics.forward_kinematics(q)
  data.qpos[index.hand_qpos] = tcp
  data.qpos[index.finger_qpos] = 0.02
  mujoco.mj_kinematics(model, data)
  positions, rotations = kinematics.link_frames(q)
  for i in range(7):
    np.testing.assert_allclose(data.xpos[model.body(f"link{i + 1}").id], positions[i], atol=1e-5)
    np.testing.assert_allclose(data.xmat[model.body(f"link{i + 1}").id].reshape(3, 3), rotations[i], atol=1e-5)
  np.testing.assert_allclose(data.site("tcp").xpos, tcp, atol=1e-6)
  # The hand keeps the orientation the controller holds: the home flange turned -45 degrees about its
  # z axis (as a Franka hand is mounted), so the gripper points down and closes along the world y axis.
  hand = data.site("tcp").xmat.reshape(3, 3)
  turn = np.array([[np.cos(-np.pi / 4), -np.sin(-np.pi / 4), 0], [np.sin(-np.pi / 4), np.cos(-np.pi / 4), 0], [0, 0, 1]])
  np.testing.assert_allclose(hand, kinematics.home_tcp_rotation() @ turn, atol=1e-3)  # HOME_QPOS[6] = 0.785
  np.testing.assert_allclose(hand, scene.HAND_ROTATION, atol=1e-6)
  for name, side in (("left_finger", 1), ("right_finger", -1)):
    for k, along in enumerate((-scene.FINGER_PAD_SPREAD, scene.FINGER_PAD_SPREAD)):
      pad_centre = data.geom(f"{name}_pad{k}").xpos
      np.testing.assert_allclose(pad_centre - tcp, [along, side * (0.02 + scene.FINGER_PAD_RADIUS), 0], atol=1e-6)


def test_grasped_slot_needs_closed_settled_fingers_on_the_object():
  index = scene.scene_index()
  qpos = scene.mj_model().qpos0.astype(np.float32).copy()
  qvel = np.zeros(scene.mj_model().nv, np.float32)
  half_widths = np.array([0.02, 0.02, 0.02, 0.02, scene.HANDLE_HALF_WIDTH], np.float32)
  qpos[index.object_qpos[1, :3]] = [0.5, 0.1, 0.02]
  qpos[index.hand_qpos] = [0.5, 0.1, 0.021]
  qpos[index.finger_qpos] = 0.0195  # pads pressed 1 mm into the block's faces
  assert control.grasped_slot(qpos, qvel, True, half_widths) == 1
  assert control.grasped_slot(qpos, qvel, False, half_widths) == control.NO_GRASP  # commanded open
  moving = qvel.copy()
  moving[index.finger_dof] = 0.1
  assert control.grasped_slot(qpos, moving, True, half_widths) == control.NO_GRASP  # still closing
  closed_on_nothing = qpos.copy()
  closed_on_nothing[index.finger_qpos] = 0.0
  assert control.grasped_slot(closed_on_nothing, qvel, True, half_widths) == control.NO_GRASP
  wide_open = qpos.copy()
  wide_open[index.finger_qpos] = scene.FINGER_OPEN
  assert control.grasped_slot(wide_open, qvel, True, half_widths) == control.NO_GRASP
  above = qpos.copy()
  above[index.hand_qpos[2]] = 0.08
  assert control.grasped_slot(above, qvel, True, half_widths) == control.NO_GRASP


def test_a_closed_gripper_lifts_a_block_by_friction_alone():
  """Native MuJoCo: close on a block, lift 12 cm and carry it sideways at full speed; it stays in the
  hand within a few millimetres, and falls when the gripper opens."""
  model, data = scene.mj_model(), mujoco.MjData(scene.mj_model())
  index = scene.scene_index()
  for k in range(scene.NUM_OBJECTS):
    data.qpos[index.object_qpos[k, :3]] = [0.35 + 0.1 * k, 0.3, 0.03]
  block = np.array([0.5, 0.0, scene.BLOCK_HALF_RANGE[1]])
  data.qpos[index.object_qpos[0, :3]] = block
  data.qpos[index.hand_qpos] = block
  data.qpos[index.finger_qpos] = scene.FINGER_OPEN
  info = {"ee_target": block.astype(np.float32), "q_target": kinematics.HOME_QPOS.copy(),
          "finger": np.float32(scene.FINGER_OPEN)}
  for _ in range(20):  # IK onto the block first
    info["q_target"] = kinematics.ik_step(info["q_target"], info["ee_target"], kinematics.home_tcp_rotation())
  info["arm_q"] = info["q_target"]
  data.ctrl[:] = control.initial_ctrl(info["arm_q"])

  def act(action, steps):
    for _ in range(steps):
      plan, ctrl = control.plan_step(info, np.asarray(action, np.float32))
      info.update(plan)
      for k in range(scene.SUBSTEPS):
        data.ctrl[:] = control.substep_ctrl(ctrl[k], data.qpos)
        mujoco.mj_step(model, data)

  act([0, 0, 0, 1], 4)
  assert 0.045 < control.gripper_gap(data.qpos) < 0.053  # stopped by the 5.2 cm block
  act([0, 0, 1, 1], 3)
  act([0, 1, 0, 1], 4)
  offset = data.qpos[index.object_qpos[0, :3]] - control.tcp_position(data.qpos)
  assert data.qpos[index.object_qpos[0, 2]] > 0.12
  assert np.abs(offset).max() < 0.01, offset
  act([0, 0, 0, -1], 8)
  assert abs(data.qpos[index.object_qpos[0, 2]] - block[2]) < 2e-3, "released, the block falls to the table"


def test_matrix_to_quat_matches_mujoco():
  rng = np.random.default_rng(1)
  for _ in range(20):
    quat = rng.normal(size=4)
    quat /= np.linalg.norm(quat)
    matrix = np.zeros(9)
    mujoco.mju_quat2Mat(matrix, quat)
    ours = kinematics.matrix_to_quat(matrix.reshape(3, 3).astype(np.float32))
    np.testing.assert_allclose(np.abs(ours @ quat), 1.0, atol=1e-5)  # same rotation (q and -q)


def test_ik_reaches_workspace_points_with_the_hand_down():
  rotation = kinematics.home_tcp_rotation()
  for target in ([0.36, -0.27, 0.02], [0.64, 0.135, 0.02], [0.5, 0.37, 0.07], [0.45, 0.0, 0.3]):
    q = kinematics.HOME_QPOS.copy()
    for _ in range(30):
      q = kinematics.ik_step(q, np.asarray(target, np.float32), rotation)
    tcp, tcp_rotation, _, _ = kinematics.forward_kinematics(q)
    np.testing.assert_allclose(tcp, target, atol=1e-3)
    np.testing.assert_allclose(tcp_rotation, rotation, atol=1e-2)


def test_the_controller_keeps_the_arm_on_target_under_any_actions():
  """Actions that drive the target into each of the workspace box's far corners and then wander at
  random: the target stays within the arm's reach, and the IK keeps the hand on it, pointing down.
  (The far corners are out of reach: chasing one, the IK straightened the elbow onto its limit, lost
  the orientation and ended with every joint at a limit and the hand below the table; under random
  actions MJX's physics then went NaN.)"""
  rotation = kinematics.home_tcp_rotation()
  rng = np.random.default_rng(0)
  for corner in ([1, 1, 1], [1, -1, 1], [1, 1, -1], [1, -1, -1]):
    tcp, _, _, _ = kinematics.forward_kinematics(kinematics.HOME_QPOS)
    info = {"ee_target": tcp.astype(np.float32), "q_target": kinematics.HOME_QPOS.copy(),
            "arm_q": kinematics.HOME_QPOS.copy(), "finger": np.float32(scene.FINGER_OPEN)}
    actions = [np.asarray(corner + [0], np.float32)] * 40 + list(rng.uniform(-1, 1, (60, 4)).astype(np.float32))
    for step, action in enumerate(actions):
      plan, _ = control.plan_step(info, action)
      info.update(plan)
      target = info["ee_target"]
      assert np.all(target >= control.WORKSPACE_LOW - 1e-6) and np.all(target <= control.WORKSPACE_HIGH + 1e-6)
      assert np.linalg.norm(target + control.TCP_FLANGE - control.SHOULDER) <= control.REACH + 1e-5
      reached, reached_rotation, _, _ = kinematics.forward_kinematics(info["q_target"])
      assert np.linalg.norm(reached - target) < 0.02, (corner, step, reached, target)
      np.testing.assert_allclose(reached_rotation, rotation, atol=0.05, err_msg=f"{corner} step {step}")


def test_task_encoding_rejects_unknown_targets():
  with pytest.raises(ValueError, match="unknown target"):
    tasks.encode_task(tasks.TaskSpec("bad", "x", "do it", target="purple", destination="bowl"))
  row = tasks.encode_task(registry.get_spec("spatial_stack_left_on_right"))
  assert row["target_relation"] == tasks.RELATION_CODES["left"]
  assert row["anchor_relation"] == tasks.RELATION_CODES["right"] and bool(row["require_release"])
