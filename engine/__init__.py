"""The reference engine: a decoder-only transformer (Llama, Qwen3, Qwen3-MoE)
whose cold start does the real work podsnap skips on restore — reading an HF
checkpoint by byte ranges and post-processing it into device state
(W8A8 int8 weights in FRACTAL_NZ layout, scales, RoPE tables, mask cache).
"""
