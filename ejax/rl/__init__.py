"""RL-VLA3: three-level asynchronous RL fine-tuning of flow-matching policies beside batched envs.

  losses.py       GAE, decoupled PPO (proximal ratio, behaviour-weight drop, dual clip), GRPO, value loss
  policy.py       FlowPolicy: Flow-SDE sampling and log-probs over a flow actor + value head
  vla.py          GR00T-N1.5 as the actor: a train-job checkpoint, in-jit inputs, backbone once per sample
  delays.py       per-shard step-delay samplers (constant / uniform / exponential / lognormal / empirical)
  trace.py        recorded stage timings of the real components replayed through the pipeline, and their bound
  coordination.py param store, segment tickets (the staleness gate), request board, stoppable queues
  env_shard.py    level 1: a batch of envs stepped by one jitted call, on its own thread
  inference.py    level 2: dynamic-batching inference server, samples tagged with the policy version
  learner.py      level 3: in-order segments -> one jitted PPO / GRPO update -> published version
  pipeline.py     wiring, sync baseline (eta = 0 + barrier), placement, metrics, shutdown, faults
  timeline.py     busy intervals, waits, timeline PNG
  checkpoint.py   orbax checkpoint / resume of an RL run
  warm_start.py   SFT on scripted-expert demos, closed-loop success, eval-interface adapter
  point_env.py    PointReach, a small pure-JAX task with the simulator interface
  runner.py       job `rl` (configs/rl_vla3.py)
"""
