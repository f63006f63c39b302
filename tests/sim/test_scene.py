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
  assert model.nmocap == 12 and model.nq == 4 * 7 + 1


def test_mocap_arm_matches_dh_kinematics():
  """The hand's tcp site, posed through mocap, is where kinematics.forward_kinematics puts it."""
  rng = np.random.default_rng(0)
  model, data = scene.mj_model(), mujoco.MjData(scene.mj_model())
  index = scene.scene_index()
  q = (kinematics.HOME_QPOS + rng.uniform(-0.4, 0.4, 7)).astype(np.float32)
  pos, quat = control.arm_mocap_pose(q, np.float32(0.02))
  bodies = np.concatenate([index.arm_mocap, index.finger_mocap])
  data.mocap_pos[bodies], data.mocap_quat[bodies] = pos, quat
  mujoco.mj_kinematics(model, data)
  tcp, rotation, _, _ = kinematics.forward_kinematics(q)
  np.testing.assert_allclose(data.site("tcp").xpos, tcp, atol=1e-5)
  np.testing.assert_allclose(data.site("tcp").xmat.reshape(3, 3), rotation, atol=1e-5)
  # The fingers sit 2 cm either side of the tcp along the hand's y axis.
  finger_gap = data.xpos[model.body("left_finger").id] - data.xpos[model.body("right_finger").id]
  np.testing.assert_allclose(finger_gap, 0.04 * rotation[:, 1], atol=1e-5)


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


def test_task_encoding_rejects_unknown_targets():
  with pytest.raises(ValueError, match="unknown target"):
    tasks.encode_task(tasks.TaskSpec("bad", "x", "do it", target="purple", destination="bowl"))
  row = tasks.encode_task(registry.get_spec("spatial_stack_left_on_right"))
  assert row["target_relation"] == tasks.RELATION_CODES["left"]
  assert row["anchor_relation"] == tasks.RELATION_CODES["right"] and bool(row["require_release"])
