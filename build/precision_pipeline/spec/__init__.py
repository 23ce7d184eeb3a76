"""What the pipeline is told and knows: profiles, number formats, GPUs, model architecture, the default model."""
