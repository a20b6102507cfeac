"""Kernels: segmented-gather LoRA and paged attention, each with a torch reference."""
