"""The models the engine runs: a Llama-style decoder, BART (encoder–decoder), their shapes and checkpoints."""
