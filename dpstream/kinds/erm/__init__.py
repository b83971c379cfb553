"""The ERM flow kind: private classifiers released continually from labelled events."""
