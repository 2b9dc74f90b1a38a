"""`moe_gpt`: a Qwen3-MoE-shaped decoder with Megatron-style TP/PP/DP/EP on explicit torch.distributed calls.

Modules: `parallel_state` (process groups), `comm` (autograd-aware TP/EP primitives and the
vocab-parallel cross-entropy), `model` (RMSNorm, GQA attention with RoPE and QK-norm, layers,
model chunks), `moe` (router with aux loss, SwiGLU experts, all-to-all token dispatch),
`schedule` (1F1B and interleaved pipeline orders and their executor), `grads` (gradient
reduction and the distributed optimizer), `data` (the synthetic dataset and Megatron's data
path), `train` (the training loop run by the launcher).
"""
