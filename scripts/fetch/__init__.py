"""Setting up: models, tokenizers and the GGUF and checkpoint converters."""
