"""The accuracy gate: golden prompts, metrics against the unquantized model, the report, and the engine gate."""
