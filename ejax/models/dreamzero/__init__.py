"""DreamZero, NVIDIA's world action model (dreamzero0/dreamzero): a Wan image-to-video DiT that
denoises future video latents and action chunks together.

  sequence.py      the token layout [clean video | noisy video | actions | states], the WAM mask ids
                   (ejax.kernels.attention mask kind "wam") and the 3D / 1D RoPE angles
  wan_dit.py       the Wan DiT with per-token AdaLN timesteps and summed text + image cross-attention
  text_encoder.py  umT5-XXL's encoder (frozen)
  image_encoder.py CLIP ViT-H/14's vision tower (frozen, first frame, 257 tokens)
  vae.py           the Wan 2.1 / 2.2 video VAE (frozen)
  model.py         the whole model: config, flow-matching loss, chunk-by-chunk KV-cache policy step,
                   registry entry
  unipc.py         the UniPC sampler of the official policy
  inputs.py        batches from the input pipeline's samples: LeRobot (ejax/data/dreamzero_samples.py:
                   frames, chunks, states, the camera grid) and synthetic
  tokenizer.py     the instruction as umT5 token ids (bytes at CPU size)
Weights: ejax/models/io/dreamzero.py. Config: configs/dreamzero.py (:5b, :14b, :runlocal).
"""
