"""The quantize stage: calibration text, ModelOpt PTQ, the per-layer search and the TensorRT-LLM checkpoint export."""
