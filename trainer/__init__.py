"""Swin and ViT models, fused ops, the training loop and checkpoints."""
