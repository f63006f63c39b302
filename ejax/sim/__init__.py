"""ejax.sim: language-conditioned tabletop manipulation suites in MuJoCo / MJX, built by ejax.

    from ejax.sim import registry
    from ejax.sim.batched import make_batched
    env = registry.make("object_red_block_to_bowl")          # one env: pure reset(rng) / step(state, action)
    batch = make_batched(registry.list_tasks(), 30, backend="mjx" | "native", cameras=True)

Modules: scene (MJCF), kinematics (DH arm), control (action space, IK, grasping), tasks + suites
(tasks as data), layout (initial states), env (EnvState, MJX Env), batched / native (batched
runners), camera (JAX ray casting), expert (scripted experts), demos (job `demos`).
"""
