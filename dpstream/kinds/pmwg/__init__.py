"""The PMWG flow kind: adaptive linear queries answered privately over a growing database."""
