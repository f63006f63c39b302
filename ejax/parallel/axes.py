"""Logical axis names: the only axis vocabulary model code uses.

Parameters name their axes at creation (`nnx.Param(value, out_sharding=(EMBED, MLP))` or
`nnx.with_partitioning(init, (EMBED, MLP))`); activations are constrained at block boundaries with
the ACT_* names through `ejax.parallel.constrain`. The table in `configs/common.py` maps each name
onto the mesh axes (data, fsdp, tensor); model code never names a mesh axis.
"""

# Mesh axes, outermost first.
DATA = "data"
FSDP = "fsdp"
TENSOR = "tensor"
MESH_AXES = (DATA, FSDP, TENSOR)

# Parameter axes.
EMBED = "embed"          # model width (the dimension FSDP shards)
MLP = "mlp"              # feed-forward hidden width
HEADS = "heads"          # query heads
KV_HEADS = "kv_heads"    # key/value heads (GQA / MQA)
HEAD_DIM = "head_dim"
VOCAB = "vocab"
EMBODIMENT = "embodiment"  # per-embodiment weight tables W[num_embodiments, in, out]
IN_FEATURES = "in_features"  # small input widths (state, action, patch pixels)
NORM = "norm"            # scales and biases of norms: never sharded
LAYERS = "layers"        # stacked (scanned) layers

# Activation axes.
ACT_BATCH = "act_batch"
ACT_LEN = "act_len"
ACT_EMBED = "act_embed"
ACT_HEADS = "act_heads"
ACT_MLP = "act_mlp"
ACT_VOCAB = "act_vocab"

BATCH_SPEC = (ACT_BATCH, ACT_LEN, ACT_EMBED)
