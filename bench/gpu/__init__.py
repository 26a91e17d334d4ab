"""The CUDA path checked and measured on a GPU machine in one run (`make gpu-check`, docs/gpu.md)."""
