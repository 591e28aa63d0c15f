"""Segmented gather matmul (SGMV) ops for multi-tenant LoRA: torch reference and Triton kernels."""
