"""The independent numpy forward pass the fixtures' expected scores come from."""
