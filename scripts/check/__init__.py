"""Checks beyond `cargo test`: code shape, maps, doc commands, deploy/, tokenizers."""
