"""Serving trained policies over openpi's websocket protocol (job `serve`).

  wire.py     msgpack with numpy arrays, as openpi_client.msgpack_numpy
  spec.py     the observation keys, shapes and dtypes a checkpoint's policy reads; request checks
  batcher.py  dynamic batching of concurrent clients on the device, one compilation per bucket
  server.py   the websocket server (metadata, API key, errors as text frames) and job `serve`
  client.py   a served policy behind ejax.eval's policy interface (--config.eval.policy=remote)
"""
