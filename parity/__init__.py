"""Cross-framework bridge: `convert` (tensors and weights), `compare` (errors, tolerances),
`report` (the `python -m parity` job)."""
