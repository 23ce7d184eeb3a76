"""The engine stage: the trtllm-build command line and running it where TensorRT-LLM and a GPU exist."""
