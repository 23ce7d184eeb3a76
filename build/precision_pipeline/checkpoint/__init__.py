"""Reading TensorRT-LLM checkpoints: headers, per-layer formats and dequantization."""
